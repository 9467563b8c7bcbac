"""Logging flags as upstream's launch scripts spell them, and the scalar flags that have no writer to reach."""

import sys
import types
import warnings

from tests.unit_tests.training.argument_checks import validated


def test_upstreams_misspelt_learning_rate_switch_turns_the_scalar_off():
    assert validated().log_learning_rate_to_tensorboard is True
    assert validated("--no-log-learnig-rate-to-tensorboard").log_learning_rate_to_tensorboard is False
    assert validated("--no-log-learning-rate-to-tensorboard").log_learning_rate_to_tensorboard is False


def _warnings_of(extra):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        validated(extra)
    return [str(warning.message) for warning in caught if "tensorboard" in str(warning.message).lower()]


def test_scalar_flags_without_a_writer_are_named_in_a_warning():
    flags = ("--log-timers-to-tensorboard --log-validation-ppl-to-tensorboard --log-world-size-to-tensorboard "
             "--log-batch-size-to-tensorboard --tensorboard-log-interval 5")
    assert _warnings_of(flags) == [
        "--log-timers-to-tensorboard, --log-validation-ppl-to-tensorboard, --log-world-size-to-tensorboard, "
        "--log-batch-size-to-tensorboard, --tensorboard-log-interval without --tensorboard-dir or --wandb-project: "
        "these scalars are written nowhere; add --tensorboard-dir DIR (or --wandb-project) to get them"]
    assert _warnings_of("--log-memory-to-tensorboard") == [
        "--log-memory-to-tensorboard without --tensorboard-dir or --wandb-project: the memory line is printed at "
        "every log line, but no mem-* scalars are written; add --tensorboard-dir DIR (or --wandb-project) to get "
        "them"]
    assert _warnings_of("--tensorboard-queue-size 8") == [
        "--tensorboard-queue-size 8 without --tensorboard-dir: there is no TensorBoard writer to queue for; add "
        "--tensorboard-dir DIR"]


def test_scalar_flags_with_a_writer_or_at_their_defaults_warn_nothing(tmp_path, monkeypatch):
    assert _warnings_of("") == []
    assert _warnings_of("--tensorboard-log-interval 1 --tensorboard-queue-size 1000") == []
    assert _warnings_of(f"--tensorboard-dir {tmp_path} --log-timers-to-tensorboard --log-memory-to-tensorboard "
                        "--tensorboard-log-interval 5 --tensorboard-queue-size 8") == []
    # W&B receives the same scalars as TensorBoard (its queue size is TensorBoard's alone).
    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace())
    assert _warnings_of(f"--wandb-project p --wandb-exp-name e --save {tmp_path} --log-timers-to-tensorboard "
                        "--log-memory-to-tensorboard --tensorboard-log-interval 5") == []
