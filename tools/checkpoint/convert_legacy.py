"""Convert a `--ckpt-format torch` checkpoint (one file per model-parallel rank) into the logical torch_dist
format, which loads at any TP/PP/DP and under any wrapper.

    python tools/checkpoint/convert_legacy.py --input LEGACY_ROOT --output NEW_ROOT

Converted: model weights (tensor-parallel partitions joined, pipeline stages' layers renumbered globally),
iteration, consumed samples, scheduler and arguments. Not converted: optimizer state and RNG states (their
torch-format layout is tied to the writing ranks); the converted run starts with a fresh optimizer state.
"""

import argparse
import glob
import os
import re

import _paths  # noqa: F401  (repository on sys.path)
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


def convert(input_root, output_root):
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
    num_layers = getattr(args, "num_layers", None)
    if pp_size > 1 and num_layers is None:
        raise SystemExit("the checkpoint's args lack num_layers; cannot renumber pipeline stages' layers")
    tied = pp_size > 1 and not getattr(args, "untie_embeddings_and_output_weights", False)
    model = {}
    for pp_rank in range(pp_size):
        offset = pp_rank * (num_layers // pp_size) if pp_size > 1 else 0
        stage = [states[(tp_rank, pp_rank)]["model"] for tp_rank in range(tp_size)]
        for name in stage[0]:
            if tied and pp_rank == pp_size - 1 and pp_rank > 0 and name == "output_layer.weight":
                continue  # the tied copy of the first stage's word embedding
            parts = [part[name] for part in stage]
            dim = partition_dim(name) if tp_size > 1 else None
            full = torch.cat(parts, dim=dim) if dim is not None else parts[0]
            model[logical_name(name, offset)] = full
    iteration = first.get("iteration", 0)
    state = {f"model.{name}": tensor for name, tensor in model.items()}
    if "opt_param_scheduler" in first:
        state["scheduler"] = first["opt_param_scheduler"]
    layout = {"tensor_model_parallel_size": tp_size, "pipeline_model_parallel_size": pp_size,
              "data_parallel_size": None, "world_size": None, "wrapper": "converted from --ckpt-format torch",
              "ckpt_format": "torch_dist"}
    state["common"] = {"checkpoint_version": 1, "iteration": iteration,
                       "consumed_train_samples": first.get("consumed_train_samples", 0), "args": args,
                       "layout": layout}
    offline.write_checkpoint(output_root, iteration, state, layout)
    return model, iteration


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", required=True, help="Root (or iteration directory) of the torch-format checkpoint.")
    parser.add_argument("--output", required=True, help="Root to write the torch_dist checkpoint into.")
    options = parser.parse_args()
    model, iteration = convert(options.input, options.output)
    print(f"converted iteration {iteration}: {len(model)} model tensors -> {options.output} "
          "(optimizer and RNG state not converted)")


if __name__ == "__main__":
    main()
