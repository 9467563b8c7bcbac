"""Result-validation flags: the rerun state machine's mode and the checks of the loss and gradients
(see megatron/core/rerun_state_machine.py)."""

import warnings

RERUN_MODES = ("disabled", "validate_results", "report_stats")
INJECTED_ERROR_TYPES = ("correct_result", "transient_error", "persistent_error")


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
        "--check-for-nan-in-loss-and-grad",
        dest="check_for_nan_in_loss_and_grad",
        action="store_true",
        default=True,
        help="Check the loss of every microbatch and the gradient norm for NaN and Inf (the default; accepted so "
        "that launch scripts which spell it out parse).",
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
    group.add_argument(
        "--check-for-large-grads",
        action="store_true",
        help="Flag a local gradient norm at least 10x the largest of the first 100 (after iteration 1) as a "
        "rejected, non-fatal result for the rerun state machine.",
    )
    group.add_argument(
        "--result-rejected-tracker-filename",
        default=None,
        help="Append a line to this file for every rejected result (iteration, rank, node, device, value, check) "
        "and for the verdict on it, so that later jobs of the run can see what was rejected.",
    )
    group.add_argument(
        "--error-injection-rate",
        type=int,
        default=0,
        help="Testing: reject each validated training-step result with probability 1/N as if it were a fault of "
        "--error-injection-type (0, the default, injects nothing; 1 rejects the first check of every step).",
    )
    group.add_argument(
        "--error-injection-type",
        default="transient_error",
        choices=INJECTED_ERROR_TYPES,
        help="How an injected fault behaves when rerun: transient_error does not reproduce (exit 17); "
        "correct_result and persistent_error reproduce in place (exit 16) and then, resumed elsewhere, match / "
        "differ.",
    )


def validate(args):
    """With --fp16 and dynamic loss scaling (no --loss-scale), an overflow to Inf/NaN in the gradients is how the
    loss scaler learns to back off: the optimizer skips that step and halves the scale. The NaN/Inf check is
    turned off there, as upstream does, instead of stopping the run at the first overflow (with --rerun-mode
    disabled a spiky loss or large gradients, non-fatal findings, are logged only). Fault injection needs the
    reruns of validate_results and at least one check to inject into."""
    dynamic_fp16 = getattr(args, "fp16", False) and getattr(args, "loss_scale", None) is None
    if dynamic_fp16 and args.check_for_nan_in_loss_and_grad:
        warnings.warn("--fp16 with dynamic loss scaling: NaN/Inf gradients are the loss scaler's overflow signal (the "
                      "step is skipped and the scale halved), so the NaN/Inf check of the loss and gradients is off; "
                      "give --loss-scale for a static scale to keep it")
        args.check_for_nan_in_loss_and_grad = False
    _validate_error_injection(args)


def _validate_error_injection(args):
    rate = args.error_injection_rate
    if rate < 0:
        raise ValueError(f"--error-injection-rate must be >= 0, got {rate}")
    if rate == 0:
        return
    if args.rerun_mode != "validate_results":
        raise ValueError(f"--error-injection-rate exercises the reruns of --rerun-mode validate_results, but the mode "
                         f"is {args.rerun_mode}: use --rerun-mode validate_results or drop --error-injection-rate")
    if not (args.check_for_nan_in_loss_and_grad or args.check_for_spiky_loss or args.check_for_large_grads):
        raise ValueError("--error-injection-rate rejects results of the checks, but none is on: keep the NaN/Inf "
                         "check (drop --no-check-for-nan-in-loss-and-grad) or add --check-for-spiky-loss or "
                         "--check-for-large-grads")
