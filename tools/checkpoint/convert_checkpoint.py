"""Convert a logical (torch_dist) checkpoint to one full-precision torch.save file or a safetensors file, and back.

    python tools/checkpoint/convert_checkpoint.py --to torch       --input CKPT_ROOT --output model.pt
    python tools/checkpoint/convert_checkpoint.py --to safetensors --input CKPT_ROOT --output model.safetensors
    python tools/checkpoint/convert_checkpoint.py --from torch       --input model.pt --output NEW_ROOT
    python tools/checkpoint/convert_checkpoint.py --from safetensors --input model.safetensors --output NEW_ROOT

torch: `{"model": {logical name: fp32 tensor}, "checkpoint": {every other key: value}}` (optimizer moments and
main weights, step, scheduler, iteration, args); converting back gives a checkpoint that resumes exactly.
safetensors: the fp32 model weights under their logical names, the iteration in the file's metadata; converting
back gives a model-only checkpoint (training loads it with a fresh optimizer).
The logical names are those of the unsplit GPTModel, and a checkpoint written back loads at any TP/PP/DP.
"""

import argparse
import os

import _paths  # noqa: F401  (repository on sys.path)
import torch


def to_torch(directory, output):
    from megatron.core.dist_checkpointing import offline

    state = offline.read_checkpoint(_paths.resolve_iteration_dir(directory))
    model = offline.full_precision_model(state)
    rest = {key: value for key, value in state.items() if not key.startswith("model.") and
            not key.startswith("rng_state.")}
    torch.save({"model": model, "checkpoint": rest}, output)
    return model


def to_safetensors(directory, output):
    from megatron.core.dist_checkpointing import offline, safetensors_format

    state = offline.read_checkpoint(_paths.resolve_iteration_dir(directory))
    model = offline.full_precision_model(state)
    iteration = (state.get("common") or {}).get("iteration", 0)
    safetensors_format.save_file(model, output, {"format": "megatron_logical", "iteration": iteration})
    return model


def _layout(source):
    return {"tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1, "data_parallel_size": 1,
            "world_size": 1, "wrapper": f"converted from {source}", "ckpt_format": "torch_dist"}


def from_torch(path, root, iteration=None):
    from megatron.core.dist_checkpointing import offline

    saved = torch.load(path, map_location="cpu", weights_only=False)
    if not isinstance(saved, dict) or "model" not in saved:
        raise SystemExit(f"{path}: expected a dict with 'model' (as written by --to torch)")
    state = {f"model.{name}": tensor for name, tensor in saved["model"].items()}
    state.update(saved.get("checkpoint", {}))
    common = dict(state.get("common") or {})
    common["iteration"] = common.get("iteration", 0) if iteration is None else iteration
    common["layout"] = _layout(os.path.basename(path))
    state["common"] = common
    offline.write_checkpoint(root, common["iteration"], state, common["layout"])


def from_safetensors(path, root, iteration=None):
    from megatron.core.dist_checkpointing import offline, safetensors_format

    tensors, metadata = safetensors_format.load_file(path)
    iteration = int(metadata.get("iteration", 0)) if iteration is None else iteration
    state = {f"model.{name}": tensor for name, tensor in tensors.items()}
    layout = _layout(os.path.basename(path))
    state["common"] = {"checkpoint_version": 1, "iteration": iteration, "consumed_train_samples": 0,
                       "args": None, "layout": layout}
    offline.write_checkpoint(root, iteration, state, layout)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    direction = parser.add_mutually_exclusive_group(required=True)
    direction.add_argument("--to", choices=["torch", "safetensors"])
    direction.add_argument("--from", dest="source", choices=["torch", "safetensors"])
    parser.add_argument("--input", required=True)
    parser.add_argument("--output", required=True)
    parser.add_argument("--iteration", type=int, default=None,
                        help="With --from: iteration of the written checkpoint (default: the one recorded).")
    options = parser.parse_args()
    if options.to == "torch":
        to_torch(options.input, options.output)
    elif options.to == "safetensors":
        to_safetensors(options.input, options.output)
    elif options.source == "torch":
        from_torch(options.input, options.output, options.iteration)
    else:
        from_safetensors(options.input, options.output, options.iteration)
    print(f"wrote {options.output}")


if __name__ == "__main__":
    main()
