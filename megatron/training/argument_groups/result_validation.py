"""Result-validation flags: the rerun state machine's mode and the checks of the loss and gradients
(see megatron/core/rerun_state_machine.py)."""

import warnings

RERUN_MODES = ("disabled", "validate_results", "report_stats")


def add_arguments(parser):
    group = parser.add_argument_group("result validation")
    group.add_argument(
        "--rerun-mode",
        default="validate_results",
        choices=RERUN_MODES,
        help="validate_results: a rejected result (NaN/Inf loss or gradients, spiky loss) reruns the step in place "
        "on the same data; a transient fault exits with code 17, a reproducible result saves the last checkpoint and "
        "exits with 16 (resume on another device to diagnose). report_stats: rerun every step and report the "
        "differences between the two runs. disabled: no rerun; a rejected NaN/Inf result raises on every rank.",
    )
    group.add_argument(
        "--no-check-for-nan-in-loss-and-grad",
        dest="check_for_nan_in_loss_and_grad",
        action="store_false",
        help="Do not check the loss of every microbatch and the gradient norm for NaN and Inf (checked by default).",
    )
    group.add_argument(
        "--check-for-spiky-loss",
        action="store_true",
        help="Flag a microbatch loss at least 10x the largest of the first 100 losses (after iteration 1) as a "
        "rejected, non-fatal result for the rerun state machine.",
    )


def validate(args):
    """With --fp16 and dynamic loss scaling (no --loss-scale), an overflow to Inf/NaN in the gradients is how the
    loss scaler learns to back off: the optimizer skips that step and halves the scale. The NaN/Inf check is
    turned off there, as upstream does, instead of stopping the run at the first overflow. Every other
    combination of these flags is valid (with --rerun-mode disabled a spiky loss, a non-fatal finding, is logged
    only)."""
    dynamic_fp16 = getattr(args, "fp16", False) and getattr(args, "loss_scale", None) is None
    if dynamic_fp16 and args.check_for_nan_in_loss_and_grad:
        warnings.warn("--fp16 with dynamic loss scaling: NaN/Inf gradients are the loss scaler's overflow signal (the "
                      "step is skipped and the scale halved), so the NaN/Inf check of the loss and gradients is off; "
                      "give --loss-scale for a static scale to keep it")
        args.check_for_nan_in_loss_and_grad = False
