"""How a run learns its rank and world size: the launcher's environment, or a process group the caller already
made; and the launch flags (--local-rank, --distributed-timeout-minutes)."""

import os
import re
from datetime import timedelta
from unittest import mock

import pytest
import torch

from megatron.training.arguments import parse_args, validate_args
from tests.unit_tests.multiprocess_harness import run_on_ranks
from tests.unit_tests.training.argument_checks import BASE, validated

LAUNCH_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _validated_with_environment(environment, extra=""):
    launcher_free = {key: value for key, value in os.environ.items() if key not in LAUNCH_VARIABLES}
    with mock.patch.dict(os.environ, dict(launcher_free, **environment), clear=True):
        return validate_args(parse_args(args=f"{BASE} {extra}".split()))


@pytest.mark.parametrize("environment, message", [
    ({"RANK": "1"}, "RANK=1 and WORLD_SIZE=(unset): RANK must be in 0 .. WORLD_SIZE - 1"),
    ({"RANK": "3", "WORLD_SIZE": "2"}, "RANK=3 and WORLD_SIZE=2: RANK must be in 0 .. WORLD_SIZE - 1"),
    ({"RANK": "-1", "WORLD_SIZE": "2"}, "RANK=-1 and WORLD_SIZE=2: RANK must be in 0 .. WORLD_SIZE - 1"),
])
def test_a_rank_outside_the_world_is_refused_before_the_ranks_try_to_meet(environment, message):
    """Without the check, RANK=1 alone failed inside gloo ("rank < size. 1 vs 1") and RANK=3 of 2 waited for
    peers until the timeout."""
    with pytest.raises(ValueError, match=r"launcher's environment gives this process " + re.escape(message)
                       + r"\. Launch the ranks with torchrun"):
        _validated_with_environment(environment)


def test_a_launcher_variable_that_is_not_a_number_is_named():
    with pytest.raises(ValueError, match=r"the environment variable WORLD_SIZE='two' must be an integer"):
        _validated_with_environment({"WORLD_SIZE": "two"})


def test_the_launcher_environment_gives_rank_and_world_size():
    args = _validated_with_environment({"RANK": "3", "WORLD_SIZE": "4"})
    assert (args.rank, args.world_size, args.data_parallel_size) == (3, 4, 4)
    args = _validated_with_environment({})
    assert (args.rank, args.world_size, args.data_parallel_size) == (0, 1, 1)


@pytest.mark.parametrize("minutes", ["0", "-5"])
def test_distributed_timeout_minutes_must_be_positive(minutes):
    with pytest.raises(ValueError, match=rf"--distributed-timeout-minutes must be at least 1, got {minutes}"):
        validated(f"--distributed-timeout-minutes {minutes}")


@pytest.mark.parametrize("spelling", ["--local-rank=1", "--local_rank=1", "--local_rank 1"])
def test_both_spellings_of_the_launchers_local_rank_flag_parse(spelling):
    """torch.distributed.launch without --use-env passes --local-rank=N; older launchers pass --local_rank=N."""
    assert parse_args(args=BASE.split() + spelling.split()).local_rank == 1


@pytest.mark.parametrize("environment, extra, expected", [
    ({"LOCAL_RANK": "1"}, "--local-rank 0", 0),
    ({"LOCAL_RANK": "1"}, "", 1),
    ({}, "--local-rank 1", 1),
    ({}, "", 0),
])
def test_the_local_rank_flag_wins_over_the_environment(environment, extra, expected):
    """As upstream (LOCAL_RANK is only the flag's default): the value the launcher passed on the command line
    picks the device, even when LOCAL_RANK says otherwise."""
    assert _validated_with_environment(environment, extra).local_rank == expected


def test_a_negative_local_rank_flag_is_refused():
    with pytest.raises(ValueError, match=r"--local-rank must be >= 0 .*got -1: drop it to take the launcher's "
                       r"LOCAL_RANK"):
        _validated_with_environment({"LOCAL_RANK": "0"}, "--local-rank -1")


def test_initialize_distributed_uses_the_local_rank_flag_over_the_environment():
    from megatron.training import initialize

    args = _validated_with_environment({"LOCAL_RANK": "1"}, "--local-rank 0")
    with mock.patch.dict(os.environ, {"LOCAL_RANK": "1"}), \
            mock.patch.object(initialize.accelerator, "device_for_backend", side_effect=RuntimeError("stop")) as pick:
        with pytest.raises(RuntimeError, match="stop"):
            initialize.initialize_distributed(args)
    assert pick.call_args.args[1] == 0 and args.local_rank == 0


def _group_timeout(group):
    return group._get_backend(torch.device("cpu")).options._timeout


def _initialize_on_a_process_group_made_without_a_launcher():
    """initialize_megatron() on the pool's process group, with no launcher variables in the environment (as after
    init_process_group(init_method="tcp://...", rank=r, world_size=n) in a user's script)."""
    import torch.distributed as dist

    from megatron.core import parallel_state
    from megatron.training.initialize import initialize_megatron
    from megatron.training.training import _teardown

    saved_environment = {key: os.environ.pop(key) for key in LAUNCH_VARIABLES if key in os.environ}
    threads = torch.get_num_threads()
    try:
        args = initialize_megatron(args=f"{BASE} --global-batch-size 4 --distributed-timeout-minutes 3".split())
        try:
            return {
                "rank": (args.rank, dist.get_rank()),
                "world_size": args.world_size,
                "data_parallel_size": (args.data_parallel_size, parallel_state.get_data_parallel_world_size()),
                "created_process_group": args.created_process_group,
                "timeouts": [_group_timeout(group) for group in (parallel_state.get_data_parallel_group(),
                                                                 parallel_state.get_tensor_model_parallel_group(),
                                                                 parallel_state.get_pipeline_model_parallel_group())],
            }
        finally:
            _teardown(args)
    finally:
        os.environ.update(saved_environment)
        torch.set_num_threads(threads)


def test_a_process_group_made_before_initialize_megatron_is_reused_with_its_rank_and_size():
    """As upstream: the caller's group is kept (and not destroyed), and its rank and size are the run's, so the
    data-parallel size matches the groups; --distributed-timeout-minutes reaches the model-parallel groups."""
    results = run_on_ranks(2, _initialize_on_a_process_group_made_without_a_launcher)
    for rank, result in enumerate(results):
        assert result == {
            "rank": (rank, rank),
            "world_size": 2,
            "data_parallel_size": (2, 2),
            "created_process_group": False,
            "timeouts": [timedelta(minutes=3)] * 3,
        }


def _only_the_last_stage(pipeline_ranks):
    return [pipeline_ranks[-1]]


def _initialize_with_upstream_keywords():
    """Upstream's initialize_megatron() keywords, as user scripts pass them."""
    import torch.distributed as dist

    from megatron.core import parallel_state
    from megatron.training import get_args
    from megatron.training.initialize import initialize_megatron
    from megatron.training.training import _teardown

    argv = f"{BASE} --global-batch-size 4 --pipeline-model-parallel-size 2".split()
    threads = torch.get_num_threads()
    try:
        only_arguments = initialize_megatron(args=argv, skip_mpu_initialization=True, allow_no_cuda=True)
        skipped = (get_args() is only_arguments, parallel_state.model_parallel_is_initialized())
        parsed = parse_args(args=argv)
        args = initialize_megatron(parsed_args=parsed, allow_no_cuda=True, get_embedding_ranks=_only_the_last_stage,
                                   get_position_embedding_ranks=_only_the_last_stage)
        try:
            return {
                "skip_mpu_initialization": skipped,
                "parsed_args_used": args is parsed and get_args() is parsed,
                "embedding": parallel_state.is_rank_in_embedding_group(),
                "position_embedding": parallel_state.is_rank_in_position_embedding_group(),
                "rank": dist.get_rank(),
            }
        finally:
            _teardown(args)
    finally:
        torch.set_num_threads(threads)


def test_initialize_megatron_takes_upstreams_keywords():
    """skip_mpu_initialization sets the arguments only; parsed_args is used instead of the command line;
    get_embedding_ranks / get_position_embedding_ranks choose the embedding groups; allow_no_cuda is accepted."""
    results = run_on_ranks(2, _initialize_with_upstream_keywords)
    for rank, result in enumerate(results):
        assert result == {
            "skip_mpu_initialization": (True, False),
            "parsed_args_used": True,
            "embedding": rank == 1,  # default: both stages
            "position_embedding": rank == 1,
            "rank": rank,
        }


class _Joined(Exception):
    pass


def test_a_store_given_to_initialize_megatron_is_where_a_new_process_group_meets(monkeypatch):
    import torch.distributed as dist

    from megatron.training import initialize

    calls = []

    def record_instead_of_joining(**kwargs):
        calls.append(kwargs)
        raise _Joined

    monkeypatch.setattr(initialize.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(initialize.dist, "init_process_group", record_instead_of_joining)
    store = dist.HashStore()
    args = validated("--distributed-backend gloo --distributed-timeout-minutes 2", world_size=2, rank=1)
    with pytest.raises(_Joined):
        initialize.initialize_distributed(args, store=store)
    assert calls == [{"backend": "gloo", "rank": 1, "world_size": 2, "timeout": timedelta(minutes=2), "store": store}]


def test_pretrain_hands_upstreams_launch_keywords_to_initialize_megatron(monkeypatch):
    """Upstream's pretrain_gpt.py calls pretrain(..., store=store); the embedding-rank choosers go along too."""
    import torch.distributed as dist

    from megatron.core.enums import ModelType
    from megatron.training import training

    calls = []

    def record_instead_of_initializing(*args, **kwargs):
        calls.append(kwargs)
        raise _Joined

    monkeypatch.setattr(training, "initialize_megatron", record_instead_of_initializing)
    store = dist.HashStore()
    with pytest.raises(_Joined):
        training.pretrain(None, None, ModelType.encoder_or_decoder, None, store=store,
                          get_embedding_ranks=_only_the_last_stage, get_position_embedding_ranks=_only_the_last_stage)
    assert calls == [{"args": None, "store": store, "get_embedding_ranks": _only_the_last_stage,
                      "get_position_embedding_ranks": _only_the_last_stage}]


def test_pretrain_takes_upstreams_positional_order_and_refuses_inprocess_call_wrapper(monkeypatch):
    """Upstream's fifth argument is process_non_loss_data_func, then extra_args_provider and args_defaults: a
    positional call in that order passes the providers where upstream does, and the in-process restart wrapper
    this pretrain() does not run is refused by name instead of being taken as another argument."""
    from megatron.core.enums import ModelType
    from megatron.training import training

    calls = []

    def record_instead_of_initializing(*args, **kwargs):
        calls.append((args, kwargs))
        raise _Joined

    def extra_args(parser):
        return parser

    monkeypatch.setattr(training, "initialize_megatron", record_instead_of_initializing)
    with pytest.raises(_Joined):
        training.pretrain(None, None, ModelType.encoder_or_decoder, None, None, extra_args, {"lr": 0.5})
    assert calls[0][0] == (extra_args, {"lr": 0.5})
    with pytest.raises(ValueError, match=r"^pretrain\(inprocess_call_wrapper=\.\.\.\) is not supported: .*; "
                                         r"drop inprocess_call_wrapper "):
        training.pretrain(None, None, ModelType.encoder_or_decoder, None, inprocess_call_wrapper=print)
    assert len(calls) == 1
