"""The level-1 timers of `optimizer.step()`'s phases, under upstream's names: each optimizer (fp32, bf16 and fp16
main copies, the distributed optimizer, Megatron-FSDP) times the phases it has, in step order, with a barrier at
start when `barrier_with_L1_time` asks for one; `--timing-log-level 0` records none, and timing changes no number."""

import copy

import pytest
import torch

from megatron.core import timers as timers_module
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.timers import Timers
from tests.unit_tests.multiprocess_harness import run_on_ranks
from tests.unit_tests.optimizer.toy_models import build_toy_model, mse_loss, toy_batch

COPY_TO_MAIN = "optimizer-copy-to-main-grad"
UNSCALE = "optimizer-unscale-and-check-inf"
CLIP = "optimizer-clip-main-grad"
COUNT_ZEROS = "optimizer-count-zeros"
INNER_STEP = "optimizer-inner-step"
COPY_TO_MODEL = "optimizer-copy-main-to-model-params"


class OrderedTimers(Timers):
    """Timers that also note, in order, each timer asked for and its level."""

    def __init__(self, log_level):
        super().__init__(log_level, "minmax")
        self.asked = []

    def __call__(self, name, log_level=None):
        self.asked.append((name, log_level))
        return super().__call__(name, log_level)

    def active_seconds(self):
        """{name: seconds} of every recorded timer."""
        return {name: self._timers[name].active_time() for name in self.names()}


def _steps(model, config, steps=2, batch=8, rank_slice=None, finalize=None):
    """Trains `model` for `steps`; returns the optimizer and each step's (update_successful, grad_norm, zeros)."""
    optimizer = get_megatron_optimizer(config, [model])
    results = []
    for step in range(steps):
        if hasattr(model, "zero_grad_buffer"):
            model.zero_grad_buffer()
        optimizer.zero_grad()
        inputs, targets = toy_batch(step, batch, dtype=next(model.parameters()).dtype)
        if rank_slice is not None:
            inputs, targets = inputs[rank_slice], targets[rank_slice]
        loss = mse_loss(model, inputs, targets)
        optimizer.scale_loss(loss).backward()
        if finalize is not None:
            finalize([model])
        results.append(optimizer.step())
    return optimizer, results


CASES = {
    # name: (model dtype, OptimizerConfig arguments, the phases of one step in order)
    "fp32": (torch.float32, dict(log_num_zeros_in_grad=True), [COPY_TO_MAIN, CLIP, COUNT_ZEROS, INNER_STEP]),
    "bf16": (torch.bfloat16, dict(bf16=True), [COPY_TO_MAIN, CLIP, INNER_STEP, COPY_TO_MODEL]),
    "fp16": (torch.float16, dict(fp16=True, loss_scale=128.0, log_num_zeros_in_grad=True),
             [COPY_TO_MAIN, UNSCALE, CLIP, COUNT_ZEROS, INNER_STEP, COPY_TO_MODEL]),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_step_times_its_phases_at_level_1_only(case, monkeypatch):
    dtype, arguments, phases = CASES[case]
    barriers = []
    monkeypatch.setattr(timers_module, "_barrier", lambda group: barriers.append(group))
    untimed_model = build_toy_model(dtype=dtype)
    runs = {}
    for level in (0, 1):
        model, timers = copy.deepcopy(untimed_model), OrderedTimers(level)
        config = OptimizerConfig(lr=0.01, clip_grad=0.05, barrier_with_L1_time=True, timers=timers, **arguments)
        runs[level] = model, timers, _steps(model, config)[1]
    _, untimed_results = _steps(untimed_model, OptimizerConfig(lr=0.01, clip_grad=0.05, **arguments))

    assert runs[1][1].asked == [(name, 1) for name in phases] * 2  # two steps, phases in step order
    assert sorted(runs[1][1].names()) == sorted(phases)
    assert all(seconds > 0.0 for seconds in runs[1][1].active_seconds().values())
    assert runs[0][1].names() == []  # level 0: every phase asked for, none recorded
    assert len(barriers) == 2 * len(phases)  # one barrier as each phase starts, at level 1 only
    for model, _, results in runs.values():
        assert results == untimed_results
        for param, expected in zip(model.parameters(), untimed_model.parameters(), strict=True):
            assert torch.equal(param, expected)


def test_overflowing_fp16_step_times_only_the_phases_it_runs():
    timers = OrderedTimers(1)
    model = build_toy_model(dtype=torch.float16)
    config = OptimizerConfig(lr=0.01, fp16=True, loss_scale=128.0, timers=timers)
    optimizer = get_megatron_optimizer(config, [model])
    mse_loss(model, *toy_batch(0, 8, dtype=torch.float16)).backward()
    model[0].weight.grad[0, 0] = float("inf")
    assert optimizer.step() == (False, None, None)
    assert timers.asked == [(COPY_TO_MAIN, 1), (UNSCALE, 1)]


def test_barrier_with_L1_time_off_passes_no_barrier(monkeypatch):
    barriers = []
    monkeypatch.setattr(timers_module, "_barrier", lambda group: barriers.append(group))
    timers = OrderedTimers(1)
    _steps(build_toy_model(), OptimizerConfig(lr=0.01, timers=timers), steps=1)
    assert sorted(timers.names()) == sorted([COPY_TO_MAIN, CLIP, INNER_STEP]) and barriers == []


def _sharded_optimizer_phases(wrapper):
    """Over two ranks: the phases a distributed-optimizer or Megatron-FSDP (ZeRO-3) step times at level 1, and
    whether the trained weights equal those of the same run without timers."""
    import torch.distributed as dist

    from megatron.core.distributed import DistributedDataParallelConfig, finalize_model_grads, wrap_data_parallel
    from megatron.core.model_parallel_config import ModelParallelConfig

    if wrapper == "ddp":
        ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=True, bucket_size=40)
    else:
        ddp_config = DistributedDataParallelConfig(use_megatron_fsdp=True, use_distributed_optimizer=True,
                                                   data_parallel_sharding_strategy="optim_grads_params")
    rank = dist.get_rank()
    runs = []
    for timers in (OrderedTimers(1), None):
        # bf16 compute weights: the fp32 main weights are copies, which the step must write back.
        model_config = ModelParallelConfig(bf16=True, params_dtype=torch.bfloat16)
        model = wrap_data_parallel(model_config, ddp_config, build_toy_model(dtype=torch.bfloat16))
        config = OptimizerConfig(lr=0.01, clip_grad=0.05, bf16=True, use_distributed_optimizer=True,
                                 log_num_zeros_in_grad=True, barrier_with_L1_time=True, timers=timers)
        _, results = _steps(model, config, batch=4, rank_slice=slice(2 * rank, 2 * rank + 2),
                            finalize=finalize_model_grads)
        if wrapper == "ddp":
            model.finish_param_sync()
            weights = [param.detach().clone() for param in model.module.parameters()]
        else:
            with model.gathered_parameters() as module:
                weights = [param.detach().clone() for param in module.parameters()]
        runs.append((timers, results, weights))
    (timers, timed_results, timed_weights), (_, untimed_results, untimed_weights) = runs
    return {
        "asked": timers.asked,
        "active": timers.active_seconds(),
        "equal": timed_results == untimed_results and all(
            torch.equal(a, b) for a, b in zip(timed_weights, untimed_weights, strict=True)),
        "changed": all(not torch.equal(a, b) for a, b in zip(
            timed_weights, build_toy_model(dtype=torch.bfloat16).parameters(), strict=True)),
    }


@pytest.mark.parametrize("world_size", [2])
@pytest.mark.parametrize("wrapper", ["ddp", "megatron_fsdp"])
def test_sharded_optimizers_time_their_phases(world_size, wrapper):
    phases = [COPY_TO_MAIN, CLIP, COUNT_ZEROS, INNER_STEP, COPY_TO_MODEL]
    for rank_result in run_on_ranks(world_size, _sharded_optimizer_phases, wrapper):
        assert rank_result["asked"] == [(name, 1) for name in phases] * 2
        assert sorted(rank_result["active"]) == sorted(phases)
        assert all(seconds > 0.0 for seconds in rank_result["active"].values())
        assert rank_result["equal"] and rank_result["changed"]
