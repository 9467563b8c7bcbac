"""`model.state_dict()` issues no collective, as torch FSDP2's does not, so that the habit
`if rank == 0: torch.save(model.state_dict(), ...)` neither hangs nor pairs its collective with the other ranks'
next one. A 0-dim parameter lives in data-parallel rank 0's shard only (strategy 3) and its state-dict entry must
still hold its value on every rank (torch.distributed.checkpoint may save any rank's copy of a replicated entry)."""

import contextlib

import pytest
import torch

from tests.unit_tests.distributed.fsdp import fsdp_test_models as models
from tests.unit_tests.multiprocess_harness import run_on_ranks

_COLLECTIVES = ("all_reduce", "all_gather_into_tensor", "all_gather", "broadcast", "reduce_scatter_tensor",
                "reduce_scatter", "isend", "irecv", "send", "recv", "barrier", "all_gather_object")


@contextlib.contextmanager
def _collectives_refused():
    """Every torch.distributed collective this thread issues raises (naming itself) instead of running, and so
    does handing point-to-point messages to Megatron-FSDP's posting thread; messages that thread posts for
    collectives issued before (the post-step all-gather of strategies 1/2) still go."""
    import threading

    import torch.distributed as dist

    from megatron_fsdp import collectives

    caller = threading.current_thread()
    saved = {name: getattr(dist, name) for name in _COLLECTIVES}

    def refuse(name, function):
        def call(*args, **kwargs):
            if threading.current_thread() is not caller:
                return function(*args, **kwargs)
            raise RuntimeError(f"state_dict() issued torch.distributed.{name}")
        return call

    def refuse_posting(post):
        raise RuntimeError("state_dict() issued point-to-point messages")

    posting = collectives.post_in_background
    try:
        for name, function in saved.items():
            setattr(dist, name, refuse(name, function))
        collectives.post_in_background = refuse_posting
        yield
    finally:
        for name, function in saved.items():
            setattr(dist, name, function)
        collectives.post_in_background = posting


def _temperature(model):
    with model.gathered_parameters() as module:
        return module.temperature.detach().clone()


def _state_dicts_on_some_ranks(strategy):
    import torch.distributed as dist

    import megatron_fsdp

    torch.manual_seed(0)
    module = models.ScaledLinear()
    model, optimizer = megatron_fsdp.fully_shard(module, torch.optim.AdamW(module.parameters(), lr=0.1),
                                                 zero_dp_strategy=strategy)
    inputs = torch.randn(4, models.IN_FEATURES, generator=torch.Generator().manual_seed(dist.get_rank()))
    results = {}
    for step in range(2):
        optimizer.zero_grad()
        model(inputs).square().mean().backward()
        optimizer.step()
        if dist.get_rank() == 0:
            with _collectives_refused():
                results[f"rank0_after_step{step}"] = model.state_dict()["temperature"].to_local().clone()
    with torch.no_grad():
        model(inputs)  # an evaluation forward between the step and the save
    with _collectives_refused():
        results["after_eval"] = model.state_dict()["temperature"].to_local().clone()
    results["trained"] = _temperature(model)
    other = models.ScaledLinear()
    other.temperature.data.fill_(-0.75)
    model.load_state_dict(other.state_dict())
    with _collectives_refused():
        results["after_load"] = model.state_dict()["temperature"].to_local().clone()
    with torch.no_grad():  # a write on every rank: the next state dict sums the value over the ranks once
        model.module.temperature.mul_(2.0)
    results["after_write"] = model.state_dict()["temperature"].to_local().clone()
    results["written"] = _temperature(model)
    return results


@pytest.mark.parametrize("world_size", [2])
def test_state_dict_on_rank_0_alone_issues_no_collective(world_size):
    for strategy in (0, 1, 2, 3):
        results = run_on_ranks(world_size, _state_dicts_on_some_ranks, strategy)
        trained = results[0]["trained"]
        assert trained != 1.5, strategy  # the steps moved it
        assert results[0]["rank0_after_step1"] == trained, strategy
        for rank_result in results:
            assert torch.equal(rank_result["trained"], trained), strategy
            assert torch.equal(rank_result["after_eval"], trained), strategy
            assert rank_result["after_load"] == -0.75, strategy
            assert rank_result["after_write"] == rank_result["written"] == -1.5, strategy
