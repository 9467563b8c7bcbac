"""`--save` / `--load`: dispatch by `--ckpt-format`, and Megatron's `torch` format itself.

`torch_dist` (and its aliases `torch_dcp`, `fsdp_dtensor`) is the logical, resharding format of
dist_checkpoint.py. The `torch` format keeps one file per model-parallel rank plus a tracker file.

Layout of the torch format under the checkpoint root:

    latest_checkpointed_iteration.txt            the last complete checkpoint's iteration number
    iter_0000010/mp_rank_00/model_optim_rng.pt   (mp_rank_TT_PPP with pipeline parallelism)
    iter_0000010/mp_rank_00/distrib_optim_dp_rank_001.pt   optimizer shard of DP rank 1 (distributed optimizer)
    iter_0000020.tmp/                            a save in progress (or one that was interrupted): never loaded

Only data-parallel rank 0 of each model-parallel rank writes `model_optim_rng.pt` (model, optimizer unless
distributed, the names of the parameters in the optimizer's order, scheduler, every DP rank's RNG state, args,
iteration). Every rank writes into `iter_XXXXXXX.tmp/` (each file to a temporary name, then renamed); once all
have, global rank 0 renames the directory into place and then writes the tracker (as the logical format
publishes): a save interrupted at any point leaves the previous checkpoint as the latest, and readable.
"""

import copy
import glob
import os
import re
import shutil

import torch
import torch.distributed as dist

from megatron.core.dist_checkpointing.checkpoint_directory import (  # noqa: F401  (part of this module's API)
    RELEASE,
    TEMPORARY_SUFFIX,
    TRACKER_FILENAME,
    CheckpointSaveError,
    earlier_checkpoint_advice,
    iteration_dir_name,
    move_into_place,
    published_directory,
    read_tracker,
    write_tracker,
)
from megatron.core.distributed.data_parallel_base import unwrap_model
from megatron.core.fp8.checkpoint import count_fp8_histories_started_empty
from megatron.core.dist_checkpointing.param_groups import GROUPING_FLAGS, ParamGroupMismatchError, reorder_by_name
from megatron.training import checkpoint_sources
from megatron.training.checkpoint_args import (
    check_resumed_optimizer,
    check_same_architecture,
    layer_count_hint,
    padding_origin,
    saved_true_vocab_size,
    true_vocab_size,
)
from megatron.training.checkpoint_optimizer_shards import RESHARD_HINT, reshard_hint
from megatron.training.checkpoint_retention import prune_to_retain_interval, remove_superseded_leftovers
from megatron.training.param_sync import finish_param_syncs
from megatron.training.random_state import rng_state, set_rng_state  # noqa: F401  (part of this module's API)

MODEL_FILENAME = "model_optim_rng.pt"
LOGICAL_FORMATS = ("torch_dist", "torch_dcp", "fsdp_dtensor")
IMPLEMENTED_FORMATS = ("torch",) + LOGICAL_FORMATS


class CheckpointLoadError(RuntimeError):
    """A checkpoint file that cannot be read: the message names it."""


def check_checkpoint_format(args):
    """Fail early, naming the flag, when --save/--load asks for a format this build cannot write."""
    if (args.save or args.load) and args.ckpt_format not in IMPLEMENTED_FORMATS:
        raise NotImplementedError(
            f"not implemented: --ckpt-format {args.ckpt_format} with --save/--load; use one of {IMPLEMENTED_FORMATS}"
        )


def is_logical_format(args):
    return args.ckpt_format in LOGICAL_FORMATS


def maybe_finalize_async_save(args, blocking=False, at_exit=False):
    """Publish a finished `--async-save` write (call on every rank at the same points; cheap when none).
    `at_exit` (blocking, as training ends): a write that failed raises CheckpointSaveError on every rank, as a
    synchronous save would, instead of only being reported."""
    if getattr(args, "async_save", False):
        from megatron.training import dist_checkpoint

        dist_checkpoint.finalize_async_save(args, blocking=blocking or at_exit, raise_if_failed=at_exit)


def model_parallel_dir_name(tensor_rank, pipeline_rank, pipeline_size):
    if pipeline_size == 1:
        return f"mp_rank_{tensor_rank:02d}"
    return f"mp_rank_{tensor_rank:02d}_{pipeline_rank:03d}"


def checkpoint_dir(root, iteration, tensor_rank, pipeline_rank, pipeline_size):
    return os.path.join(
        root, iteration_dir_name(iteration), model_parallel_dir_name(tensor_rank, pipeline_rank, pipeline_size)
    )


def distributed_optimizer_filename(data_parallel_rank):
    return f"distrib_optim_dp_rank_{data_parallel_rank:03d}.pt"


def _serialize(obj, stream):
    torch.save(obj, stream)


def atomic_torch_save(obj, path):
    """Write `obj` to `path` so that `path` either does not exist or holds the complete object. A partial file
    that a writer killed mid-save left next to it (one writer per path) is removed first."""
    for partial in glob.glob(f"{glob.escape(path)}.tmp.*"):
        os.remove(partial)
    temporary = f"{path}.tmp.{os.getpid()}"
    with open(temporary, "wb") as stream:
        _serialize(obj, stream)
        stream.flush()
        os.fsync(stream.fileno())
    os.replace(temporary, path)


def _parallel_ranks():
    from megatron.core import parallel_state

    return {
        "tensor_rank": parallel_state.get_tensor_model_parallel_rank(),
        "pipeline_rank": parallel_state.get_pipeline_model_parallel_rank(),
        "pipeline_size": parallel_state.get_pipeline_model_parallel_world_size(),
        "data_rank": parallel_state.get_data_parallel_rank(with_context_parallel=True),
        "data_group": parallel_state.get_data_parallel_group(with_context_parallel=True),
    }


def _model_state(model_chunks):
    if len(model_chunks) == 1:
        return {"model": unwrap_model(model_chunks[0]).state_dict()}
    return {f"model{index}": unwrap_model(chunk).state_dict() for index, chunk in enumerate(model_chunks)}


def optimizer_param_names(optimizer, model_chunks):
    """The model parameters the optimizer steps, in its order, as `(chunk index, name in the unwrapped chunk)`:
    what turns the optimizer's positional state into per-parameter state (tools/checkpoint/convert_legacy.py)."""
    if not hasattr(optimizer, "model_params"):
        return None
    names = {}
    for index, chunk in enumerate(model_chunks):
        for name, param in unwrap_model(chunk).named_parameters():
            names.setdefault(id(param), (index, name))
    try:
        return [names[id(param)] for param in optimizer.model_params()]
    except (KeyError, NotImplementedError):
        return None


def _load_model_state(model_chunks, state, strict):
    if len(model_chunks) == 1:
        unwrap_model(model_chunks[0]).load_state_dict(state["model"], strict=strict)
        return
    for index, chunk in enumerate(model_chunks):
        unwrap_model(chunk).load_state_dict(state[f"model{index}"], strict=strict)


def save_checkpoint(iteration, model, optimizer, opt_param_scheduler, args):
    """Save a checkpoint of `iteration` under `args.save`; collective over all ranks. A rank that cannot write
    its files (a full or read-only disk), or rank 0 that cannot publish them, makes every rank raise
    `CheckpointSaveError`."""
    from megatron.training.dist_checkpoint import raise_if_any_rank_failed

    check_checkpoint_format(args)
    model_chunks = model if isinstance(model, (list, tuple)) else [model]
    finish_param_syncs(model_chunks)  # --overlap-param-gather: the step's gathers land before the weights are read
    if is_logical_format(args):
        from megatron.training.dist_checkpoint import save_dist_checkpoint

        return save_dist_checkpoint(iteration, model_chunks, optimizer, opt_param_scheduler, args)
    ranks = _parallel_ranks()
    # Every rank writes into ROOT/iter_XXXXXXX.tmp, which rank 0 renames into place once all files are written:
    # a save killed part-way never leaves a mix of new and old files under a published iteration's name.
    temporary = os.path.join(args.save, iteration_dir_name(iteration) + TEMPORARY_SUFFIX)
    directory = os.path.join(temporary, model_parallel_dir_name(
        ranks["tensor_rank"], ranks["pipeline_rank"], ranks["pipeline_size"]))
    # Collectives first, on every rank: some optimizers gather their state inside state_dict().
    save_optimizer = optimizer is not None and not args.no_save_optim
    optimizer_state = optimizer.state_dict() if save_optimizer else None
    all_rng_states = None
    if not args.no_save_rng:
        all_rng_states = [None] * dist.get_world_size(ranks["data_group"])
        dist.all_gather_object(all_rng_states, rng_state(), group=ranks["data_group"])

    if dist.get_rank() == 0:
        shutil.rmtree(temporary, ignore_errors=True)  # left by an interrupted save of this iteration
    dist.barrier()
    failure = None
    try:
        os.makedirs(directory, exist_ok=True)
        if save_optimizer and args.use_distributed_optimizer:
            atomic_torch_save({"optimizer": optimizer_state},
                              os.path.join(directory, distributed_optimizer_filename(ranks["data_rank"])))
        if ranks["data_rank"] == 0:
            state = {
                "args": args,
                "checkpoint_version": 3.0,
                "iteration": iteration,
                "consumed_train_samples": getattr(args, "consumed_train_samples", 0),
                "skipped_train_samples": getattr(args, "skipped_train_samples", 0),
                "vocab_size": true_vocab_size(args),
                **_model_state(model_chunks),
            }
            if save_optimizer and not args.use_distributed_optimizer:
                state["optimizer"] = optimizer_state
            if save_optimizer:
                state["optimizer_param_names"] = optimizer_param_names(optimizer, model_chunks)
            if save_optimizer and opt_param_scheduler is not None:
                state["opt_param_scheduler"] = opt_param_scheduler.state_dict()
            if all_rng_states is not None:
                state["rng_state"] = all_rng_states
            atomic_torch_save(state, os.path.join(directory, MODEL_FILENAME))
    except OSError as exc:  # a full or read-only disk: every rank learns of it, none waits for the others
        failure = f"{type(exc).__name__}: {exc}"
    raise_if_any_rank_failed(failure, args.save, iteration, temporary)
    if dist.get_rank() == 0:
        try:
            move_into_place(args.save, iteration, temporary)
            prune_to_retain_interval(args.save, iteration, getattr(args, "save_retain_interval", None))
            remove_superseded_leftovers(args.save, iteration)
        except OSError as exc:  # e.g. the disk filled up before the tracker could be written
            failure = f"{type(exc).__name__}: {exc}"
    raise_if_any_rank_failed(failure, args.save, iteration, temporary, publishing=True)


def non_persistent_save_due(args, iteration):
    interval = getattr(args, "non_persistent_save_interval", None)
    return bool(interval) and iteration % interval == 0


def save_non_persistent_checkpoint(iteration, model, optimizer, opt_param_scheduler, args):
    """--non-persistent-save-interval: a torch_dist checkpoint in the non-persistent root, where only the latest
    is kept (it replaces the previous one once published), or with --non-persistent-ckpt-type local each rank's
    part in --non-persistent-local-ckpt-dir (see local_checkpoint); collective."""
    from megatron.training import local_checkpoint
    from megatron.training.dist_checkpoint import save_dist_checkpoint

    model_chunks = model if isinstance(model, (list, tuple)) else [model]
    finish_param_syncs(model_chunks)  # --overlap-param-gather: the step's gathers land before the weights are read
    if local_checkpoint.enabled(args):
        return local_checkpoint.save_local_checkpoint(iteration, model_chunks, optimizer, opt_param_scheduler, args)
    non_persistent = copy.copy(args)
    non_persistent.save = checkpoint_sources.non_persistent_save_dir(args)
    non_persistent.keep_last_n, non_persistent.save_retain_interval = 1, None
    return save_dist_checkpoint(iteration, model_chunks, optimizer, opt_param_scheduler, non_persistent)


def converted_checkpoint_dir(args):
    """Where --ckpt-convert-format F writes, as upstream: the subdirectory F of --ckpt-convert-save (DIR/torch,
    DIR/torch_dist), so that conversions to both formats can share one --ckpt-convert-save."""
    return os.path.join(args.ckpt_convert_save, args.ckpt_convert_format)


def save_converted_checkpoint(iteration, model, optimizer, opt_param_scheduler, args):
    """--ckpt-convert-format: save the checkpoint just loaded from --load in that format to
    `converted_checkpoint_dir` (the training run then stops) as a --save there would (a directory already holding
    checkpoints gets this iteration added and its tracker updated); collective."""
    source = checkpoint_sources.checkpoint_to_load(args)
    if source is None:
        raise FileNotFoundError(f"--ckpt-convert-format {args.ckpt_convert_format}: --load {args.load} holds no "
                                "checkpoint to convert")
    converted = copy.copy(args)
    converted.save, converted.ckpt_format = converted_checkpoint_dir(args), args.ckpt_convert_format
    converted.ckpt_convert_format = converted.ckpt_convert_save = None
    converted.async_save, converted.keep_last_n, converted.save_retain_interval = False, None, None
    save_checkpoint(iteration, model, optimizer, opt_param_scheduler, converted)
    if dist.get_rank() == 0:
        print(f"> converted checkpoint: {source.format or args.ckpt_format} -> {args.ckpt_convert_format}.",
              flush=True)
        print(f"--ckpt-convert-format {args.ckpt_convert_format}: converted the checkpoint of iteration {iteration} "
              f"from --load {args.load} to {converted.save} (train from it with --load {converted.save} "
              f"--ckpt-format {args.ckpt_convert_format}); stopping without training", flush=True)


def _layout_flags(tensor_size, pipeline_size):
    return f"--tensor-model-parallel-size {tensor_size} --pipeline-model-parallel-size {pipeline_size}"


def _change_layout_hint(saved_layout, root):
    """What to do when a torch checkpoint of layout `saved_layout` (TP, PP) is loaded at another one."""
    return (f"the torch format cannot change the model-parallel layout: launch with the checkpoint's "
            f"{_layout_flags(*saved_layout)}, or convert it to torch_dist, which loads at any layout "
            f"(python tools/checkpoint/convert_legacy.py --input {root} --output NEW_ROOT, then --load NEW_ROOT "
            "--ckpt-format torch_dist)")


def _saved_layout(iteration_directory):
    """(TP, PP) as the torch checkpoint's mp_rank_* directories show them, or None when it has none."""
    pattern = re.compile(r"mp_rank_(\d+)(?:_(\d+))?")
    names = os.listdir(iteration_directory) if os.path.isdir(iteration_directory) else []
    ranks = [match.groups() for match in map(pattern.fullmatch, names) if match is not None]
    if not ranks:
        return None
    return 1 + max(int(tensor) for tensor, _ in ranks), 1 + max(int(pipeline or 0) for _, pipeline in ranks)


def _check_files_match_layout(path, args):
    """Raise, naming the layout flags, when this rank's file `path` (ROOT/iter_*/mp_rank_*/file) is missing
    because the checkpoint was written at another TP / PP size."""
    iteration_directory = os.path.dirname(os.path.dirname(path))
    saved_layout = _saved_layout(iteration_directory)
    if saved_layout in (None, (args.tensor_model_parallel_size, args.pipeline_model_parallel_size)):
        return
    raise CheckpointLoadError(
        f"checkpoint file {path} not found: {iteration_directory} was saved with {_layout_flags(*saved_layout)} "
        f"(its mp_rank_* directories) but this run uses "
        f"{_layout_flags(args.tensor_model_parallel_size, args.pipeline_model_parallel_size)}; "
        f"{_change_layout_hint(saved_layout, os.path.dirname(iteration_directory))}")


def _check_layout_matches(saved_args, args, path):
    for name, flag in (
        ("tensor_model_parallel_size", "--tensor-model-parallel-size"),
        ("pipeline_model_parallel_size", "--pipeline-model-parallel-size"),
    ):
        saved, current = getattr(saved_args, name, None), getattr(args, name)
        if saved is not None and saved != current:
            saved_layout = (getattr(saved_args, "tensor_model_parallel_size", 1),
                            getattr(saved_args, "pipeline_model_parallel_size", 1))
            root = os.path.dirname(os.path.dirname(os.path.dirname(path)))  # ROOT/iter_*/mp_rank_*/file
            raise ValueError(f"{path} was saved with {flag} {saved} but this run uses {current}; "
                             f"{_change_layout_hint(saved_layout, root)}")
    # Each rank's file holds its partition of the padded vocabulary: the rows must be the same too.
    saved_rows, rows = getattr(saved_args, "padded_vocab_size", None), getattr(args, "padded_vocab_size", None)
    if saved_rows is not None and rows is not None and saved_rows != rows:
        from megatron.training.tokenizer import exact_padding_divisor

        tp, vocab_size = args.tensor_model_parallel_size, true_vocab_size(args)
        divisor = exact_padding_divisor(vocab_size, saved_rows, tp) if vocab_size else None
        fits = (f", or --make-vocab-size-divisible-by {divisor}, which pads this run's {vocab_size} tokens to "
                f"{saved_rows} rows at TP {tp}" if divisor else "")
        raise ValueError(
            f"{path} holds {saved_rows} rows of the word embedding and output layer (its padded vocabulary) but "
            f"this run builds {rows} ({padding_origin(rows, vocab_size, args.make_vocab_size_divisible_by, tp)}); "
            "the torch format cannot change the vocabulary padding: launch with --use-checkpoint-args, which keeps "
            f"the checkpoint's {saved_rows} rows{fits}, or convert it to torch_dist (tools/checkpoint/"
            "convert_legacy.py), which loads at another padding")
    layer_counts = layer_count_hint(saved_args, args)
    if layer_counts is not None:
        raise ValueError(f"{path} holds another number of layers than this run builds. {layer_counts}")
    # Each rank's file holds its stages' layers under local indices: an uneven split must be the same too.
    saved, current = (getattr(each, "virtual_stage_layer_counts", None) for each in (saved_args, args))
    if saved is not None and current is not None and tuple(saved) != tuple(current):
        raise ValueError(
            f"{path} was saved with {tuple(saved)} transformer layers per virtual pipeline stage but this run "
            f"places {tuple(current)}; the torch format cannot move layers between stages: pass the split flags "
            f"it was saved with ({_virtual_stages_advice(saved_args, args)}--decoder-first/last-pipeline-num-"
            "layers, --account-for-embedding/loss-in-pipeline-split, --pipeline-model-parallel-layout), or save "
            "with --ckpt-format torch_dist"
        )


def _virtual_stages_advice(saved_args, args):
    """The interleaved-pipeline flag to launch with when the checkpoint has another number of virtual stages per
    pipeline rank than this run ('' when the same)."""
    saved, current = (getattr(each, "virtual_pipeline_model_parallel_size", None) or 1 for each in (saved_args, args))
    if saved == current:
        return ""
    if saved == 1:
        return ("saved without an interleaved pipeline: no --num-virtual-stages-per-pipeline-rank / "
                "--num-layers-per-virtual-pipeline-stage; ")
    return f"saved with --num-virtual-stages-per-pipeline-rank {saved}, this run has {current}; "


def load_checkpoint(model, optimizer, opt_param_scheduler, args, strict=True):
    """Load the latest checkpoint under `args.load`; returns the iteration to resume from (0 if none).

    Sets `args.consumed_train_samples`. `--finetune` loads weights only and restarts at iteration 0;
    `--no-load-optim` skips optimizer and scheduler, `--no-load-rng` the RNG state. With
    `--non-persistent-ckpt-type local` (with or without --load), the local checkpoint is resumed instead when it
    is newer and every rank can load its part (see local_checkpoint).
    """
    check_checkpoint_format(args)
    model_chunks = model if isinstance(model, (list, tuple)) else [model]
    from megatron.training import local_checkpoint

    if local_checkpoint.enabled(args) and getattr(args, "ckpt_step", None) is None:  # --ckpt-step: that one
        global_source = checkpoint_sources.checkpoint_to_load(args)
        global_iteration = None if global_source is None or global_source.iteration == RELEASE \
            else global_source.iteration
        iteration = local_checkpoint.load_local_checkpoint(model_chunks, optimizer, opt_param_scheduler, args,
                                                           global_iteration)
        if iteration is not None:
            return iteration
    if args.load is None and getattr(args, "pretrained_checkpoint", None) is None:
        return 0
    source = _checkpoint_or_none(args)
    if source is None:
        return 0
    root, iteration = source.root, source.iteration
    if _format_to_load(source, args) in LOGICAL_FORMATS:
        from megatron.training.dist_checkpoint import load_dist_checkpoint

        iteration, report = load_dist_checkpoint(model_chunks, optimizer, opt_param_scheduler, args, iteration,
                                                 root=root)
        if dist.get_rank() == 0:
            print("\n".join(report.lines()), flush=True)
        return iteration
    ranks = _parallel_ranks()
    # The `.replaced` copy where a save of this iteration again was killed between its two renames.
    iteration_directory, _ = published_directory(root, iteration)
    directory = os.path.join(iteration_directory, model_parallel_dir_name(
        ranks["tensor_rank"], ranks["pipeline_rank"], ranks["pipeline_size"]))
    path = os.path.join(directory, MODEL_FILENAME)
    if not os.path.isfile(path) and os.path.isfile(os.path.join(iteration_directory, ".metadata")):
        raise CheckpointLoadError(f"{os.path.dirname(directory)} is a torch_dist checkpoint; load it with "
                                  "--ckpt-format torch_dist, or pass --auto-detect-ckpt-format (which loads either "
                                  "format and saves in --ckpt-format)")
    if not os.path.isfile(path):
        _check_files_match_layout(path, args)
    state = _torch_load(path)
    saved_args = state.get("args")
    check_same_architecture(path, saved_args, args, saved_true_vocab_size(state.get("vocab_size"), saved_args),
                            true_vocab_size(args))
    _check_layout_matches(saved_args, args, path)
    skip_optimizer = None if optimizer is None else _why_optimizer_not_loaded(
        state, saved_args, args, path, data_parallel_size=dist.get_world_size(ranks["data_group"]))
    _load_model_state(model_chunks, state, strict)
    fresh_fp8_histories = count_fp8_histories_started_empty(model_chunks)

    load_optimizer = optimizer is not None and skip_optimizer is None
    loaded_scheduler = False
    regrouped = []  # the optimizer's param groups whose parameters the checkpoint grouped otherwise
    if load_optimizer:
        if args.use_distributed_optimizer:
            shard_path = os.path.join(directory, distributed_optimizer_filename(ranks["data_rank"]))
            try:
                optimizer.load_state_dict(_torch_load(shard_path)["optimizer"])
            except ValueError as error:  # the shards cut the parameters otherwise (e.g. another bucketing)
                raise CheckpointLoadError(f"{shard_path}: {error} {reshard_hint(saved_args, args)}") from error
        else:
            optimizer.load_state_dict(_optimizer_state_by_name(state, optimizer, model_chunks, path, regrouped))
        if opt_param_scheduler is not None and "opt_param_scheduler" in state:
            opt_param_scheduler.load_state_dict(state["opt_param_scheduler"])
            loaded_scheduler = True
    elif optimizer is not None and hasattr(optimizer, "reload_model_params"):
        # Main (fp32) copies of the parameters must follow the weights just loaded.
        optimizer.reload_model_params()

    skip_rng = "--finetune" if args.finetune else "--no-load-rng" if args.no_load_rng else None
    if skip_rng is None and "rng_state" not in state:
        skip_rng = "the checkpoint has none: saved with --no-save-rng"
    rng_not_loaded_beyond = None
    if skip_rng is None:
        states = state["rng_state"]
        random_init = bool(getattr(args, "data_parallel_random_init", False))
        if ranks["data_rank"] < len(states):
            set_rng_state(states[ranks["data_rank"]])
        elif not random_init:  # without --data-parallel-random-init every data-parallel rank draws the same streams
            set_rng_state(states[0])
        if random_init and dist.get_world_size(ranks["data_group"]) > len(states):
            # Another rank's streams would repeat that rank's dropout masks: these ranks keep their own seeded ones.
            rng_not_loaded_beyond = len(states)

    if args.finetune:
        iteration, args.consumed_train_samples, args.skipped_train_samples = 0, 0, 0
    else:
        args.consumed_train_samples = state.get("consumed_train_samples", 0)
        args.skipped_train_samples = state.get("skipped_train_samples", 0)
    dist.barrier()
    if dist.get_rank() == 0:
        loaded = (["model"] + (["optimizer"] if load_optimizer else []) + (["scheduler"] if loaded_scheduler else [])
                  + ([] if skip_rng else ["RNG state"]))
        skipped = ([f"optimizer and scheduler ({skip_optimizer})"] if skip_optimizer else []) \
            + ([f"RNG state ({skip_rng})"] if skip_rng else [])
        if regrouped:
            loaded[loaded.index("optimizer")] = (
                f"optimizer (state matched by parameter name; param group(s) {', '.join(map(str, regrouped))} "
                f"grouped otherwise in the checkpoint ({GROUPING_FLAGS}): their learning-rate and weight-decay "
                "settings come from this run's flags)")
        if rng_not_loaded_beyond is not None:
            skipped.append(f"RNG state of data-parallel ranks {rng_not_loaded_beyond} and above (saved at "
                           f"data-parallel size {rng_not_loaded_beyond}; under --data-parallel-random-init they keep "
                           "their own seeded streams)")
        if fresh_fp8_histories:
            skipped.append(f"FP8 amax histories of {fresh_fp8_histories} layer(s) (not in the checkpoint): they "
                           "start empty")
        print(f"loaded checkpoint {iteration_directory} (--ckpt-format torch): "
              f"{', '.join(loaded)}, resuming at iteration {iteration}"
              + (f"; not loaded: {', '.join(skipped)}" if skipped else ""), flush=True)
    return iteration


def _optimizer_state_by_name(state, optimizer, model_chunks, path, regrouped):
    """The checkpoint's (non-distributed) optimizer state laid out for `optimizer` by parameter name, when the
    checkpoint names its parameters; appends to `regrouped` the param groups that keep this run's settings. A
    checkpoint without names (or a plain torch optimizer) is loaded as saved: by position."""
    saved_state, saved_names = state["optimizer"], state.get("optimizer_param_names")
    current_names = optimizer_param_names(optimizer, model_chunks)
    torch_style = isinstance(saved_state, dict) and isinstance(saved_state.get("optimizer"), dict) \
        and "param_groups" in saved_state["optimizer"]
    if saved_names is None or current_names is None or not torch_style:
        return saved_state
    current_groups = optimizer.param_groups
    current_params = [param for group in current_groups for param in group["params"]]
    if len(current_params) != len(current_names):
        return saved_state
    single_chunk = len(model_chunks) == 1

    def readable(names):
        return [name if single_chunk else f"model{index}.{name}" for index, name in names]

    try:
        reordered, groups = reorder_by_name(saved_state, readable(saved_names), readable(current_names),
                                            current_groups, current_params)
    except ParamGroupMismatchError as error:
        raise CheckpointLoadError(f"{path}: {error}") from error
    regrouped.extend(groups)
    return reordered


def _check_distributed_optimizer_shards(directory, data_parallel_size):
    """Raise (on every rank alike, before anything is loaded) when the per-data-parallel-rank optimizer files
    under `directory` were written at another data-parallel (x context-parallel) size than `data_parallel_size`."""
    saved = len(glob.glob(os.path.join(glob.escape(directory), "distrib_optim_dp_rank_*.pt")))
    if saved == data_parallel_size:
        return
    found = (f"holds {saved} distrib_optim_dp_rank_*.pt files (saved at data-parallel size {saved})" if saved
             else "holds no distrib_optim_dp_rank_*.pt file (the optimizer state is missing)")
    raise CheckpointLoadError(
        f"{directory} {found}, but this run has data-parallel size {data_parallel_size} (data- x context-parallel "
        f"ranks). {RESHARD_HINT}")


def _why_optimizer_not_loaded(state, saved_args, args, path, data_parallel_size=None):
    """None when the optimizer state is to be loaded, else the reason it is not; raises when the checkpoint
    holds it in the other layout (the whole state in the model file, or per-data-parallel-rank shard files), or,
    given this run's `data_parallel_size`, in shard files of another data-parallel size."""
    if args.finetune:
        return "--finetune"
    if args.no_load_optim:
        return "--no-load-optim"
    saved_sharded = bool(getattr(saved_args, "use_distributed_optimizer", False))
    saved_any = "optimizer" in state or (saved_sharded and not getattr(saved_args, "no_save_optim", False))
    if not saved_any:
        return "the checkpoint has none: saved with --no-save-optim"
    if saved_sharded != bool(args.use_distributed_optimizer):
        saved_as, launch = (("per-data-parallel-rank distrib_optim_dp_rank_*.pt files (saved with "
                             "--use-distributed-optimizer)", "with --use-distributed-optimizer")
                            if saved_sharded else
                            (f"{MODEL_FILENAME} (saved without --use-distributed-optimizer)",
                             "without --use-distributed-optimizer"))
        raise CheckpointLoadError(
            f"{path}: the --ckpt-format torch checkpoint holds its optimizer state in {saved_as}; launch {launch}, "
            "or with --no-load-optim to load the weights alone, or convert it to torch_dist "
            "(tools/checkpoint/convert_legacy.py), which loads under either optimizer")
    check_resumed_optimizer(saved_args, args, path)
    if saved_sharded and data_parallel_size is not None:
        _check_distributed_optimizer_shards(os.path.dirname(path), data_parallel_size)
    return None


def _torch_load(path):
    """torch.load of a checkpoint file, with errors that name the file."""
    if not os.path.isfile(path):
        raise CheckpointLoadError(f"checkpoint file {path} not found (was the checkpoint written with another "
                                  "--tensor-model-parallel-size / --pipeline-model-parallel-size, or not completely?)")
    try:
        return torch.load(path, map_location="cpu", weights_only=False)
    except (OSError, RuntimeError, EOFError, ValueError) as exc:
        raise CheckpointLoadError(f"checkpoint file {path} is truncated or damaged ({type(exc).__name__}: {exc}); "
                                  f"{earlier_checkpoint_advice(os.path.dirname(os.path.dirname(path)))}") from exc


def _format_to_load(source, args):
    """--ckpt-format, or with --auto-detect-ckpt-format the format the checkpoint is written in."""
    if not getattr(args, "auto_detect_ckpt_format", False) or source.format is None:
        return args.ckpt_format
    if source.format == "torch":
        uses_fsdp = getattr(args, "use_megatron_fsdp", False) or getattr(args, "use_torch_fsdp2", False)
        if uses_fsdp or (getattr(args, "expert_model_parallel_size", 1) or 1) > 1:
            raise CheckpointLoadError(f"--auto-detect-ckpt-format: {source.directory} is a --ckpt-format torch "
                                      "checkpoint, which loads into DDP without expert parallelism only; convert it "
                                      "with tools/checkpoint/convert_legacy.py")
    if (source.format == "torch") == (args.ckpt_format == "torch"):
        return args.ckpt_format
    if dist.get_rank() == 0:
        print(f"--auto-detect-ckpt-format: {source.directory} is a {source.format} checkpoint: loading it as "
              f"such (saving uses --ckpt-format {args.ckpt_format})", flush=True)
    return source.format


def _checkpoint_or_none(args):
    """The checkpoint --load resumes (see checkpoint_sources); None (after saying so) when there is none."""
    source = checkpoint_sources.checkpoint_to_load(args) if args.load is not None else None
    if source is None:
        source = checkpoint_sources.pretrained_checkpoint(args)
        if source is not None:  # as upstream: the pretrained weights, fine-tuned from iteration 0
            args.finetune = True
            if not dist.is_initialized() or dist.get_rank() == 0:
                print(f"no checkpoint under --load {args.load}: loading {source.directory} from "
                      "--pretrained-checkpoint as --finetune does (weights only, iteration 0)", flush=True)
            return source
    if source is not None and source.iteration == RELEASE:  # as upstream: weights only, from iteration 0
        args.finetune = True
        if not dist.is_initialized() or dist.get_rank() == 0:
            print(f"--load {args.load}: its tracker names the released checkpoint {source.directory}: loading it "
                  "as --finetune does (weights only, iteration 0)", flush=True)
        return source
    if source is not None:
        if source.non_persistent and (not dist.is_initialized() or dist.get_rank() == 0):
            print(f"resuming the non-persistent checkpoint {source.directory}: newer than the latest persistent "
                  f"one under --load {args.load}", flush=True)
        return source
    if not os.path.isdir(args.load):
        message = f"--load {args.load}: the directory does not exist"
    else:
        message = f"--load {args.load}: no {TRACKER_FILENAME} in it (no complete checkpoint)"
        untracked = checkpoint_sources.checkpoint_iterations(args.load)
        if untracked:
            message += (f"; it holds the checkpoints of iterations {', '.join(map(str, untracked))}: to resume one, "
                        f"pass --ckpt-step N, or write its iteration into {os.path.join(args.load, TRACKER_FILENAME)}")
        step = re.fullmatch(r"iter_(\d+)", os.path.basename(os.path.normpath(args.load)))
        if step is not None:
            message += (f"; it looks like one iteration's directory: to resume it, pass its parent and the "
                        f"iteration, --load {os.path.dirname(os.path.normpath(args.load))} --ckpt-step "
                        f"{int(step.group(1))}")
    if args.exit_on_missing_checkpoint:
        raise FileNotFoundError(f"{message} and --exit-on-missing-checkpoint is set")
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(f"WARNING: {message}; nothing was loaded: model, optimizer, scheduler, RNG state and iteration "
              "start from scratch", flush=True)
    return None
