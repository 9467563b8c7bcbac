"""The precision-aware optimizer: AdamW arithmetic, state dtypes as requested, bf16 moments within a bound of
fp32, checkpoints that keep dtypes and values, and the flag rules."""

import copy
import types

import pytest
import torch
import torch.distributed as dist

from megatron.core.optimizer import OptimizerConfig, PrecisionAwareAdamW
from tests.unit_tests.multiprocess_harness import run_on_ranks

STEPS = 5
LR = 1e-2


def _params_and_grads(seed=0):
    generator = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(64, 16, generator=generator)),
              torch.nn.Parameter(torch.randn(16, generator=generator))]
    grads = [[torch.randn(p.shape, generator=generator) * (0.1 + step) for p in params] for step in range(STEPS)]
    return params, grads


def _run(optimizer_class, params, grads, **kwargs):
    optimizer = optimizer_class(params, lr=LR, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, **kwargs)
    for step_grads in grads:
        for param, grad in zip(params, step_grads):
            param.grad = grad.clone()
        optimizer.step()
    return optimizer


def test_fp32_state_steps_exactly_like_torch_adamw():
    params, grads = _params_and_grads()
    reference = [torch.nn.Parameter(p.detach().clone()) for p in params]
    ours = _run(PrecisionAwareAdamW, params, grads)
    theirs = _run(torch.optim.AdamW, reference, grads, foreach=False)
    for mine, torch_param in zip(params, reference):
        torch.testing.assert_close(mine, torch_param, rtol=0, atol=0)
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(ours.state[mine][key], theirs.state[torch_param][key], rtol=0, atol=0)


def _largest_allocation_during(fn):
    """Bytes of the largest new storage any operator returns while `fn()` runs (views and in-place results of
    existing storages are not new)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    class LargestAllocation(TorchDispatchMode):
        largest = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            inputs = {leaf.untyped_storage().data_ptr() for leaf in tree_leaves((args, kwargs or {}))
                      if isinstance(leaf, torch.Tensor)}
            out = func(*args, **(kwargs or {}))
            for leaf in tree_leaves(out):
                if isinstance(leaf, torch.Tensor) and leaf.untyped_storage().data_ptr() not in inputs:
                    self.largest = max(self.largest, leaf.untyped_storage().nbytes())
            return out

    with LargestAllocation() as mode:
        fn()
    return mode.largest


@pytest.mark.parametrize("moment_dtype", [torch.float32, torch.bfloat16])
def test_host_step_runs_in_blocks_with_the_same_arithmetic(moment_dtype):
    """A host tensor larger than a block (and not a multiple of it) steps exactly as whole-tensor torch AdamW
    would (fp32 state) or as one block would (bf16 moments), and no temporary exceeds one block in fp32."""
    from megatron.core.optimizer.precision_aware_adam import HOST_BLOCK_NUMEL

    numel = 2 * HOST_BLOCK_NUMEL + 1000
    generator = torch.Generator().manual_seed(0)
    values, grad = torch.randn(numel, generator=generator), torch.randn(numel, generator=generator)
    param = torch.nn.Parameter(values.clone())
    optimizer = PrecisionAwareAdamW([param], lr=LR, weight_decay=0.1, exp_avg_dtype=moment_dtype,
                                    exp_avg_sq_dtype=moment_dtype)
    param.grad = grad
    optimizer.step()  # creates the state (its zero moments are the step's only full-size allocations)
    largest = _largest_allocation_during(optimizer.step)
    assert largest <= 4 * HOST_BLOCK_NUMEL, largest / (4 * numel)
    # The same two steps on each block alone: equal element for element.
    for start in range(0, numel, HOST_BLOCK_NUMEL):
        piece = torch.nn.Parameter(values[start:start + HOST_BLOCK_NUMEL].clone())
        reference = PrecisionAwareAdamW([piece], lr=LR, weight_decay=0.1, exp_avg_dtype=moment_dtype,
                                        exp_avg_sq_dtype=moment_dtype)
        piece.grad = grad[start:start + HOST_BLOCK_NUMEL]
        reference.step()
        reference.step()
        torch.testing.assert_close(param.detach()[start:start + piece.numel()], piece.detach(), rtol=0, atol=0)
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(optimizer.state[param][key][start:start + piece.numel()],
                                       reference.state[piece][key], rtol=0, atol=0)
    if moment_dtype == torch.float32:
        whole = torch.nn.Parameter(values.clone())
        torch_adamw = torch.optim.AdamW([whole], lr=LR, weight_decay=0.1, foreach=False)
        whole.grad = grad
        torch_adamw.step()
        torch_adamw.step()
        torch.testing.assert_close(param, whole, rtol=0, atol=0)


# bf16 keeps 8 significant bits: each step rounds a stored moment by at most 2^-9 of its value, and earlier
# errors are carried on multiplied by beta < 1, so after STEPS steps a moment is within
# STEPS * 2^-9 * max over steps |moment| of fp32's (per element; relative to the running maximum because a
# first moment can cancel to near zero). Measured: about a third of that bound.
# The parameters then differ by the accumulated difference of the updates lr * m_hat / (sqrt(v_hat) + eps);
# that ratio has no useful elementwise bound (v_hat can be tiny where m_hat cancels), so the bound used is an
# empirical one with margin: 2^-6 of the largest possible total movement lr * STEPS (measured: 2^-9).
MOMENT_BOUND = STEPS * 2.0**-9
PARAM_BOUND = 2.0**-6 * LR * STEPS


def test_bf16_moments_stay_within_the_documented_bound_of_fp32():
    params, grads = _params_and_grads()
    fp32_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    kwargs = dict(lr=LR, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    low = PrecisionAwareAdamW(params, exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16, **kwargs)
    full = PrecisionAwareAdamW(fp32_params, **kwargs)
    running_max = {}
    for step_grads in grads:
        for param, fp32_param, grad in zip(params, fp32_params, step_grads):
            param.grad, fp32_param.grad = grad.clone(), grad.clone()
        low.step()
        full.step()
        for index, fp32_param in enumerate(fp32_params):
            for key in ("exp_avg", "exp_avg_sq"):
                value = full.state[fp32_param][key].abs().max().item()
                running_max[index, key] = max(running_max.get((index, key), 0.0), value)
    for index, (param, fp32_param) in enumerate(zip(params, fp32_params)):
        for key in ("exp_avg", "exp_avg_sq"):
            stored, reference = low.state[param][key], full.state[fp32_param][key]
            assert stored.dtype == torch.bfloat16
            error = (stored.float() - reference).abs().max().item()
            assert error <= MOMENT_BOUND * running_max[index, key], (key, error, running_max[index, key])
        drift = (param - fp32_param).abs().max().item()
        assert 0 < drift <= PARAM_BOUND, drift  # bf16 state does change the result, within the bound


def test_fp16_main_params_and_decoupled_bf16_grads():
    param = torch.nn.Parameter(torch.linspace(-1, 1, 32).to(torch.float16))
    reference = torch.nn.Parameter(param.detach().float())
    optimizer = PrecisionAwareAdamW([param], lr=LR, weight_decay=0.0)
    torch_optimizer = torch.optim.AdamW([reference], lr=LR, weight_decay=0.0, foreach=False)
    grad = torch.linspace(0.5, -0.5, 32)
    param.decoupled_grad = grad.to(torch.bfloat16)  # read as given, in its own dtype
    reference.grad = grad.to(torch.bfloat16).float()
    optimizer.step()
    torch_optimizer.step()
    assert param.dtype == torch.float16 and param.grad is None
    # The fp32 result rounded once to fp16 (2^-11 relative).
    torch.testing.assert_close(param.float(), reference.detach(), rtol=2.0**-11, atol=0)


# fp16 moments are stored with a per-tensor power-of-two scale, so they keep fp16's 11 significant bits at any
# gradient scale. Update error against fp32 Adam over 20 steps of N(0, 1e-6) gradients (median of the per-element
# relative error; largest error relative to the largest update), measured: fp16 moments 2.9e-4 / 1.1e-3, fp16
# first and bf16 second moment 9.2e-4 / 4.4e-3, bf16 moments 2.3e-3 / 8.8e-3; unscaled fp16 first moment
# 0.14 / 0.73. Bounds with margin (docs/training_flags.md, Precision):
SMALL_GRAD_BOUNDS = {(torch.float16, torch.float16): (2.0**-10, 2.0**-8),
                     (torch.float16, torch.bfloat16): (2.0**-8, 2.0**-6)}


def _updates_against_fp32(dtypes, steps=20, grad_scale=1e-6, shape=(64, 32)):
    """(per-element relative errors of every step's update, its largest error relative to the largest update, the
    optimizer with `dtypes`) against fp32 Adam, both fed the same gradients."""
    generator = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.zeros(shape)) for _ in range(2)]
    kwargs = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    reference, low = PrecisionAwareAdamW([params[0]], **kwargs), PrecisionAwareAdamW([params[1]], **dtypes, **kwargs)
    relative, largest = [], 0.0
    with torch.no_grad():
        for _ in range(steps):
            grad = torch.randn(shape, generator=generator) * grad_scale
            for param in params:
                param.zero_()  # the update is then the parameter itself, without cancellation
                param.grad = grad.clone()
            reference.step()
            low.step()
            error = (params[1] - params[0]).abs()
            relative.append((error / params[0].abs()).flatten())
            largest = max(largest, (error.max() / params[0].abs().max()).item())
    return torch.cat(relative), largest, low


@pytest.mark.parametrize("dtypes", list(SMALL_GRAD_BOUNDS), ids=["fp16_fp16", "fp16_bf16"])
def test_fp16_moments_track_fp32_adam_with_small_gradients(dtypes):
    relative, largest, optimizer = _updates_against_fp32(dict(exp_avg_dtype=dtypes[0], exp_avg_sq_dtype=dtypes[1]))
    median_bound, largest_bound = SMALL_GRAD_BOUNDS[dtypes]
    assert 0 < relative.nanmedian().item() <= median_bound, relative.nanmedian().item()
    assert largest <= largest_bound, largest
    state = next(iter(optimizer.state.values()))
    assert (state["exp_avg"].dtype, state["exp_avg_sq"].dtype) == dtypes
    # The stored first moment uses fp16's range: its largest value lies in (2^14, 2^15] once scaled.
    assert 2.0**14 < state["exp_avg"].float().abs().max().item() <= 2.0**15
    scale = state["exp_avg_scale"]
    assert scale.dtype == torch.float32 and torch.frexp(scale).mantissa.item() == 0.5  # a power of two


def test_fp16_moment_scales_are_exact_powers_of_two():
    from megatron.core.optimizer.precision_aware_adam import moment_scale

    assert moment_scale(torch.tensor(2.0**15)).item() == 1.0
    assert moment_scale(torch.tensor(2.0**15 + 1)).item() == 2.0
    assert moment_scale(torch.tensor(3e-10)).item() == 2.0**-46  # 3e-10 / 2^-46 = 21110.7 in (2^14, 2^15]
    assert moment_scale(torch.tensor(1e-10)).item() == 2.0**-48  # 28147.5
    for amax in (0.0, float("inf"), float("nan")):
        assert moment_scale(torch.tensor(amax)).item() == 1.0


def test_fp16_host_step_in_blocks_equals_the_whole_tensor_step(monkeypatch):
    """The scale of a blocked host step comes from the whole tensor's new moments: the same as one pass, with
    temporaries of one block (in fp32) at most."""
    from megatron.core.optimizer import precision_aware_adam

    generator = torch.Generator().manual_seed(0)
    values, grads = torch.randn(2500, generator=generator), torch.randn(2, 2500, generator=generator) * 1e-5
    results = []
    for block in (1000, 1 << 20):
        monkeypatch.setattr(precision_aware_adam, "HOST_BLOCK_NUMEL", block)
        param = torch.nn.Parameter(values.clone())
        optimizer = PrecisionAwareAdamW([param], lr=LR, exp_avg_dtype=torch.float16, exp_avg_sq_dtype=torch.float16)
        for grad in grads:
            param.grad = grad.clone()
            largest = _largest_allocation_during(optimizer.step)
        assert block > 2500 or largest <= 4 * block, largest
        results.append((param.detach(), optimizer.state[param]))
    (blocked, blocked_state), (whole, whole_state) = results
    assert torch.equal(blocked, whole)
    for key in ("exp_avg", "exp_avg_scale", "exp_avg_sq", "exp_avg_sq_scale"):
        assert torch.equal(blocked_state[key], whole_state[key]), key


@pytest.mark.parametrize("block", [1000, 1 << 20], ids=["blocked", "whole"])
def test_fp16_step_computes_exactly_from_the_stored_values(monkeypatch, block):
    """A step from scaled fp16 moments (scales far from 1) is an fp32 step from their values (stored * scale):
    the same parameter bit for bit, and the new moments are the fp32 step's, stored with their own scale."""
    from megatron.core.optimizer import precision_aware_adam
    from megatron.core.optimizer.precision_aware_adam import store_moment

    monkeypatch.setattr(precision_aware_adam, "HOST_BLOCK_NUMEL", block)
    generator = torch.Generator().manual_seed(3)
    values, grads = torch.randn(2500, generator=generator), torch.randn(3, 2500, generator=generator) * 1e-7
    param, reference_param = torch.nn.Parameter(values.clone()), torch.nn.Parameter(values.clone())
    kwargs = dict(lr=LR, betas=(0.9, 0.95), weight_decay=0.1)
    optimizer = PrecisionAwareAdamW([param], exp_avg_dtype=torch.float16, exp_avg_sq_dtype=torch.float16, **kwargs)
    for grad in grads[:2]:
        param.grad = grad.clone()
        optimizer.step()
    state = optimizer.state[param]
    assert state["exp_avg_sq_scale"].item() < 2.0**-40 and state["exp_avg_scale"].item() < 2.0**-20
    reference_param.data.copy_(param.detach())
    reference = PrecisionAwareAdamW([reference_param], **kwargs)
    reference.load_state_dict({"state": {0: {"step": state["step"].clone(),
                                             **{key: optimizer.get_unscaled_state(param, key).clone()
                                                for key in ("exp_avg", "exp_avg_sq")}}},
                               "param_groups": optimizer.state_dict()["param_groups"]})
    param.grad, reference_param.grad = grads[2].clone(), grads[2].clone()
    optimizer.step()
    reference.step()
    assert torch.equal(param, reference_param)
    for key in ("exp_avg", "exp_avg_sq"):
        expected = {}
        store_moment(expected, key, reference.state[reference_param][key], torch.float16)
        assert torch.equal(state[key], expected[key]) and torch.equal(state[f"{key}_scale"], expected[f"{key}_scale"])


def _fp16_run(steps=3):
    generator = torch.Generator().manual_seed(1)
    params = [torch.nn.Parameter(torch.randn(32, 8, generator=generator)), torch.nn.Parameter(torch.randn(8))]
    grads = [[torch.randn(p.shape, generator=generator) * 1e-6 for p in params] for _ in range(steps + 2)]
    optimizer = PrecisionAwareAdamW(params, lr=LR, exp_avg_dtype=torch.float16, exp_avg_sq_dtype=torch.float16)
    for step_grads in grads[:steps]:
        for param, grad in zip(params, step_grads):
            param.grad = grad.clone()
        optimizer.step()
    return optimizer, params, grads[steps:]


def _continue(optimizer, params, grads):
    for step_grads in grads:
        for param, grad in zip(params, step_grads):
            param.grad = grad.clone()
        optimizer.step()
    return [param.detach().clone() for param in params]


def test_fp16_state_dict_round_trips_exactly_with_its_scales():
    optimizer, params, later = _fp16_run()
    saved = copy.deepcopy(optimizer.state_dict())
    assert set(saved["state"][0]) == {"step", "exp_avg", "exp_avg_scale", "exp_avg_sq", "exp_avg_sq_scale"}
    clones = [torch.nn.Parameter(p.detach().clone()) for p in params]
    fresh = PrecisionAwareAdamW(clones, lr=LR, exp_avg_dtype=torch.float16, exp_avg_sq_dtype=torch.float16)
    fresh.load_state_dict(saved)
    for index, param in enumerate(clones):
        for key, value in saved["state"][index].items():
            assert fresh.state[param][key].dtype == value.dtype and torch.equal(fresh.state[param][key], value), key
    assert all(torch.equal(a, b) for a, b in zip(_continue(optimizer, params, later), _continue(fresh, clones, later)))


def test_fp16_moment_values_round_trip_exactly_through_set_scaled_state():
    """What logical (dist_checkpointing) checkpoints hold: each moment's value in fp32. Storing it again keeps the
    moment exactly, so training continues bit for bit."""
    optimizer, params, later = _fp16_run()
    clones = [torch.nn.Parameter(p.detach().clone()) for p in params]
    fresh = PrecisionAwareAdamW(clones, lr=LR, exp_avg_dtype=torch.float16, exp_avg_sq_dtype=torch.float16)
    for param, clone in zip(params, clones):
        for key in ("exp_avg", "exp_avg_sq"):
            value = optimizer.get_unscaled_state(param, key)
            assert value.dtype == torch.float32 and value.abs().max() < 1e-5
            fresh.set_scaled_state(clone, key, value.clone())
            assert fresh.state[clone][key].dtype == torch.float16
            assert torch.equal(fresh.get_unscaled_state(clone, key), value), key
        fresh.state[clone]["step"] = optimizer.state[param]["step"].clone()
    assert all(torch.equal(a, b) for a, b in zip(_continue(optimizer, params, later), _continue(fresh, clones, later)))


def test_unscaled_fp16_state_of_earlier_versions_loads_with_scale_1():
    """A state dict with fp16 moments and no scales (saved unscaled) loads as it was: its values, scale 1, and the
    next step computes from exactly those values (as an fp32-state optimizer given the same values)."""
    param = torch.nn.Parameter(torch.linspace(-1, 1, 16))
    old_moments = {"exp_avg": torch.linspace(-1e-3, 1e-3, 16).half(),
                   "exp_avg_sq": torch.linspace(1e-4, 1e-3, 16).half()}
    old_format = {"state": {0: {"step": torch.tensor(3.0), **old_moments}},
                  "param_groups": [{"lr": LR, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0, "params": [0]}]}
    optimizer = PrecisionAwareAdamW([param], exp_avg_dtype=torch.float16, exp_avg_sq_dtype=torch.float16)
    optimizer.load_state_dict(copy.deepcopy(old_format))
    for key, value in old_moments.items():
        assert optimizer.state[param][f"{key}_scale"].item() == 1.0
        assert torch.equal(optimizer.get_unscaled_state(param, key), value.float())
    reference_param = torch.nn.Parameter(param.detach().clone())
    reference = PrecisionAwareAdamW([reference_param])
    reference.load_state_dict({**old_format, "state": {0: {"step": torch.tensor(3.0),
                                                           **{k: v.float() for k, v in old_moments.items()}}}})
    grad = torch.linspace(1e-3, -1e-3, 16)
    param.grad, reference_param.grad = grad.clone(), grad.clone()
    optimizer.step()
    reference.step()
    assert torch.equal(param, reference_param)
    for key in old_moments:
        assert optimizer.state[param][key].dtype == torch.float16
        torch.testing.assert_close(optimizer.get_unscaled_state(param, key), reference.state[reference_param][key],
                                   rtol=2.0**-11, atol=0)


def test_a_moment_written_by_a_loader_in_fp32_is_stored_scaled_again():
    """Loaders that write moments' values into the state (dist_checkpointing's, in fp32) replace a stored moment
    and leave its old scale: the next step stores the value with a scale of its own."""
    optimizer, params, _ = _fp16_run()
    state = optimizer.state[params[0]]
    value = optimizer.get_unscaled_state(params[0], "exp_avg").clone()
    state["exp_avg"] = value * 4  # a loader's write; the scale kept is the old one
    assert torch.equal(optimizer.get_unscaled_state(params[0], "exp_avg"), value * 4)
    assert state["exp_avg"].dtype == torch.float16 and state["exp_avg_scale"].item() > 0


def test_load_state_dict_keeps_the_stored_dtypes():
    params, grads = _params_and_grads()
    optimizer = _run(PrecisionAwareAdamW, params, grads, exp_avg_dtype=torch.float16, exp_avg_sq_dtype=torch.bfloat16)
    saved = copy.deepcopy(optimizer.state_dict())
    assert saved["state"][0]["exp_avg"].dtype == torch.float16
    assert saved["state"][0]["exp_avg_sq"].dtype == torch.bfloat16
    fresh = PrecisionAwareAdamW([torch.nn.Parameter(p.detach().clone()) for p in params], lr=LR,
                                exp_avg_dtype=torch.float16, exp_avg_sq_dtype=torch.bfloat16)
    fresh.load_state_dict(saved)
    for index, param in enumerate(fresh.param_groups[0]["params"]):
        for key in ("exp_avg", "exp_avg_sq"):
            assert fresh.state[param][key].dtype == saved["state"][index][key].dtype
            assert torch.equal(fresh.state[param][key], saved["state"][index][key])


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(exp_avg_dtype=torch.bfloat16, use_distributed_optimizer=True), r"--exp-avg-dtype\) needs "
         r"use_precision_aware_optimizer"),
        (dict(use_precision_aware_optimizer=True),
         r"needs the distributed optimizer: pass --use-distributed-optimizer"),
        (dict(use_precision_aware_optimizer=True, use_distributed_optimizer=True, optimizer="sgd"), r"Adam only"),
        (dict(use_precision_aware_optimizer=True, use_distributed_optimizer=True, main_params_dtype=torch.bfloat16),
         r"--main-params-dtype\): choose one of"),
    ],
)
def test_config_rules_name_the_flags(kwargs, message):
    with pytest.raises(ValueError, match=message):
        OptimizerConfig(lr=1e-3, **kwargs)


@pytest.mark.parametrize(
    "extra, message",
    [
        ("--exp-avg-dtype bf16", r"--exp-avg-dtype needs --use-precision-aware-optimizer"),
        ("--use-precision-aware-optimizer", r"needs the distributed optimizer: pass --use-distributed-optimizer"),
        ("--use-precision-aware-optimizer --use-distributed-optimizer --exp-avg-dtype fp8",
         r"fp8 needs Transformer Engine"),
        ("--use-precision-aware-optimizer --use-distributed-optimizer --main-grads-dtype bf16",
         r"--main-grads-dtype bf16 needs --bf16"),
        ("--use-precision-aware-optimizer --use-megatron-fsdp --main-params-dtype fp16",
         r"with --use-megatron-fsdp use --megatron-fsdp-main-params-dtype"),
    ],
)
def test_flag_rules_name_the_flags(monkeypatch, extra, message):
    from tests.unit_tests.training.test_arguments import validated

    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(ValueError, match=message):
        validated(extra)


def test_flags_reach_the_optimizer_config(monkeypatch):
    from megatron.training.model_config import ddp_config_from_args, optimizer_config_from_args
    from tests.unit_tests.training.test_arguments import validated

    monkeypatch.setenv("WORLD_SIZE", "1")
    args = validated("--bf16 --use-distributed-optimizer --use-precision-aware-optimizer --main-grads-dtype bf16 "
                     "--exp-avg-dtype fp16 --exp-avg-sq-dtype bf16 --main-params-dtype fp16")
    config = optimizer_config_from_args(args)
    assert (config.main_params_dtype, config.main_grads_dtype, config.exp_avg_dtype, config.exp_avg_sq_dtype) == (
        torch.float16, torch.bfloat16, torch.float16, torch.bfloat16)
    assert not ddp_config_from_args(args).grad_reduce_in_fp32  # bf16 gradient buffers


def _distributed(precision_aware, dtypes, model_dtype=torch.float32):
    """Train a toy model 3 steps on DP2 with the distributed optimizer; return losses, state dtypes, and the
    round trips of both checkpoint forms."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import get_megatron_optimizer

    def build():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4)).to(model_dtype)
        ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=True,
                                                   grad_reduce_in_fp32=dtypes.get("main_grads_dtype") != torch.bfloat16)
        ddp = DistributedDataParallel(types.SimpleNamespace(), ddp_config, model)
        config = OptimizerConfig(lr=LR, use_distributed_optimizer=True, bf16=model_dtype == torch.bfloat16,
                                 use_precision_aware_optimizer=precision_aware, **dtypes)
        return ddp, get_megatron_optimizer(config, [ddp])

    def train(ddp, optimizer, steps):
        losses = []
        for step in range(steps):
            generator = torch.Generator().manual_seed(10 * step + dist.get_rank())
            inputs = torch.randn(8, 16, generator=generator).to(model_dtype)
            ddp.zero_grad_buffer()
            optimizer.zero_grad()
            loss = ddp(inputs).float().square().mean()
            loss.backward()
            ddp.finish_grad_sync()
            assert optimizer.step()[0]
            losses.append(loss.item())
        return losses

    ddp, optimizer = build()
    losses = train(ddp, optimizer, 3)
    states = [optimizer.optimizer.state[p] for p in optimizer.main_params()]
    result = {"losses": losses, "main_dtypes": {p.dtype for p in optimizer.main_params()},
              "state_dtypes": {key: {state[key].dtype for state in states} for key in ("exp_avg", "exp_avg_sq")}}
    local, gathered = copy.deepcopy(optimizer.state_dict()), optimizer.gathered_state_dict()
    expected_states = [{k: v.clone() for k, v in state.items()} for state in states]
    expected_values = [{key: optimizer.optimizer.get_unscaled_state(p, key).clone()
                        for key in ("exp_avg", "exp_avg_sq")}
                       for p in optimizer.main_params()] if precision_aware else None
    expected_main = [p.detach().clone() for p in optimizer.main_params()]
    for form, checkpoint in (("local", local), ("gathered", gathered)):
        ddp2, optimizer2 = build()
        if form == "local":
            optimizer2.load_state_dict(checkpoint)
        else:
            optimizer2.load_gathered_state_dict(checkpoint)
        restored = [optimizer2.optimizer.state[p] for p in optimizer2.main_params()]
        # The local form restores the state as stored (fp16 moments' scales too); the gathered one, which holds
        # values, the moments' values in their dtypes.
        keys = [key for key in expected_states[0] if key != "step"] if form == "local" else ["exp_avg", "exp_avg_sq"]
        result[form] = all(
            restored_state[key].dtype == expected[key].dtype and torch.equal(restored_state[key], expected[key])
            for restored_state, expected in zip(restored, expected_states) for key in keys
            if form == "local" or not precision_aware
        ) and all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(optimizer2.main_params(), expected_main))
        if precision_aware:
            result[form] = result[form] and all(
                restored_state[key].dtype == expected_states[index][key].dtype
                and torch.equal(optimizer2.optimizer.get_unscaled_state(p, key), expected_values[index][key])
                for index, (p, restored_state) in enumerate(zip(optimizer2.main_params(), restored))
                for key in ("exp_avg", "exp_avg_sq"))
    return result


def test_distributed_optimizer_with_precision_aware_state():
    plain = run_on_ranks(2, _distributed, False, {})
    fp32 = run_on_ranks(2, _distributed, True, {})
    low = run_on_ranks(2, _distributed, True, dict(exp_avg_dtype=torch.float16, exp_avg_sq_dtype=torch.bfloat16,
                                                   main_params_dtype=torch.float16))
    fp16_moments = run_on_ranks(2, _distributed, True, dict(exp_avg_dtype=torch.float16,
                                                            exp_avg_sq_dtype=torch.float16))
    bf16_grads = run_on_ranks(2, _distributed, True,
                              dict(main_grads_dtype=torch.bfloat16, exp_avg_dtype=torch.bfloat16), torch.bfloat16)
    for rank in range(2):
        # All-fp32 precision-aware state trains as the plain distributed optimizer does (same AdamW arithmetic
        # up to torch's foreach kernels' rounding).
        assert fp32[rank]["losses"] == pytest.approx(plain[rank]["losses"], rel=1e-6, abs=0)
        assert low[rank]["main_dtypes"] == {torch.float16}
        assert low[rank]["state_dtypes"] == {"exp_avg": {torch.float16}, "exp_avg_sq": {torch.bfloat16}}
        assert bf16_grads[rank]["state_dtypes"]["exp_avg"] == {torch.bfloat16}
        assert fp16_moments[rank]["state_dtypes"] == {"exp_avg": {torch.float16}, "exp_avg_sq": {torch.float16}}
        for result in (fp32[rank], low[rank], bf16_grads[rank], fp16_moments[rank]):
            assert result["local"] and result["gathered"]


def _megatron_fsdp_moments(strategy):
    from megatron.core.distributed import DistributedDataParallelConfig, wrap_data_parallel
    from megatron.core.optimizer import get_megatron_optimizer
    from tests.unit_tests.distributed.precision_gpt import build_gpt, gpt_batch, gpt_loss

    losses = {}
    for precision_aware in (False, True):
        model = build_gpt()
        ddp_config = DistributedDataParallelConfig(use_megatron_fsdp=True, use_distributed_optimizer=True,
                                                   data_parallel_sharding_strategy=strategy)
        chunk = wrap_data_parallel(model.config, ddp_config, model)
        dtypes = dict(exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16) if precision_aware else {}
        optimizer = get_megatron_optimizer(OptimizerConfig(lr=LR, use_distributed_optimizer=True,
                                                           use_precision_aware_optimizer=precision_aware, **dtypes),
                                           [chunk])
        losses[precision_aware] = []
        for step in range(3):
            chunk.zero_grad_buffer()
            optimizer.zero_grad()
            loss = gpt_loss(chunk, gpt_batch(step))
            loss.backward()
            chunk.finish_grad_sync()
            assert optimizer.step()[0]
            losses[precision_aware].append(loss.item())
    states = [state for state in optimizer.optimizer.state.values() if "exp_avg" in state]
    return {"dtypes": {state[key].dtype for state in states for key in ("exp_avg", "exp_avg_sq")},
            "losses": losses}


@pytest.mark.parametrize("strategy", ["optim", "optim_grads_params"])
def test_megatron_fsdp_keeps_bf16_moments(strategy):
    for result in run_on_ranks(2, _megatron_fsdp_moments, strategy):
        assert result["dtypes"] == {torch.bfloat16}
        # The first step's loss precedes any update; later ones move by bf16 rounding of the moments only.
        assert result["losses"][True][0] == result["losses"][False][0]
        assert result["losses"][True] == pytest.approx(result["losses"][False], rel=1e-3)


def _megatron_fsdp_torch_dist_resume(strategy, directory):
    """Megatron-FSDP with bf16 / fp16 precision-aware moments, with and without optimizer CPU offload: train one
    step, save torch_dist, train two more; then a fresh run of the other offload setting loads the checkpoint
    (through the load targets the training loop uses) and trains the same two steps."""
    from megatron.core.dist_checkpointing import serialization, wrappers
    from megatron.core.distributed import DistributedDataParallelConfig, wrap_data_parallel
    from megatron.core.optimizer import get_megatron_optimizer
    from tests.unit_tests.distributed.precision_gpt import build_gpt
    from tests.unit_tests.optimizer.test_cpu_offload import _train

    dtypes = dict(exp_avg_dtype=torch.float16, exp_avg_sq_dtype=torch.bfloat16)
    offload = dict(optimizer_cpu_offload=True, optimizer_offload_fraction=0.5)

    def build(settings):
        model = build_gpt(num_layers=1)
        ddp_config = DistributedDataParallelConfig(use_megatron_fsdp=True, use_distributed_optimizer=True,
                                                   data_parallel_sharding_strategy=strategy)
        chunk = wrap_data_parallel(model.config, ddp_config, model)
        config = OptimizerConfig(lr=LR, use_distributed_optimizer=True, use_precision_aware_optimizer=True,
                                 **dtypes, **settings)
        return chunk, get_megatron_optimizer(config, [chunk])

    def moments(optimizer):
        """(step, exp_avg, exp_avg_sq) of each main weight: the stored tensors, with their values (fp16 ones
        are stored scaled)."""
        torch_optimizer = optimizer.optimizer
        result = []
        for view in optimizer.main_params():
            state = torch_optimizer.state[view]
            result.append((float(state["step"]), state["exp_avg"].clone(), state["exp_avg_sq"].clone(),
                           torch_optimizer.get_unscaled_state(view, "exp_avg").clone(),
                           torch_optimizer.get_unscaled_state(view, "exp_avg_sq").clone()) if state else None)
        return result

    result = {}
    for saved_with, loaded_with in (("none", "offload"), ("offload", "none")):
        path = f"{directory}/{saved_with}"
        chunk, optimizer = build(offload if saved_with == "offload" else {})
        _train(chunk, optimizer, range(1))
        state = wrappers.model_state([chunk], for_saving=True)
        state.update(wrappers.optimizer_state_to_save(optimizer, [chunk]))
        serialization.save(state, path)
        saved_moments = moments(optimizer)
        uninterrupted = _train(chunk, optimizer, range(1, 3))[0]

        chunk, optimizer = build(offload if loaded_with == "offload" else {})
        metadata = serialization.read_metadata(path)
        saved_keys = list(metadata.state_dict_metadata)
        model_targets, finish_model = wrappers.model_load_targets([chunk])
        serialization.load(model_targets, path, metadata=metadata)
        finish_model(set(model_targets))
        optimizer.reload_model_params()
        targets, install = wrappers.optimizer_load_targets(optimizer, [chunk], saved_keys)
        targets.update({key: None for key in ("optimizer.step", "optimizer.param_groups") if key in saved_keys})
        serialization.load(targets, path, metadata=metadata)
        install(targets)
        loaded_moments = moments(optimizer)
        result[saved_with] = {
            "saved_dtypes": {key.rsplit(".", 1)[-1]: metadata.state_dict_metadata[key].properties.dtype
                             for key in saved_keys if key.endswith((".exp_avg", ".exp_avg_sq"))},
            "loaded_dtypes": {(m.dtype, v.dtype) for _, m, v, _, _ in loaded_moments},
            # Values as saved, in the dtypes they are kept in from the load on.
            "state_restored": len(loaded_moments) == len(saved_moments) and all(
                loaded is not None and loaded[0] == saved[0] and torch.equal(loaded[3].cpu(), saved[3].cpu())
                and torch.equal(loaded[4].cpu(), saved[4].cpu())
                for loaded, saved in zip(loaded_moments, saved_moments)),
            "uninterrupted": uninterrupted,
            "resumed": _train(chunk, optimizer, range(1, 3))[0],
            "resumed_dtypes": {(m.dtype, v.dtype) for _, m, v, _, _ in moments(optimizer)},
        }
    return result


@pytest.mark.parametrize("strategy", ["optim", "optim_grads_params"])
def test_megatron_fsdp_torch_dist_checkpoint_restores_precision_aware_state(tmp_path, strategy):
    for result in run_on_ranks(2, _megatron_fsdp_torch_dist_resume, strategy, str(tmp_path)):
        for saved_with, run in result.items():
            # The fp16 moment's value (stored scaled) in fp32, as upstream saves TE's scaled state.
            assert run["saved_dtypes"] == {"exp_avg": torch.float32, "exp_avg_sq": torch.bfloat16}, saved_with
            assert run["loaded_dtypes"] == {(torch.float16, torch.bfloat16)}, saved_with
            assert run["resumed_dtypes"] == {(torch.float16, torch.bfloat16)}, saved_with
            assert run["state_restored"], saved_with
            assert run["resumed"] == pytest.approx(run["uninterrupted"], rel=1e-6, abs=0), saved_with
