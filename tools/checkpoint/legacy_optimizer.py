"""The optimizer state of a `--ckpt-format torch` checkpoint, per parameter name (for convert_legacy.py).

The torch format keeps the optimizer's state by position: a plain or mixed-precision optimizer's
`torch.optim` state dict numbers its main parameters in param-group order (one per model parameter, whole
TP partitions); the distributed optimizer writes one file per data-parallel rank, numbering that rank's shards,
each shard `(parameter index, start, end)` a flat range of a model parameter. `optimizer_param_names` (saved
next to the model since the names were recorded; otherwise rebuilt from the default weight-decay grouping and
checked against the state) turns positions into names. The result, per model-parallel rank and local parameter
name: whole TP partitions of `exp_avg`, `exp_avg_sq` (and `fp32_param` for weights not held in fp32), which
convert_legacy.py joins and renames like the weights.
"""

import glob
import os
from typing import Dict, List, NamedTuple, Optional

import torch

MAIN_PARAM_KEY = "fp32_param"


def _fail(message):
    raise SystemExit(f"cannot convert the optimizer state: {message}")


def _model_tensors(stage_state):
    return {name: value for name, value in stage_state["model"].items() if torch.is_tensor(value)}


def param_names(stage_state, count=None) -> List[str]:
    """Local names of the parameters in the optimizer's order."""
    recorded = stage_state.get("optimizer_param_names")
    if recorded is not None:
        if any(chunk != 0 for chunk, _ in recorded):
            _fail("the checkpoint has several model chunks per rank (virtual pipeline)")
        return [name for _, name in recorded]
    # Written before the names were recorded: the default grouping of get_param_groups (weight-decayed
    # parameters first, then biases and 1-D tensors), each in model order.
    tensors = _model_tensors(stage_state)
    no_decay = [name for name, value in tensors.items() if name.endswith(".bias") or value.dim() == 1]
    names = [name for name in tensors if name not in no_decay] + no_decay
    if count is not None and count != len(names):
        _fail(f"the optimizer steps {count} parameters but the model has {len(names)} tensors, and the checkpoint "
              "does not record the parameters' names (written before they were recorded)")
    return names


def _add(result, name, key, tensor):
    if name in result and key in result[name]:
        _fail(f"'{name}' has two '{key}' entries")
    result.setdefault(name, {})[key] = tensor


def _whole_partitions(stage_state, optimizer_state) -> Dict[str, Dict[str, torch.Tensor]]:
    """The tensors of a plain (FP32Optimizer) or mixed-precision (Float16Optimizer) optimizer's state dict."""
    torch_state = optimizer_state["optimizer"]
    ids = [param_id for group in torch_state["param_groups"] for param_id in group["params"]]
    names = param_names(stage_state, len(ids))
    model = _model_tensors(stage_state)
    main_params = optimizer_state.get("fp32_main_params")
    result = {}
    for position, (param_id, name) in enumerate(zip(ids, names)):
        shape = model[name].shape
        for key, value in torch_state["state"].get(param_id, {}).items():
            if torch.is_tensor(value) and value.dim() > 0:
                if value.shape != shape:
                    _fail(f"'{name}.{key}' has shape {tuple(value.shape)}, the weight {tuple(shape)}")
                _add(result, name, key, value.float())
        if main_params is not None and model[name].dtype != torch.float32:
            _add(result, name, MAIN_PARAM_KEY, main_params[position].float().view(shape))
    return result


def _distributed_shards(stage_state, mp_dir, shard_states) -> Dict[str, Dict[str, torch.Tensor]]:
    """The tensors of the distributed optimizer's per-data-parallel-rank states of one model-parallel rank,
    joined into whole partitions."""
    model = _model_tensors(stage_state)
    names = param_names(stage_state)
    flat, covered = {}, {}
    for path, shard_state in shard_states.items():
        torch_state = shard_state["optimizer"]
        for position, (index, start, end) in enumerate(shard_state["shard_layout"]):
            if index >= len(names):
                _fail(f"{path}: shard {position} is of parameter {index}, the model has {len(names)}")
            name = names[index]
            numel = model[name].numel()
            if end > numel:
                _fail(f"{path}: shard [{start}, {end}) of '{name}' is outside its {numel} elements")
            entries = {key: value for key, value in torch_state["state"].get(position, {}).items()
                       if torch.is_tensor(value) and value.dim() > 0}
            if model[name].dtype != torch.float32:
                entries[MAIN_PARAM_KEY] = shard_state["fp32_main_params"][position]
            for key, value in entries.items():
                target = flat.setdefault(name, {}).setdefault(key, torch.zeros(numel, dtype=torch.float32))
                target[start:end] = value.reshape(-1).float()
                covered.setdefault((name, key), 0)
                covered[(name, key)] += end - start
    result = {}
    for name, entries in flat.items():
        for key, value in entries.items():
            if covered[(name, key)] != model[name].numel():
                _fail(f"the shards of '{name}.{key}' cover {covered[(name, key)]} of {model[name].numel()} elements "
                      f"(is a distrib_optim_dp_rank_*.pt file of {mp_dir} missing?)")
            _add(result, name, key, value.view(model[name].shape))
    return result


class LegacyOptimizerState(NamedTuple):
    tensors: Dict[str, Dict[str, torch.Tensor]]  # {local parameter name: {state key: whole TP partition}}
    step: Optional[float]
    param_groups: list  # hyperparameters, without the parameters
    grad_scaler: Optional[dict]


def _max_step(torch_state):
    steps = [float(entry["step"]) for entry in torch_state["state"].values() if "step" in entry]
    return max(steps) if steps else None


def read_optimizer_state(stage_state, mp_dir) -> Optional[LegacyOptimizerState]:
    """The optimizer state of one model-parallel rank (`stage_state` is its model_optim_rng.pt, `mp_dir` the
    directory holding it), or None when the checkpoint holds none."""
    from megatron.training.checkpointing import _torch_load

    if "optimizer" in stage_state:
        optimizer_states = {os.path.join(mp_dir, "model_optim_rng.pt"): stage_state["optimizer"]}
        tensors = _whole_partitions(stage_state, stage_state["optimizer"])
    else:
        paths = sorted(glob.glob(os.path.join(mp_dir, "distrib_optim_dp_rank_*.pt")))
        if not paths:
            return None
        optimizer_states = {path: _torch_load(path)["optimizer"] for path in paths}
        tensors = _distributed_shards(stage_state, mp_dir, optimizer_states)
    first = next(iter(optimizer_states.values()))
    steps = [step for step in (_max_step(state["optimizer"]) for state in optimizer_states.values())
             if step is not None]
    groups = [{key: value for key, value in group.items() if key != "params"}
              for group in first["optimizer"]["param_groups"]]
    return LegacyOptimizerState(tensors, max(steps) if steps else None, groups, first.get("grad_scaler"))
