"""Convert a `--ckpt-format torch` checkpoint (one file per model-parallel rank) into the logical torch_dist
format, which loads at any TP/PP/DP and under any wrapper.

    python tools/checkpoint/convert_legacy.py --input LEGACY_ROOT --output NEW_ROOT

Converted: model weights (tensor-parallel partitions joined, pipeline stages' layers renumbered globally),
the optimizer state (Adam moments and fp32 main weights joined the same way, from whole partitions or from the
distributed optimizer's per-data-parallel-rank shards; step count, hyperparameters, loss scaler), scheduler,
every rank's RNG states (with the rank's tensor-, pipeline- and data-parallel coordinates, so that a run at the
same layout restores them all and one at another layout those that map), iteration, consumed samples and
arguments. A run resumed from the converted checkpoint at the legacy layout continues exactly as one resumed
from the legacy checkpoint.
"""

import argparse
import glob
import os
import re

import _paths  # noqa: F401  (repository on sys.path)
import legacy_optimizer
import torch

# Partition dim of each tensor-parallel GPT tensor, by name suffix (see megatron/core/tensor_parallel/layers.py);
# every other tensor is the same on all TP ranks.
PARTITION_DIMS = {
    "word_embeddings.weight": 0, "output_layer.weight": 0,
    "linear_qkv.weight": 0, "linear_qkv.bias": 0, "linear_fc1.weight": 0, "linear_fc1.bias": 0,
    "linear_proj.weight": 1, "linear_fc2.weight": 1,
}


def partition_dim(name):
    for suffix, dim in PARTITION_DIMS.items():
        if name.endswith(suffix):
            return dim
    return None


def _rank_files(iteration_dir):
    files = {}
    for path in glob.glob(os.path.join(iteration_dir, "mp_rank_*", "model_optim_rng.pt")):
        match = re.match(r"mp_rank_(\d+)(?:_(\d+))?$", os.path.basename(os.path.dirname(path)))
        files[(int(match.group(1)), int(match.group(2) or 0))] = path
    if not files:
        raise SystemExit(f"{iteration_dir}: no mp_rank_*/model_optim_rng.pt files (is it a torch-format checkpoint?)")
    return files


def _join(parts, name, tp_size):
    dim = partition_dim(name) if tp_size > 1 else None
    return torch.cat(parts, dim=dim) if dim is not None else parts[0]


def _stage_offsets(args, pp_size):
    """The global index of each pipeline stage's first layer: from the split the run saved
    (`virtual_stage_layer_counts`, uneven with --decoder-first/last-pipeline-num-layers, the accounting flags or
    --pipeline-model-parallel-layout), else the even split."""
    if pp_size == 1:
        return [0]
    counts = getattr(args, "virtual_stage_layer_counts", None)
    if counts is not None:
        if len(counts) != pp_size:
            raise SystemExit(f"the checkpoint was saved with {len(counts)} virtual pipeline stages on {pp_size} "
                             "pipeline ranks; converting an interleaved-pipeline torch checkpoint is not supported")
        return [sum(counts[:pp_rank]) for pp_rank in range(pp_size)]
    num_layers = getattr(args, "num_layers", None)
    if num_layers is None:
        raise SystemExit("the checkpoint's args lack num_layers; cannot renumber pipeline stages' layers")
    return [pp_rank * (num_layers // pp_size) for pp_rank in range(pp_size)]


def _is_tied_copy(args, name, pp_rank, pp_size):
    """The last stage's output layer of a tied model: a copy of the first stage's word embedding."""
    tied = pp_size > 1 and not getattr(args, "untie_embeddings_and_output_weights", False)
    return tied and pp_rank == pp_size - 1 and name == "output_layer.weight"


def _optimizer_state(states, files, tp_size, pp_size, args):
    """Logical optimizer entries (`optimizer.state.<name>.<key>`, step, param groups, scaler), or {}."""
    from megatron.core.dist_checkpointing.model_state import logical_name

    legacy = {key: legacy_optimizer.read_optimizer_state(states[key], os.path.dirname(path))
              for key, path in files.items()}
    if any(value is None for value in legacy.values()):
        return {}
    offsets = _stage_offsets(args, pp_size)
    result = {}
    for pp_rank in range(pp_size):
        stage = [legacy[(tp_rank, pp_rank)].tensors for tp_rank in range(tp_size)]
        for name, entries in stage[0].items():
            if _is_tied_copy(args, name, pp_rank, pp_size):
                continue
            for key in entries:
                full = _join([part[name][key] for part in stage], name, tp_size)
                result[f"optimizer.state.{logical_name(name, offsets[pp_rank])}.{key}"] = full
    steps = [state.step for state in legacy.values() if state.step is not None]
    result.update({"optimizer.step": max(steps) if steps else None,
                   "optimizer.param_groups": legacy[(0, 0)].param_groups,
                   "optimizer.grad_scaler": legacy[(0, 0)].grad_scaler})
    return result


def _rng_states(states):
    """(`rng_state.<index>` entries, {index: (tensor, pipeline, data, expert) coordinates})."""
    entries, coordinates = {}, {}
    for (tp_rank, pp_rank), state in sorted(states.items(), key=lambda item: (item[0][1], item[0][0])):
        for dp_rank, rank_state in enumerate(state.get("rng_state") or []):
            index = len(entries)
            entries[f"rng_state.{index}"] = rank_state
            coordinates[index] = (tp_rank, pp_rank, dp_rank, 0)
    return entries, coordinates


def convert(input_root, output_root):
    """Returns (model tensors by logical name, iteration, the other keys written)."""
    from megatron.core.dist_checkpointing import offline
    from megatron.core.dist_checkpointing.model_state import logical_name
    from megatron.training.checkpointing import _torch_load

    iteration_dir = _paths.resolve_iteration_dir(input_root)
    files = _rank_files(iteration_dir)
    tp_size = 1 + max(tp for tp, _ in files)
    pp_size = 1 + max(pp for _, pp in files)
    states = {key: _torch_load(path) for key, path in files.items()}
    first = states[(0, 0)]
    args = first.get("args")
    offsets = _stage_offsets(args, pp_size)
    model = {}
    for pp_rank in range(pp_size):
        stage = [states[(tp_rank, pp_rank)]["model"] for tp_rank in range(tp_size)]
        for name in stage[0]:
            if _is_tied_copy(args, name, pp_rank, pp_size):
                continue
            model[logical_name(name, offsets[pp_rank])] = _join([part[name] for part in stage], name, tp_size)
    iteration = first.get("iteration", 0)
    state = {f"model.{name}": tensor for name, tensor in model.items()}
    state.update(_optimizer_state(states, files, tp_size, pp_size, args))
    if "opt_param_scheduler" in first:
        state["scheduler"] = first["opt_param_scheduler"]
    rng, coordinates = _rng_states(states)
    state.update(rng)
    dp_size = len(first.get("rng_state") or []) or len(glob.glob(
        os.path.join(os.path.dirname(files[(0, 0)]), "distrib_optim_dp_rank_*.pt"))) or None
    layout = {"tensor_model_parallel_size": tp_size, "pipeline_model_parallel_size": pp_size,
              "data_parallel_size": dp_size, "world_size": tp_size * pp_size * dp_size if dp_size else None,
              "wrapper": "converted from --ckpt-format torch", "ckpt_format": "torch_dist"}
    state["common"] = {"checkpoint_version": 1, "iteration": iteration,
                       "consumed_train_samples": first.get("consumed_train_samples", 0),
                       "skipped_train_samples": first.get("skipped_train_samples",
                                                          getattr(args, "skipped_train_samples", 0)),
                       "args": args,
                       "layout": layout, "vocab_size": first.get("vocab_size")}  # before padding, if recorded
    if coordinates:
        state["common"]["rng_coordinates"] = coordinates
    iteration = _paths.output_iteration(input_root, iteration)
    offline.write_checkpoint(output_root, iteration, state, layout)
    return model, iteration, sorted(key for key in state if not key.startswith("model."))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", required=True, help="Root (or iteration directory) of the torch-format checkpoint.")
    parser.add_argument("--output", required=True, help="Root to write the torch_dist checkpoint into.")
    options = parser.parse_args()
    model, iteration, others = convert(options.input, options.output)
    optimizer = sum(key.startswith("optimizer.state.") for key in others)
    rng = sum(key.startswith("rng_state.") for key in others)
    print(f"converted iteration {iteration}: {len(model)} model tensors, {optimizer} optimizer tensors"
          + ("" if optimizer else " (the checkpoint has no optimizer state)")
          + f", {rng} ranks' RNG states" + (", scheduler" if "scheduler" in others else "")
          + f" -> {options.output}")


if __name__ == "__main__":
    main()
