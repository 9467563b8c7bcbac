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


def _local(value):
    return value.to_local().clone() if hasattr(value, "to_local") else value.clone()


def _optimizer_state_of_temperature(optimizer):
    return {key: _local(value) for key, value in optimizer.state_dict()["state"]["temperature"].items()}


def _optimizer_state_dicts_on_some_ranks(strategy, dtype):
    import torch.distributed as dist

    import megatron_fsdp

    torch.manual_seed(0)
    module = models.ScaledLinear().to(dtype)
    model, optimizer = megatron_fsdp.fully_shard(
        module, torch.optim.AdamW(module.parameters(), lr=0.1), zero_dp_strategy=strategy,
        mixed_precision_policy=megatron_fsdp.MixedPrecisionPolicy(main_params_dtype=torch.float32))
    inputs = torch.randn(4, models.IN_FEATURES, generator=torch.Generator().manual_seed(dist.get_rank()),
                         dtype=dtype)
    results = {}
    with _collectives_refused():  # before any step
        results["fresh"] = _optimizer_state_of_temperature(optimizer)
    for step in range(2):
        optimizer.zero_grad()
        model(inputs).float().square().mean().backward()
        optimizer.step()
        if dist.get_rank() == step % 2:  # one rank alone, as `if rank == 0: torch.save(...)` does
            with _collectives_refused():
                results[f"alone_after_step{step}"] = _optimizer_state_of_temperature(optimizer)
    results["everyone"] = _optimizer_state_of_temperature(optimizer)
    saved = optimizer.state_dict()
    for entries in saved["state"].values():  # other values to load: the moments and main weights doubled
        for key, value in entries.items():
            if key != "step":
                entries[key] = value * 2
    optimizer.load_state_dict(saved)
    if dist.get_rank() == 1:
        with _collectives_refused():
            results["alone_after_load"] = _optimizer_state_of_temperature(optimizer)
    other = models.ScaledLinear().to(dtype)
    other.temperature.data.fill_(-0.75)
    model.load_state_dict(other.state_dict())
    if dist.get_rank() == 1:
        with _collectives_refused():
            results["alone_after_model_load"] = _optimizer_state_of_temperature(optimizer)
    for entries in optimizer.state.values():  # a write outside a step, on every rank: one sum over the ranks
        entries["exp_avg"].mul_(3)
    results["after_write"] = _optimizer_state_of_temperature(optimizer)
    return results


@pytest.mark.parametrize("world_size", [2])
def test_optimizer_state_dict_on_one_rank_alone_issues_no_collective(world_size):
    """A 0-dim parameter's moments (and fp32 main weight of a bf16 model) live on data-parallel rank 0 only;
    every rank's `optimizer.state_dict()` holds their values without communicating."""
    for strategy in (1, 2, 3):
        for dtype in (torch.float32, torch.bfloat16):
            results = run_on_ranks(world_size, _optimizer_state_dicts_on_some_ranks, strategy, dtype)
            everyone = results[0]["everyone"]
            assert set(everyone) == ({"exp_avg", "exp_avg_sq", "step"} |
                                     ({"main_param"} if dtype == torch.bfloat16 else set())), (strategy, dtype)
            assert everyone["exp_avg"] != 0 and everyone["exp_avg_sq"] > 0, (strategy, dtype)
            assert results[0]["fresh"]["exp_avg"] == 0 and results[1]["fresh"]["exp_avg_sq"] == 0
            for key, value in everyone.items():
                assert torch.equal(results[1]["everyone"][key], value), (strategy, dtype, key)
                assert torch.equal(results[1]["alone_after_step1"][key], value), (strategy, dtype, key)
                if key != "step":
                    assert torch.equal(results[1]["alone_after_load"][key], value * 2), (strategy, dtype, key)
            assert results[0]["alone_after_step0"]["exp_avg"] != everyone["exp_avg"], (strategy, dtype)
            after_model_load = results[1]["alone_after_model_load"]
            assert torch.equal(after_model_load["exp_avg"], everyone["exp_avg"] * 2), (strategy, dtype)
            for rank_result in results:
                assert torch.equal(rank_result["after_write"]["exp_avg"], everyone["exp_avg"] * 6), (strategy, dtype)
            if dtype == torch.bfloat16:  # model.load_state_dict set the main weights
                assert after_model_load["main_param"] == -0.75, strategy


def _hfsdp_state_dicts_on_some_ranks():
    import torch.distributed as dist

    import megatron_fsdp
    from tests.unit_tests.distributed.fsdp.test_hfsdp import _mesh_kwargs

    torch.manual_seed(0)
    module = models.ScaledLinear()
    model, optimizer = megatron_fsdp.fully_shard(module, torch.optim.AdamW(module.parameters(), lr=0.1),
                                                 zero_dp_strategy=3, **_mesh_kwargs())
    assert model.groups[0].outer_sharded
    inputs = torch.randn(4, models.IN_FEATURES, generator=torch.Generator().manual_seed(dist.get_rank()))
    results = {}
    with _collectives_refused():
        results["wrapped"] = model.state_dict()["temperature"].to_local().clone()
    for step in range(2):
        optimizer.zero_grad()
        model(inputs).square().mean().backward()
        optimizer.step()
        if dist.get_rank() == 3 - step:  # ranks holding no part of the 0-dim parameter's shard
            with _collectives_refused():
                results["alone_after_step"] = model.state_dict()["temperature"].to_local().clone()
        results[f"after_step{step}"] = _temperature(model)
    results["trained"] = _temperature(model)
    other = models.ScaledLinear()
    other.temperature.data.fill_(-0.75)
    model.load_state_dict(other.state_dict())
    if dist.get_rank() == 3:
        with _collectives_refused():
            results["alone_after_load"] = model.state_dict()["temperature"].to_local().clone()
    return results


@pytest.mark.parametrize("world_size", [4])
def test_hfsdp_state_dict_on_one_rank_alone_issues_no_collective(world_size):
    results = run_on_ranks(world_size, _hfsdp_state_dicts_on_some_ranks)
    trained = results[0]["trained"]
    assert trained != 1.5
    for rank, rank_result in enumerate(results):
        assert rank_result["wrapped"] == 1.5, rank
        assert torch.equal(rank_result["trained"], trained), rank
    assert torch.equal(results[3]["alone_after_step"], results[3]["after_step0"])
    assert torch.equal(results[2]["alone_after_step"], trained) and not torch.equal(trained, results[3]["after_step0"])
    assert results[3]["alone_after_load"] == -0.75
