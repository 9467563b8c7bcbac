"""`--moe-use-upcycling`: start a MoE model from a dense checkpoint, each expert a copy of its layer's dense MLP.

`--load` names the dense (torch_dist) checkpoint, the flags describe the MoE model, and `--save` must not hold a
checkpoint yet (upcycling is for the first run; later runs resume from `--save` without the flag). Three steps:

1. `check_sources` (every rank, before the model is built; file reads only): the dense checkpoint exists, is
   logical, is not a MoE checkpoint, and has this run's layers and widths; `--save` is empty.
2. `upcycle_and_load`, once the model is built: the freshly initialised MoE model is saved, model only, into a
   scratch directory under `--save` (its initial weights depend on the seed and the module identity only, see
   megatron/core/transformer/init_seeds.py, so this is the MoE model the flags describe at any layout). Rank 0
   reads it and the dense checkpoint whole (dist_checkpointing/offline.py) and writes the upcycled checkpoint
   into `--save` at the dense checkpoint's iteration and consumed samples: every expert
   `...mlp.experts.local_experts.{e}.linear_fc1/linear_fc2` is the dense `...mlp.linear_fc1/linear_fc2`, every
   other dense tensor is copied under its name, and what the dense model lacks (router, expert bias, shared
   experts) keeps its fresh initialisation.
3. Every rank loads that checkpoint from `--save` the normal way (any wrapper and layout reshards it), without
   optimizer state (as `--no-load-optim`): the optimizer and the learning-rate schedule start afresh.
"""

import copy
import os
import re
import shutil

import torch.distributed as dist

from megatron.core.dist_checkpointing.checkpoint_directory import iteration_dir_name
from megatron.training import checkpoint_sources
from megatron.training.checkpoint_args import architecture_differences

SCRATCH_SUBDIR = "upcycling_fresh_moe"  # under --save while step 2 runs; removed after
_EXPERT_KEY = re.compile(r"^(?P<prefix>.*\.mlp\.)experts\.local_experts\.\d+\.(?P<rest>linear_fc[12]\..*)$")


class UpcyclingError(ValueError):
    """A dense checkpoint or a --save directory that upcycling cannot use: the message names the flag."""


def check_sources(args):
    """Refuse, naming the flag, what `upcycle_and_load` cannot use. Returns the dense checkpoint's source."""
    if os.path.isdir(args.save) and (checkpoint_sources.checkpoint_iterations(args.save)
                                     or checkpoint_sources.read_tracker(args.save) is not None):
        raise UpcyclingError(f"--moe-use-upcycling: --save {args.save} already holds a checkpoint; upcycling is for "
                             "the first run only: drop --moe-use-upcycling to resume that checkpoint (with --load "
                             f"{args.save}), or pass an empty --save directory")
    source = checkpoint_sources.checkpoint_to_load(args)
    if source is None:
        raise UpcyclingError(f"--moe-use-upcycling: --load {args.load} holds no checkpoint (no tracker file); it "
                             "must name the dense checkpoint to upcycle")
    if source.format != "torch_dist":
        raise UpcyclingError(f"--moe-use-upcycling: {source.directory} is not a torch_dist checkpoint; convert the "
                             "dense checkpoint with --ckpt-convert-format torch_dist first")
    saved = checkpoint_sources.saved_args(source)
    if saved is None:
        return source  # converted from weights: the tensor shapes are checked when the checkpoint is written
    if getattr(saved, "num_experts", None):
        raise UpcyclingError(f"--moe-use-upcycling: {source.directory} is already a MoE checkpoint (--num-experts "
                             f"{saved.num_experts}); upcycling starts from a dense one")
    dense_view = copy.copy(args)
    dense_view.num_experts = None  # compare the layers the dense model has, not the MoE flags
    differences = architecture_differences(saved, dense_view)
    if saved.num_layers != args.num_layers:
        differences.insert(0, f"--num-layers: {saved.num_layers} in the checkpoint, {args.num_layers} in this run")
    expert_width = args.moe_ffn_hidden_size or args.ffn_hidden_size
    if expert_width != saved.ffn_hidden_size:
        differences.append(f"--moe-ffn-hidden-size: each expert copies the dense MLP of width {saved.ffn_hidden_size} "
                           f"(--ffn-hidden-size of the checkpoint), this run's experts have width {expert_width}")
    if differences:
        raise UpcyclingError(f"--moe-use-upcycling: the dense checkpoint {source.directory} does not match this "
                             "run's layers: " + "; ".join(differences) + ". Launch with the checkpoint's values")
    return source


def upcycle_and_load(model_chunks, optimizer, scheduler, args):
    """Write the upcycled checkpoint into `--save` and load it (collective); returns the iteration to resume."""
    from megatron.training import checkpointing
    from megatron.training.dist_checkpoint import save_dist_checkpoint

    source = check_sources(args)
    scratch = os.path.join(args.save, SCRATCH_SUBDIR)
    fresh_args = copy.copy(args)
    fresh_args.save, fresh_args.no_save_optim, fresh_args.no_save_rng = scratch, True, True
    fresh_args.async_save, fresh_args.keep_last_n = False, None
    save_dist_checkpoint(0, model_chunks, None, None, fresh_args)
    failure = None
    if dist.get_rank() == 0:
        try:
            write_upcycled_checkpoint(source.directory, os.path.join(scratch, iteration_dir_name(0)), args.save, args)
        except (UpcyclingError, OSError) as error:
            failure = error
        shutil.rmtree(scratch, ignore_errors=True)
    failures = [None] * dist.get_world_size()
    dist.all_gather_object(failures, None if failure is None else str(failure))
    if failures[0] is not None:
        raise failure if failure is not None else UpcyclingError(failures[0])
    load_args = copy.copy(args)
    load_args.load, load_args.no_load_optim, load_args.ckpt_step = args.save, True, None
    iteration = checkpointing.load_checkpoint(model_chunks, optimizer, scheduler, load_args)
    args.consumed_train_samples = load_args.consumed_train_samples
    args.skipped_train_samples = getattr(load_args, "skipped_train_samples", 0)
    return iteration


def upcycled_model(dense, fresh):
    """{logical name: tensor} of the MoE model: `fresh` (the MoE model's initial weights) with every expert's
    fc1/fc2 the dense MLP's, every dense tensor under its own name (or the MoE layer's pre-MLP norm for a norm
    fused into fc1), the rest as in `fresh`. Every dense tensor must land somewhere."""
    result, used = {}, set()
    for name, initial in fresh.items():
        expert = _EXPERT_KEY.match(name)
        norm_source = _fused_norm_source(name, dense)
        source = expert["prefix"] + expert["rest"] if expert else norm_source or name
        if source not in dense:
            if expert:
                raise UpcyclingError(f"the dense checkpoint has no {source} to copy into expert tensor {name}")
            result[name] = initial
            continue
        if tuple(dense[source].shape) != tuple(initial.shape):
            raise UpcyclingError(f"{name} has shape {tuple(initial.shape)} in this run, the dense checkpoint's "
                                 f"{source} {tuple(dense[source].shape)}: --hidden-size, --ffn-hidden-size and "
                                 "--moe-ffn-hidden-size must give the dense model's widths")
        result[name] = dense[source].to(initial.dtype).clone()
        used.add(source)
    unused = sorted(set(dense) - used)
    if unused:
        raise UpcyclingError(f"the MoE model has no place for the dense checkpoint's {', '.join(unused[:4])}"
                             f"{' ...' if len(unused) > 4 else ''}: launch with the dense model's flags")
    return result


def _fused_norm_source(name, dense):
    """The dense name of a MoE layer's `pre_mlp_layernorm` where the dense MLP fused that norm into its fc1."""
    match = re.match(r"^(?P<prefix>.*\.)pre_mlp_layernorm\.(?P<what>weight|bias)$", name)
    if match is None or name in dense:
        return None
    fused = f"{match['prefix']}mlp.linear_fc1.layer_norm_{match['what']}"
    return fused if fused in dense else None


def write_upcycled_checkpoint(dense_directory, fresh_directory, root, args):
    """Rank 0 (or a tool): write the upcycled checkpoint under `root` at the dense checkpoint's iteration."""
    from megatron.core.dist_checkpointing import offline

    dense_state = offline.read_checkpoint(dense_directory)
    fresh_state = offline.read_checkpoint(fresh_directory)
    model = upcycled_model(offline.full_precision_model(dense_state), offline.full_precision_model(fresh_state))
    dense_common = dense_state.get("common") or {}
    common = dict(fresh_state["common"])
    iteration = 0 if dense_common.get("iteration") in (None, "release") else int(dense_common["iteration"])
    common.update(iteration=iteration, args=args,
                  consumed_train_samples=dense_common.get("consumed_train_samples", 0),
                  skipped_train_samples=dense_common.get("skipped_train_samples", 0))
    common["layout"] = dict(common["layout"], wrapper=f"upcycled from {dense_directory}")
    state = {f"model.{name}": tensor for name, tensor in model.items()}
    state["common"] = common
    offline.write_checkpoint(root, iteration, state, common["layout"])
    print(f"--moe-use-upcycling: wrote the MoE checkpoint of {len(model)} tensors upcycled from {dense_directory} "
          f"to {root} (iteration {iteration})", flush=True)
    return model
