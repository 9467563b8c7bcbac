"""`--non-persistent-ckpt-type local`: per-rank checkpoints on node-local storage, resumed when newer.

Every `--non-persistent-save-interval` iterations (where no persistent save falls) each rank writes its own
part of the training state to `--non-persistent-local-ckpt-dir` (layout: `local_checkpoint_files`): the model
and optimizer tensors it holds (the same state the logical format saves, built by the same wrappers code, tied
copies included so that each rank restores itself), the scheduler, its RNG state, the iteration and consumed
samples. Nothing is resharded, so a local checkpoint loads only under the layout and world size that wrote it.
Once every rank has its part of the new checkpoint complete, each removes its older ones. With `--async-save`
the part is snapshotted in the training thread and written by `--async-save`'s background writer; the older
parts go once every rank's write has succeeded (the queue's agreement, as for global checkpoints).

At load, the newest iteration that every rank has complete is resumed when it is newer than the checkpoint
`--load` would resume and every rank can load its part (same layout, same save, every piece there); otherwise
rank 0 says why and the global checkpoint is loaded. The ranks agree through all-gathers, so they all take the
same path.

`--non-persistent-local-ckpt-algo` (see `local_checkpoint_pieces`): `fully_parallel` (default) stores each
replicated tensor piece once, spread over the ranks holding it, and a load sends the pieces back with one
broadcast per rank; `atomic` stores everything a rank holds, so each rank's part restores it on its own.
"""

import argparse
import copy
import json
import time
import uuid

import torch
import torch.distributed as dist

from megatron.core.device_utils import get_device_for_group
from megatron.core.dist_checkpointing import optimizer_state, wrappers
from megatron.training import checkpoint_state, local_checkpoint_files, modelopt_checkpoint
from megatron.training.checkpoint_args import check_resumed_optimizer
from megatron.training.local_checkpoint_pieces import (
    DEFAULT_ALGORITHM,
    PieceId,
    assign_owners,
    describe_missing,
    dtype_from_name,
    exchange_plan,
    fill,
    missing_pieces,
    objects_of,
    pieces_of,
)
from megatron.training.random_state import rng_state, set_rng_state

COMMON_KEY = "common"  # {"iteration", "consumed_train_samples", "optimizer"}, on every rank
RNG_KEY = "rng_state"  # this rank's own RNG state
_OPTIMIZER_OBJECT_KEYS = (optimizer_state.STEP_KEY, optimizer_state.PARAM_GROUPS_KEY, optimizer_state.GRAD_SCALER_KEY)


def enabled(args):
    return getattr(args, "non_persistent_ckpt_type", None) == "local"


def algorithm(args):
    return getattr(args, "non_persistent_local_ckpt_algo", None) or DEFAULT_ALGORITHM


def _rank():
    return dist.get_rank() if dist.is_initialized() else 0


def _print0(message):
    if _rank() == 0:
        print(message, flush=True)


def layout(args, model_chunks):
    """What must not change between the save and the load of a local checkpoint (JSON values)."""
    from megatron.core import parallel_state

    current = checkpoint_state.layout_of(args, model_chunks)
    current.pop("ckpt_format", None)
    current["context_parallel_size"] = parallel_state.get_context_parallel_world_size()
    # Local checkpoints record DP x CP as the DP size (and CP beside it), as they always have.
    current["data_parallel_size"] = parallel_state.get_data_parallel_world_size(with_context_parallel=True)
    current["virtual_pipeline_model_parallel_size"] = \
        parallel_state.get_virtual_pipeline_model_parallel_world_size() or 1
    counts = getattr(args, "virtual_stage_layer_counts", None)
    current["virtual_stage_layer_counts"] = None if counts is None else list(counts)
    current["num_distributed_optimizer_instances"] = getattr(args, "num_distributed_optimizer_instances", 1) or 1
    current["rank_coordinates"] = list(checkpoint_state.rank_coordinates())
    return json.loads(json.dumps(current))


def layout_difference(saved, current):
    """None when the layouts match, else a phrase naming each difference."""
    differing = [name for name in sorted(set(saved) | set(current)) if saved.get(name) != current.get(name)]
    if not differing:
        return None
    return ("it was written with " + ", ".join(f"{name}={saved.get(name)}" for name in differing) + " but this "
            "run has " + ", ".join(f"{name}={current.get(name)}" for name in differing) + " (a local checkpoint "
            "loads only under the parallel layout and world size that wrote it)")


# ---------------------------------------------------------------------------------------------------------
# Save
# ---------------------------------------------------------------------------------------------------------


def _state_of_this_rank(iteration, model_chunks, optimizer, scheduler, args):
    """Everything this rank needs to resume (collective: the optimizer agrees on its step counter)."""
    state = dict(modelopt_checkpoint.modelopt_state_to_save(model_chunks))  # before the model's tensors
    state.update({f"model.{name}": value
                  for name, value in wrappers.model_state(model_chunks, for_saving=False).items()})
    if optimizer is not None and not args.no_save_optim:
        state.update(wrappers.optimizer_state_to_save(optimizer, model_chunks, include_tied_copies=True))
        if scheduler is not None:
            state["scheduler"] = scheduler.state_dict()
    if not args.no_save_rng:
        state[RNG_KEY] = rng_state()
    state[COMMON_KEY] = {"iteration": iteration,
                         "consumed_train_samples": getattr(args, "consumed_train_samples", 0),
                         "skipped_train_samples": getattr(args, "skipped_train_samples", 0),
                         "optimizer": getattr(args, "optimizer", None)}  # the --optimizer its state fits
    return state


def save_local_checkpoint(iteration, model_chunks, optimizer, scheduler, args):
    """Write this rank's part of the local checkpoint of `iteration`, then (when every rank succeeded) remove the
    older ones; collective. Returns the seconds spent."""
    start = time.perf_counter()
    root, rank, algo = args.non_persistent_local_ckpt_dir, _rank(), algorithm(args)
    state = _state_of_this_rank(iteration, model_chunks, optimizer, scheduler, args)
    pieces = pieces_of(state)
    held = sorted(pieces)
    # One collective: rank 0's id for this save (a load refuses parts of different saves) and, for
    # fully_parallel, which pieces every rank holds.
    gathered = checkpoint_state.all_gather_objects((uuid.uuid4().hex, held if algo == "fully_parallel" else None))
    save_id = gathered[0][0]
    plan, stored = [], pieces
    if algo == "fully_parallel":
        held_by_rank = [rank_held for _, rank_held in gathered]
        owners = assign_owners(held_by_rank)
        plan = exchange_plan(owners, held_by_rank)
        stored = {piece: tensor for piece, tensor in pieces.items() if owners[piece] == rank}
    payload = {
        "tensors": {tuple(piece): tensor.detach().to("cpu", copy=True) for piece, tensor in stored.items()},
        "held": [tuple(piece) for piece in held],
        "exchange_plan": [(tuple(piece), owner) for piece, owner in plan],
        "objects": copy.deepcopy(objects_of(state)),  # a snapshot: training goes on changing the originals
    }
    metadata = {"iteration": iteration, "rank": rank, "algorithm": algo, "save_id": save_id,
                "layout": layout(args, model_chunks)}
    description = f"local checkpoint of iteration {iteration} to {root} (--non-persistent-ckpt-type local, " \
                  f"--non-persistent-local-ckpt-algo {algo})"

    def write():
        local_checkpoint_files.write(root, rank, iteration, payload, metadata)

    def publish(succeeded, reason="a background write failed (see above)"):
        """Every rank wrote its part: drop the older ones. Otherwise drop this one (the older stays the latest)."""
        if not succeeded:
            local_checkpoint_files.remove(root, rank, iteration)
            _print0(f"local checkpoint of iteration {iteration} was NOT saved: {reason}; the previous local "
                    f"checkpoint in {root} is kept")
            return
        local_checkpoint_files.remove_all_but(root, rank, iteration)
        _print0(f"saved {description}" + (" in the background" if background else
                                          f" in {time.perf_counter() - start:.2f} s"))

    background = bool(getattr(args, "async_save", False))
    if background:  # written by --async-save's worker; published once every rank's write has succeeded
        from megatron.training.dist_checkpoint import async_queue

        async_queue(args).schedule(write, publish, description)
        return time.perf_counter() - start
    error = None
    try:
        write()
    except Exception as exc:  # noqa: B902 - reported by every rank below, instead of leaving the others waiting
        error = f"{type(exc).__name__}: {exc}"
    errors = checkpoint_state.all_gather_objects(error)
    failed = [index for index, text in enumerate(errors) if text is not None]
    if failed:
        publish(False, f"rank(s) {failed} could not write their part ({errors[failed[0]]})")
    else:
        publish(True)
    return time.perf_counter() - start


# ---------------------------------------------------------------------------------------------------------
# Load
# ---------------------------------------------------------------------------------------------------------


def newest_common_iteration(complete_by_rank):
    """The newest iteration every rank has complete (None if there is none)."""
    common = set.intersection(*(set(iterations) for iterations in complete_by_rank)) if complete_by_rank else set()
    return max(common) if common else None


def _fallback(args):
    if args.load is None:
        return "no --load is given: training starts from scratch"
    return f"loading the global checkpoint under --load {args.load} instead"


def _recorded_world_size(root, rank, complete):
    """The world size this rank's newest complete part records (None if it has none or it is unreadable)."""
    if not complete:
        return None
    try:
        metadata = local_checkpoint_files.read_metadata(local_checkpoint_files.checkpoint_dir(root, rank, complete[-1]))
        return metadata["layout"]["world_size"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _saved_keys(payload):
    return {piece[0] for piece in payload["held"]} | set(payload["objects"])


def _loads_optimizer(optimizer, args, saved_keys):
    """(whether to load the optimizer and scheduler, why not)."""
    if optimizer is None:
        return False, None
    if args.finetune:
        return False, "--finetune"
    if args.no_load_optim:
        return False, "--no-load-optim"
    if not any(key.startswith(optimizer_state.STATE_PREFIX) for key in saved_keys):
        return False, "the local checkpoint has none: saved with --no-save-optim"
    return True, None


def _read_part(directory, iteration, model_chunks, args):
    """(why this rank cannot load its part or None, its save id, its payload); reads files only."""
    try:
        metadata = local_checkpoint_files.read_metadata(directory)
        payload = local_checkpoint_files.read_state(directory)
    except Exception as exc:  # noqa: B902 - any unreadable part means: load the global checkpoint
        return f"its part {directory} cannot be read ({type(exc).__name__}: {exc})", None, None
    if metadata.get("iteration") != iteration or metadata.get("rank") != _rank():
        return (f"{directory} holds iteration {metadata.get('iteration')} of rank {metadata.get('rank')}",
                None, None)
    difference = layout_difference(metadata.get("layout", {}), layout(args, model_chunks))
    if difference:
        return difference, None, None
    if any(key.startswith(modelopt_checkpoint.STATE_KEY_PREFIX) for key in payload["objects"]):
        return "the model was converted by ModelOpt, whose state only a global checkpoint restores", None, None
    return None, metadata.get("save_id"), payload


def _missing_from_part(payload, model_chunks, optimizer, args):
    """Why the part cannot fill this rank's model and optimizer, or None (every rank calls it: building the
    targets may be collective)."""
    targets = checkpoint_state.model_targets(model_chunks)[0]
    saved_keys = _saved_keys(payload)
    if _loads_optimizer(optimizer, args, saved_keys)[0]:
        targets.update(wrappers.optimizer_load_targets(optimizer, model_chunks, saved_keys)[0])
    missing = missing_pieces(targets, [PieceId(*piece) for piece in payload["held"]])
    return describe_missing(missing) if missing else None


def _first_refusal(verdicts):
    """(rank, reason, number of other ranks refusing) of the first rank refusing, or None."""
    refused = [(index, text) for index, text in enumerate(verdicts) if text is not None]
    return None if not refused else (*refused[0], len(refused) - 1)


def _exchange_replicas(plan, stored, held):
    """`fully_parallel`: every piece some rank holds without storing it, sent by the rank that stored it (one
    broadcast per such rank, over all ranks; `plan` is the same on every rank). Returns the pieces this rank
    receives that it holds."""
    rank, device = _rank(), get_device_for_group()
    by_owner = {}
    for piece, owner in plan:
        by_owner.setdefault(owner, []).append(piece)
    received = {}
    for owner in sorted(by_owner):
        pieces = by_owner[owner]
        sizes = [piece.nbytes() for piece in pieces]
        if rank == owner:  # raw bytes: one buffer whatever the dtypes
            buffer = torch.cat([stored[piece].contiguous().reshape(-1).view(torch.uint8) for piece in pieces])
            buffer = buffer.to(device)
        else:
            buffer = torch.empty(sum(sizes), dtype=torch.uint8, device=device)
        dist.broadcast(buffer, src=owner)
        if rank == owner:
            continue
        start = 0
        for piece, size in zip(pieces, sizes):
            if piece in held:
                raw = buffer[start:start + size].to("cpu", copy=True)
                received[piece] = raw.view(dtype_from_name(piece.dtype)).reshape(piece.shape)
            start += size
    return received


def _apply(payload, model_chunks, optimizer, scheduler, args):
    """Load this rank's part (collective with fully_parallel); returns (loaded, not loaded) phrases."""
    saved = {PieceId(*piece): tensor for piece, tensor in payload["tensors"].items()}
    plan = [(PieceId(*piece), owner) for piece, owner in payload["exchange_plan"]]
    saved.update(_exchange_replicas(plan, saved, {PieceId(*piece) for piece in payload["held"]}))
    objects = payload["objects"]
    targets, finish_model_load = checkpoint_state.model_targets(model_chunks)
    fill(targets, saved)
    finish_model_load(set(targets))
    loaded, not_loaded = [f"model ({len(targets)} tensors)"], []

    saved_keys = _saved_keys(payload)
    load_optimizer, skip_reason = _loads_optimizer(optimizer, args, saved_keys)
    if load_optimizer:
        checkpoint_state.refresh_main_params(optimizer)  # main weights not saved in fp32 follow the model
        targets, install = wrappers.optimizer_load_targets(optimizer, model_chunks, saved_keys)
        fill(targets, saved)
        targets.update({key: objects[key] for key in _OPTIMIZER_OBJECT_KEYS if key in objects})
        install(targets)
        loaded.append("optimizer")
        if scheduler is not None and "scheduler" in objects:
            scheduler.load_state_dict(objects["scheduler"])
            loaded.append("scheduler")
    elif optimizer is not None:
        checkpoint_state.refresh_main_params(optimizer)
        not_loaded.append(f"optimizer and scheduler ({skip_reason})")

    if args.finetune or args.no_load_rng:
        not_loaded.append("RNG state (" + ("--finetune" if args.finetune else "--no-load-rng") + ")")
    elif RNG_KEY in objects:
        set_rng_state(objects[RNG_KEY])
        loaded.append("RNG state")
    else:
        not_loaded.append("RNG state (the local checkpoint has none: saved with --no-save-rng)")
    return loaded, not_loaded


def _agreed_iteration(root, args, global_iteration):
    """The newest iteration every rank has complete, when it is newer than `global_iteration` and written at
    this world size; else None (rank 0 having said why). Collective."""
    rank = _rank()
    complete = local_checkpoint_files.complete_iterations(root, rank)
    gathered = checkpoint_state.all_gather_objects((complete, _recorded_world_size(root, rank, complete)))
    complete_by_rank = [iterations for iterations, _ in gathered]
    newest = max((max(iterations) for iterations in complete_by_rank if iterations), default=None)
    if newest is None:
        _print0(f"--non-persistent-ckpt-type local: no local checkpoint in {root}; {_fallback(args)}")
        return None
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    other_sizes = sorted({size for _, size in gathered if size is not None and size != world_size})
    if other_sizes:  # said first: ranks beyond a smaller saved world would otherwise look incomplete
        _print0(f"local checkpoint in {root} not used: it was written by {' and '.join(map(str, other_sizes))} "
                f"ranks but this run has {world_size} (a local checkpoint loads only under the parallel layout and "
                f"world size that wrote it); {_fallback(args)}")
        return None
    iteration = newest_common_iteration(complete_by_rank)
    if iteration != newest:
        lacking = [index for index, iterations in enumerate(complete_by_rank) if newest not in iterations]
        _print0(f"local checkpoint of iteration {newest} in {root} is incomplete: rank(s) {lacking} have no complete "
                "part of it (missing, or a save that was interrupted)"
                + (f"; using iteration {iteration}, complete on every rank" if iteration is not None else
                   f"; {_fallback(args)}"))
    if iteration is not None and global_iteration is not None and iteration <= global_iteration:
        _print0(f"local checkpoint of iteration {iteration} in {root} not used: the global checkpoint under --load "
                f"is of iteration {global_iteration}; loading that")
        return None
    return iteration


def _agreed_part(root, iteration, model_chunks, optimizer, args):
    """This rank's part of checkpoint `iteration` when every rank can load its own; else None (rank 0 having
    said why). Collective."""
    directory = local_checkpoint_files.checkpoint_dir(root, _rank(), iteration)
    reason, save_id, payload = _read_part(directory, iteration, model_chunks, args)
    gathered = checkpoint_state.all_gather_objects((reason, save_id))
    refusal = _first_refusal([text for text, _ in gathered])
    if refusal is None and len({identifier for _, identifier in gathered}) > 1:
        refusal = (0, "the ranks' parts come from different saves of this iteration", 0)
    if refusal is None and _loads_optimizer(optimizer, args, _saved_keys(payload))[0]:
        # Before the pieces are matched: another optimizer's state lacks this one's pieces, which is no reason to
        # fall back to the global checkpoint (every rank reads the same save, so every rank raises).
        saved_optimizer = payload["objects"][COMMON_KEY].get("optimizer")
        check_resumed_optimizer(argparse.Namespace(optimizer=saved_optimizer), args, directory)
    if refusal is None:
        refusal = _first_refusal(checkpoint_state.all_gather_objects(
            _missing_from_part(payload, model_chunks, optimizer, args)))
    if refusal is None:
        return payload
    index, text, others = refusal
    _print0(f"local checkpoint of iteration {iteration} in {root} not used: rank {index}"
            + (f" (and {others} other rank(s))" if others else "") + f": {text}; {_fallback(args)}")
    return None


def load_local_checkpoint(model_chunks, optimizer, scheduler, args, global_iteration):
    """Resume the local checkpoint when it is newer than `global_iteration` (the checkpoint `--load` would
    resume; None when there is none) and every rank can load its part. Returns the iteration to resume from, or
    None (rank 0 having said why) when the global checkpoint is to be loaded. Collective."""
    root = args.non_persistent_local_ckpt_dir
    iteration = _agreed_iteration(root, args, global_iteration)
    payload = None if iteration is None else _agreed_part(root, iteration, model_chunks, optimizer, args)
    if payload is None:
        return None
    loaded, not_loaded = _apply(payload, model_chunks, optimizer, scheduler, args)
    first_part = local_checkpoint_files.checkpoint_dir(root, 0, iteration)
    if args.finetune:
        iteration, args.consumed_train_samples, args.skipped_train_samples = 0, 0, 0
        not_loaded.append("iteration and consumed samples (--finetune starts at 0)")
    else:
        args.consumed_train_samples = payload["objects"][COMMON_KEY].get("consumed_train_samples", 0)
        args.skipped_train_samples = payload["objects"][COMMON_KEY].get("skipped_train_samples", 0)
        loaded.append(f"iteration {iteration}, consumed samples {args.consumed_train_samples}")
    if dist.is_initialized():
        dist.barrier()
    newer_than = "none" if global_iteration is None else f"of iteration {global_iteration}"
    lines = [f"loaded local checkpoint {first_part} and the other ranks' parts (--non-persistent-ckpt-type local, "
             f"newer than the global checkpoint: {newer_than})", "  loaded: " + "; ".join(loaded)]
    if not_loaded:
        lines.append("  not loaded: " + "; ".join(not_loaded))
    _print0("\n".join(lines))
    return iteration
