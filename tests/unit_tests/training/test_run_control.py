"""Run control in `pretrain()` on 2 ranks: --exit-duration-in-mins stops every rank at the same step after a
checkpoint, --empty-unused-memory-level releases memory where upstream does, --check-weight-hash-across-dp-
replicas-interval compares replicas at its interval (and names a parameter that differs), --logging-level."""

import logging

import pytest
import torch

from megatron.training import run_control
from tests.unit_tests.multiprocess_harness import run_on_ranks

TINY_GPT = (
    "--num-layers 2 --hidden-size 32 --num-attention-heads 2 --seq-length 16 --micro-batch-size 2 "
    "--global-batch-size 8 --lr 1e-3 --mock-data --vocab-size 127 --make-vocab-size-divisible-by 64 "
    "--hidden-dropout 0 --attention-dropout 0 --num-workers 0 --log-interval 1 --ckpt-format torch "
    "--train-iters 6 --eval-interval 2 --eval-iters 1"
)


def _pretrain_past_the_time_limit(workdir):
    import pretrain_gpt
    from megatron.core.enums import ModelType
    from megatron.training import accelerator, training
    from megatron.training.checkpointing import read_tracker
    from megatron.training.global_vars import get_args

    rank = torch.distributed.get_rank()
    calls = {"forward": 0, "empty_cache": 0, "hash_checks": []}
    real_clock, real_empty_cache, real_check = run_control.ExitDuration.clock, accelerator.empty_cache, \
        training.check_weight_hashes

    def forward_step(data_iterator, model):
        calls["forward"] += 1
        microbatches = 8 // (2 * get_args().data_parallel_size)
        # Rank 0 only, in the first microbatch of iteration 3: its clock jumps two minutes ahead.
        # (After 2 iterations and the evaluation at iteration 2, one global batch: 3 x microbatches forwards.)
        if rank == 0 and calls["forward"] == 3 * microbatches + 1:
            run_control.ExitDuration.clock = staticmethod(lambda: real_clock() + 120.0)
        return pretrain_gpt.forward_step(data_iterator, model)

    def counting_empty_cache(device):
        calls["empty_cache"] += 1
        return real_empty_cache(device)

    def counting_check(model, iteration, args):
        calls["hash_checks"].append(iteration)
        return real_check(model, iteration, args)

    accelerator.empty_cache = counting_empty_cache
    training.check_weight_hashes = counting_check
    root_level = logging.getLogger().level
    try:
        iteration = training.pretrain(
            pretrain_gpt.train_valid_test_datasets_provider, pretrain_gpt.model_provider,
            ModelType.encoder_or_decoder, forward_step,
            argv=(f"{TINY_GPT} --save {workdir} --exit-duration-in-mins 1 --empty-unused-memory-level 2 "
                  "--check-weight-hash-across-dp-replicas-interval 2 --logging-level 30 --use-distributed-optimizer "
                  "--overlap-grad-reduce --overlap-param-gather").split())
        logging_level = logging.getLogger().level
    finally:
        run_control.ExitDuration.clock = staticmethod(real_clock)
        accelerator.empty_cache = real_empty_cache
        training.check_weight_hashes = real_check
        logging.getLogger().setLevel(root_level)
    return {"iteration": iteration, "tracker": read_tracker(workdir), "empty_cache": calls["empty_cache"],
            "hash_checks": calls["hash_checks"], "logging_level": logging_level}


def test_exit_duration_memory_release_weight_hashes_and_logging_level(tmp_path):
    results = run_on_ranks(2, _pretrain_past_the_time_limit, str(tmp_path))
    # Rank 0 alone passed the limit during iteration 3; both ranks stop there, after saving iteration 3.
    # Memory released after forward-backward and after the optimizer step of 3 iterations (level 2), and after
    # the one evaluation step (iteration 2); weight hashes compared before training and at iteration 2 (with the
    # distributed optimizer's overlapped parameter gather still in flight after the step).
    assert results == [{"iteration": 3, "tracker": 3, "empty_cache": 3 * 2 + 1, "hash_checks": [0, 2],
                        "logging_level": 30}] * 2


def _mismatch_report(perturb_rank):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    rank = torch.distributed.get_rank()
    module = torch.nn.Module()
    module.replicated = torch.nn.Parameter(torch.arange(6.0).reshape(2, 3))
    module.untouched = torch.nn.Parameter(torch.ones(3))
    mesh = init_device_mesh("cpu", (2,))
    # A Shard(0) DTensor: its ranks hold different rows, yet the whole parameter is one and the same.
    module.sharded = torch.nn.Parameter(distribute_tensor(torch.arange(8.0).reshape(4, 2), mesh, [Shard(0)]))
    if rank == perturb_rank:
        with torch.no_grad():
            module.replicated[1, 2] += 1e-6
    group = torch.distributed.group.WORLD
    return run_control.mismatched_parameters([module], group, torch.device("cpu"))


def test_weight_hash_mismatch_is_named_on_every_rank():
    assert run_on_ranks(2, _mismatch_report, None) == [[], []]
    assert run_on_ranks(2, _mismatch_report, 1) == [["replicated"], ["replicated"]]


def test_logging_level_flag_wins_over_environment(monkeypatch):
    import argparse

    root_level = logging.getLogger().level
    try:
        monkeypatch.setenv(run_control.LOGGING_LEVEL_ENV, "40")
        assert run_control.setup_logging(argparse.Namespace(logging_level=None)) == 40
        assert logging.getLogger().level == 40
        assert run_control.setup_logging(argparse.Namespace(logging_level=10)) == 10
        assert logging.getLogger().level == 10
        monkeypatch.setenv(run_control.LOGGING_LEVEL_ENV, "loud")
        with pytest.raises(ValueError, match="MEGATRON_LOGGING_LEVEL='loud' must be an integer"):
            run_control.setup_logging(argparse.Namespace(logging_level=None))
    finally:
        logging.getLogger().setLevel(root_level)


@pytest.mark.parametrize("extra, message", [
    ("--exit-duration-in-mins -1", "--exit-duration-in-mins must be positive"),
    ("--empty-unused-memory-level 3", "invalid choice"),
    ("--logging-level -1", "--logging-level must be a non-negative"),
    ("--check-weight-hash-across-dp-replicas-interval 0", "--check-weight-hash-across-dp-replicas-interval must be"),
    ("--skip-train --eval-iters 0", "--eval-iters 0 turns evaluation off: the run would do nothing. Give "
     "--eval-iters N"),
])
def test_run_control_rules(extra, message, monkeypatch, capsys):
    from megatron.training.arguments import parse_args, validate_args

    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises((ValueError, SystemExit)) as error:
        validate_args(parse_args(args=(TINY_GPT + " " + extra).split()))
    assert message in str(error.value) + capsys.readouterr().err


def test_exit_duration_of_zero_is_no_limit_as_upstream(monkeypatch):
    from megatron.training.arguments import parse_args, validate_args

    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    args = validate_args(parse_args(args=(TINY_GPT + " --exit-duration-in-mins 0").split()))
    assert args.exit_duration_in_mins is None


def test_exit_interval_of_zero_is_no_exit_interval_as_upstream(monkeypatch):
    """Upstream tests `args.exit_interval and ...`: 0 never stops the run (it was refused here)."""
    from megatron.training.arguments import parse_args, validate_args

    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    assert validate_args(parse_args(args=(TINY_GPT + " --exit-interval 0").split())).exit_interval is None
    assert validate_args(parse_args(args=(TINY_GPT + " --exit-interval 3").split())).exit_interval == 3
    with pytest.raises(ValueError, match=r"--exit-interval must be positive \(0 turns it off\), got -1"):
        validate_args(parse_args(args=(TINY_GPT + " --exit-interval -1").split()))


def _two_megatron_fsdp_runs_checking_weight_hashes(workdir):
    from tests.unit_tests.dist_checkpointing.pretrain_helpers import run_pretrain

    flags = "--use-megatron-fsdp --check-weight-hash-across-dp-replicas-interval 4 --train-iters 4"
    return [run_pretrain(f"{workdir}/run{index}", flags) for index in range(2)]


def test_weight_hashes_of_sharded_parameters_in_a_second_run_of_the_process(tmp_path):
    # The second pretrain() builds new process groups: the check must gather the DTensors over those, not over
    # meshes cached from the first run's destroyed groups.
    first, second = run_on_ranks(2, _two_megatron_fsdp_runs_checking_weight_hashes, str(tmp_path))[0]
    assert sorted(first) == [1, 2, 3, 4] and first == second
