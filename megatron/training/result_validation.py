"""What the training loop hands to the rerun state machine (megatron/core/rerun_state_machine.py): its set-up
from the flags, the NaN/Inf check of this rank's gradient norm after every forward-backward pass, and the
machine's state saved with (and loaded from) the checkpoint that a reproduced rejected result leaves behind.

The gradient check reads the gradients the optimizer is about to step with, after `finalize_model_grads`, for
every data-parallel wrapper (DDP `main_grad`, Megatron-FSDP's gradient pieces, FSDP2's DTensor shards), so one
check covers them all; a NaN on any rank has reached every rank's reduced gradients by then, and the machine
agrees on the verdict over all ranks anyway.
"""

import os
from functools import partial

import torch
import torch.distributed as dist

from megatron.core.dist_checkpointing.checkpoint_directory import iteration_dir_name
from megatron.core.distributed.data_parallel_base import local_tensor
from megatron.core.rerun_state_machine import get_rerun_state_machine, initialize_rerun_state_machine

# Gradients are reduced in an order that may change between runs on some devices: a rerun matching to 1e-3
# (relative) reproduces the result.
GRAD_NORM_TOLERANCE = 1e-3
# --check-for-large-grads: a gradient norm this many times the largest of the first norms is rejected.
LARGE_GRADS_FACTOR = 10


def setup_rerun_state_machine(args):
    """The process's machine, in --rerun-mode, reporting statistics every --log-interval iterations, with the
    fault injection and the rejected-result tracker of the flags."""
    return initialize_rerun_state_machine(
        mode=args.rerun_mode,
        report_interval=args.log_interval,
        error_injection_rate=getattr(args, "error_injection_rate", 0),
        error_injection_type=getattr(args, "error_injection_type", "transient_error"),
        result_rejected_tracker_filename=getattr(args, "result_rejected_tracker_filename", None),
    )


def _chunk_grads(chunk):
    if hasattr(chunk, "optimizer_grad_pieces"):  # Megatron-FSDP: this rank's pieces of the reduced gradients
        return [piece.grad for piece in chunk.optimizer_grad_pieces()]
    grads = []
    for param in chunk.parameters():
        grad = getattr(param, "main_grad", None)
        grad = grad if grad is not None else param.grad
        if grad is not None:
            grads.append(local_tensor(grad))
    return grads


@torch.no_grad()
def local_grad_norm(model_chunks):
    """L2 norm (fp32, on the host) of the gradients this rank holds for its optimizer; NaN/Inf when any element
    is. One fused norm per device holding gradients and one copy of its result to the host: the check adds one
    host synchronisation per step, not one per gradient."""
    by_device = {}
    for chunk in model_chunks:
        for grad in _chunk_grads(chunk):
            by_device.setdefault(grad.device, []).append(grad.detach())
    if not by_device:
        return torch.zeros(())
    squares = [torch.stack(torch._foreach_norm(grads, 2, dtype=torch.float32)).square().sum().cpu()
               for grads in by_device.values()]
    return torch.stack(squares).sum().sqrt()


def validate_gradients(model_chunks, args):
    """Hand this rank's gradient norm to the rerun state machine: NaN and Inf are fatal; with
    --check-for-large-grads a norm >= 10x the largest of the first 100 (after iteration 1) is rejected, not
    fatal."""
    check_large = getattr(args, "check_for_large_grads", False)
    if not (args.check_for_nan_in_loss_and_grad or check_large):
        return
    machine = get_rerun_state_machine()
    norm = local_grad_norm(model_chunks)
    if args.check_for_nan_in_loss_and_grad:
        machine.validate_result(norm, torch.isnan, "found NaN in local grad norm", tolerance=GRAD_NORM_TOLERANCE)
        machine.validate_result(norm, torch.isinf, "found Inf in local grad norm", tolerance=GRAD_NORM_TOLERANCE)
    if check_large:
        machine.validate_result(
            norm,
            partial(machine.is_unexpectedly_large, threshold=LARGE_GRADS_FACTOR, context="grads"),
            "found unexpectedly large local grad norm",
            tolerance=GRAD_NORM_TOLERANCE,
            fatal=False,
        )


# ---- the machine's state in a checkpoint -----------------------------------------------------------------------


def rerun_state_path(root, iteration, rank):
    return os.path.join(root, iteration_dir_name(iteration), f"rerun_state_rank_{rank:05d}.pt")


def save_rerun_state(root, iteration):
    """Write each rank's machine state next to checkpoint `iteration` when it must resume to rerun (only then:
    other checkpoints get no such file). Collective."""
    state = get_rerun_state_machine().state_dict()
    if state is not None:
        path = rerun_state_path(root, iteration, dist.get_rank())
        os.makedirs(os.path.dirname(path), exist_ok=True)
        torch.save(state, path)
    dist.barrier()


def load_rerun_state(root, iteration):
    """Resume the machine from checkpoint `iteration` when it holds a state for this rank; True if it did."""
    path = rerun_state_path(root, iteration, dist.get_rank())
    if not os.path.isfile(path):
        return False
    get_rerun_state_machine().load_state_dict(torch.load(path, weights_only=False))
    if dist.get_rank() == 0:
        print(f"checkpoint {os.path.dirname(path)} asks to rerun iteration {iteration + 1} to diagnose a rejected "
              "result", flush=True)
    return True


# ---- leaving training after a rejected result -----------------------------------------------------------------


class RejectedResultExit(Exception):
    """Raised by `train_step` on every rank when the rerun state machine stops training: the optimizer step of
    the rejected iteration was not taken."""

    def __init__(self, should_checkpoint, exit_code):
        super().__init__(f"training stops after a rejected result (exit code {exit_code})")
        self.should_checkpoint = should_checkpoint
        self.exit_code = exit_code


def check_step_may_continue():
    """After the forward-backward loop: raise `RejectedResultExit` when the machine says stop."""
    should_checkpoint, should_exit, exit_code = get_rerun_state_machine().should_checkpoint_and_exit()
    if should_exit:
        raise RejectedResultExit(should_checkpoint, exit_code)


def exit_after_rejected_result(stop, iteration, last_saved_iteration, save, args):
    """Save the last completed iteration's checkpoint if the machine asks for one (with its state when it must
    resume to rerun), then leave with the machine's exit code (SystemExit on every rank).

    `save(iteration)` saves a checkpoint and returns whether it did (False without --save)."""
    if stop.should_checkpoint and args.save is not None:
        if last_saved_iteration != iteration:
            save(iteration)
        save_rerun_state(args.save, iteration)
    from megatron.training.checkpointing import maybe_finalize_async_save

    maybe_finalize_async_save(args, blocking=True)
    if dist.get_rank() == 0:
        print(f"exiting at iteration {iteration} with code {stop.exit_code}: a result was rejected in iteration "
              f"{iteration + 1}", flush=True)
    raise SystemExit(stop.exit_code)


def pause_result_validation():
    """Evaluation runs the loss function outside a training step: validate with reruns disabled (a rejected
    result is logged). Returns the mode to give back to `resume_result_validation`."""
    from megatron.core.rerun_state_machine import RerunMode

    machine = get_rerun_state_machine()
    mode = machine.get_mode()
    machine.set_mode(RerunMode.DISABLED)
    return mode


def resume_result_validation(mode):
    get_rerun_state_machine().set_mode(mode)
