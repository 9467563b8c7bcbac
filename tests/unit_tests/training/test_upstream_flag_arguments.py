"""Validation of upstream's logging, profiling, run-control, result-validation and resilience flags: each either
sets what it stands for or stops with a message naming the flag and saying what to do instead."""

import sys
import types

import pytest

from megatron.training.arguments import parse_args, validate_args

TINY_GPT = (
    "--num-layers 2 --hidden-size 32 --num-attention-heads 2 --seq-length 16 --micro-batch-size 2 --lr 1e-3 "
    "--mock-data --vocab-size 127 --train-iters 4 --distributed-backend gloo"
)


@pytest.fixture(autouse=True)
def single_rank(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")


def _validated(extra):
    return validate_args(parse_args(args=f"{TINY_GPT} {extra}".split()))


def test_defaults_follow_upstream():
    args = _validated("")
    assert (args.profile, args.use_pytorch_profiler, args.profile_step_start, args.profile_step_end,
            args.profile_ranks) == (False, False, 10, 12, [0])
    assert (args.record_memory_history, args.memory_snapshot_path) == (False, "snapshot.pickle")
    assert (args.log_learning_rate_to_tensorboard, args.log_loss_scale_to_tensorboard) == (True, True)
    assert (args.log_batch_size_to_tensorboard, args.log_world_size_to_tensorboard, args.log_progress) == (
        False, False, False)
    assert (args.skip_train, args.iterations_to_skip, args.recompute_granularity) == (False, [], None)
    assert (args.error_injection_rate, args.error_injection_type, args.check_for_large_grads) == (
        0, "transient_error", False)
    assert (args.straggler_ctrlr_port, args.straggler_minmax_count) == (65535, 1)


def test_recompute_activations_means_selective():
    assert _validated("--recompute-activations").recompute_granularity == "selective"
    assert _validated("--recompute-activations --recompute-granularity selective").recompute_granularity == "selective"


def test_switches_and_lists_parse():
    args = _validated("--no-log-learning-rate-to-tensorboard --no-log-loss-scale-to-tensorboard "
                      "--iterations-to-skip 3 7 --profile --use-pytorch-profiler --save /tmp/x --profile-ranks 0")
    assert (args.log_learning_rate_to_tensorboard, args.log_loss_scale_to_tensorboard) == (False, False)
    assert args.iterations_to_skip == [3, 7]


def test_wandb_with_the_package_present(monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", types.ModuleType("wandb"))
    args = _validated("--wandb-project p --wandb-exp-name e --wandb-save-dir /tmp/w --wandb-entity team")
    assert (args.wandb_project, args.wandb_exp_name, args.wandb_save_dir, args.wandb_entity) == (
        "p", "e", "/tmp/w", "team")
    with pytest.raises(ValueError, match="--wandb-project needs --wandb-exp-name"):
        _validated("--wandb-project p --wandb-save-dir /tmp/w")
    with pytest.raises(ValueError, match=r"--wandb-save-dir \(default <--save>/wandb\)"):
        _validated("--wandb-project p --wandb-exp-name e")


def test_wandb_flags_without_a_project_warn():
    with pytest.warns(UserWarning, match="--wandb-exp-name without --wandb-project"):
        _validated("--wandb-exp-name e")


@pytest.mark.parametrize("extra, message", [
    ("--recompute-activations --recompute-granularity full --recompute-method uniform --recompute-num-layers 1",
     "--recompute-activations means --recompute-granularity selective, which contradicts --recompute-granularity "
     "full"),
    ("--use-pytorch-profiler --save /tmp/x", "--use-pytorch-profiler chooses the profiler of --profile: add --profile"),
    ("--profile --use-pytorch-profiler", "writes its trace to --tensorboard-dir (or --save)"),
    ("--profile --use-pytorch-profiler --save /tmp/x --profile-step-start 5 --profile-step-end 5",
     "--profile-step-end (5) must be greater than --profile-step-start (5)"),
    ("--profile --use-pytorch-profiler --save /tmp/x --profile-step-start -1", "--profile-step-start must be >= 0"),
    ("--profile --use-pytorch-profiler --save /tmp/x --profile-ranks 0 3", "--profile-ranks [3] are not ranks"),
    ("--profile", "needs CUDA; this run uses gloo: add --use-pytorch-profiler"),
    ("--record-memory-history", "--record-memory-history records the CUDA caching allocator and needs a CUDA device"),
    ("--log-progress", "--log-progress writes progress.txt in the checkpoint directory: add --save"),
    ("--wandb-project p --wandb-exp-name e --save /tmp/x", "`pip install wandb`, or drop --wandb-project"),
    ("--iterations-to-skip -1", "--iterations-to-skip takes completed-iteration counts >= 0"),
    ("--skip-train --iterations-to-skip 2", "--skip-train runs none: drop one of them"),
    ("--error-injection-rate -1", "--error-injection-rate must be >= 0"),
    ("--error-injection-rate 5 --rerun-mode disabled", "use --rerun-mode validate_results or drop"),
    ("--error-injection-rate 5 --no-check-for-nan-in-loss-and-grad", "add --check-for-spiky-loss or"),
    ("--error-injection-type sometimes", "invalid choice"),
    ("--log-straggler", "drop --log-straggler"),
    ("--enable-ft-package", "nvidia-resiliency-ext is not installed"),
    ("--calc-ft-timeouts", "drop --calc-ft-timeouts"),
    ("--straggler-minmax-count 0", "--straggler-minmax-count must be >= 1"),
])
def test_rules_name_the_flag_and_what_to_do(extra, message, capsys):
    with pytest.raises((ValueError, SystemExit)) as error:
        _validated(extra)
    assert message in str(error.value) + capsys.readouterr().err
