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
from typing import Dict, List

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
    """A plain (FP32Optimizer) or mixed-precision (Float16Optimizer) optimizer's state dict."""
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


def _distributed_shards(stage_state, mp_dir) -> Dict[str, Dict[str, torch.Tensor]]:
    """The distributed optimizer's per-data-parallel-rank files of one model-parallel rank, joined."""
    from megatron.training.checkpointing import _torch_load

    paths = sorted(glob.glob(os.path.join(mp_dir, "distrib_optim_dp_rank_*.pt")))
    if not paths:
        _fail(f"{mp_dir} has no distrib_optim_dp_rank_*.pt files (saved with --use-distributed-optimizer?)")
    model = _model_tensors(stage_state)
    names = param_names(stage_state)
    flat, covered = {}, {}
    for path in paths:
        shard_state = _torch_load(path)["optimizer"]
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


def local_optimizer_state(stage_state, mp_dir):
    """{local parameter name: {state key: whole TP partition}} of one model-parallel rank, or None when the
    checkpoint holds no optimizer state."""
    if "optimizer" in stage_state:
        return _whole_partitions(stage_state, stage_state["optimizer"])
    if glob.glob(os.path.join(mp_dir, "distrib_optim_dp_rank_*.pt")):
        return _distributed_shards(stage_state, mp_dir)
    return None


def _max_step(torch_state):
    steps = [float(entry["step"]) for entry in torch_state["state"].values() if "step" in entry]
    return max(steps) if steps else None


def common_optimizer_state(stage_state, mp_dir):
    """(step, hyperparameters of the param groups, grad-scaler state) of one model-parallel rank."""
    from megatron.training.checkpointing import _torch_load

    if "optimizer" in stage_state:
        optimizer_states = [stage_state["optimizer"]]
    else:
        optimizer_states = [_torch_load(path)["optimizer"]
                            for path in sorted(glob.glob(os.path.join(mp_dir, "distrib_optim_dp_rank_*.pt")))]
    steps = [step for step in (_max_step(state["optimizer"]) for state in optimizer_states) if step is not None]
    groups = [{key: value for key, value in group.items() if key != "params"}
              for group in optimizer_states[0]["optimizer"]["param_groups"]]
    return (max(steps) if steps else None), groups, optimizer_states[0].get("grad_scaler")
