"""Calls a torch FSDP2 user makes on a wrapped model, and FSDP2's mixed precision.

* `set_requires_gradient_sync(False)` for all but the last microbatch accumulates like `no_sync()`.
* `set_reshard_after_forward/backward`, `reshard()`: accepted where they ask for what the sharding strategy does,
  refused otherwise naming `zero_dp_strategy`; `unshard()` is refused naming `gathered_parameters()`.
* `model.to(<same device>)` is a no-op; `model.to(torch.bfloat16)` (which would cast parameters out of the
  sharded buffers) is refused.
* `model.apply(init_fn)` after wrapping sets the weights the optimizer steps from, fp32 main weights of a bf16
  model included (before, a bf16 model's step reverted them to the weights of wrap time).
* bf16 compute with fp32 main weights and fp32 reduction (the model built in bf16, `MixedPrecisionPolicy(
  main_params_dtype=fp32)`, fp32 weights loaded after wrapping) trains exactly as FSDP2's
  `MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)` from the same fp32 weights.
"""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.unit_tests.multiprocess_harness import run_on_ranks

WIDTH, STEPS, LR = 16, 3, 1e-2


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.fc1, self.fc2 = nn.LayerNorm(WIDTH), nn.Linear(WIDTH, 4 * WIDTH), nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


def _build():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, WIDTH), Block(), Block(), nn.Linear(WIDTH, 1))


def _batches(count):
    generator = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 8, generator=generator), torch.randn(8, 1, generator=generator)) for _ in range(count)]


def _local(tensor):
    import torch.distributed as dist

    return tensor.chunk(dist.get_world_size())[dist.get_rank()]


def _mean_over_ranks(value):
    import torch.distributed as dist

    value = torch.tensor(float(value), dtype=torch.float64)
    dist.all_reduce(value)
    return value.item() / dist.get_world_size()


def _wrap(module, strategy, **kwargs):
    import megatron_fsdp

    optimizer = torch.optim.AdamW(module.parameters(), lr=LR)
    return megatron_fsdp.fully_shard(module, optimizer, fsdp_unit_modules=[Block], zero_dp_strategy=strategy,
                                     **kwargs)


def _full_weights(model):
    return {name: value.full_tensor().float() for name, value in model.state_dict().items()}


def _accumulate(strategy, use_fsdp2_switch):
    """One step over two microbatches; returns the updated weights."""
    model, optimizer = _wrap(_build(), strategy)
    (inputs, target), = _batches(1)
    optimizer.zero_grad()
    for index, (micro_inputs, micro_target) in enumerate(zip(_local(inputs).chunk(2), _local(target).chunk(2))):
        last = index == 1
        if use_fsdp2_switch:
            model.set_requires_gradient_sync(last)
            F.mse_loss(model(micro_inputs), micro_target).backward()
        else:
            with (model.sync() if last else model.no_sync()):
                F.mse_loss(model(micro_inputs), micro_target).backward()
    optimizer.step()
    return _full_weights(model)


def _errors(strategy):
    model, _ = _wrap(_build(), strategy)
    messages = {}
    calls = {"reshard_after_forward": lambda: model.set_reshard_after_forward(strategy != 3),
             "reshard_after_backward": lambda: model.set_reshard_after_backward(strategy != 3),
             "unshard": model.unshard, "to_bf16": lambda: model.to(torch.bfloat16)}
    if strategy != 3:
        calls["reshard"] = model.reshard
    for name, call in calls.items():
        try:
            call()
            messages[name] = None
        except (ValueError, RuntimeError) as error:
            messages[name] = str(error)
    # what the strategy does anyway is accepted
    model.set_reshard_after_forward(strategy == 3)
    model.set_reshard_after_backward(strategy == 3)
    if strategy == 3:
        model.reshard()
    messages["same_device_is_noop"] = model.to("cpu") is model
    return messages


def _apply_after_wrap(strategy):
    """`model.apply` halves the weights of a bf16 model with fp32 main weights; one lr=0 step keeps them."""
    def halve(module):
        if isinstance(module, nn.Linear):
            with torch.no_grad():
                module.weight.mul_(0.5)

    expected = _build().to(torch.bfloat16).apply(halve).state_dict()
    module = _build().to(torch.bfloat16)
    import megatron_fsdp

    model, optimizer = megatron_fsdp.fully_shard(module, torch.optim.SGD(module.parameters(), lr=0.0),
                                                 fsdp_unit_modules=[Block], zero_dp_strategy=strategy)
    model.apply(halve)
    (inputs, target), = _batches(1)
    F.mse_loss(model(_local(inputs).to(torch.bfloat16)).float(), _local(target)).backward()
    optimizer.step()
    return max((value - expected[name].float()).abs().max().item() for name, value in _full_weights(model).items())


def _mixed_precision_parity():
    from torch.distributed.fsdp import MixedPrecisionPolicy as Fsdp2Policy
    from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard

    import megatron_fsdp

    fp32_start = _build()
    fsdp2 = _build()
    policy = Fsdp2Policy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in (fsdp2[1], fsdp2[2]):
        fsdp2_fully_shard(block, mp_policy=policy)
    fsdp2_fully_shard(fsdp2, mp_policy=policy)
    runs = {"fsdp2": (fsdp2, torch.optim.AdamW(fsdp2.parameters(), lr=LR))}
    runs["megatron_fsdp"] = _wrap(_build().to(torch.bfloat16), 3, mixed_precision_policy=megatron_fsdp.
                                  MixedPrecisionPolicy(main_params_dtype=torch.float32))
    runs["megatron_fsdp"][0].load_state_dict(fp32_start.state_dict())  # fp32 main weights, as FSDP2's
    results = {}
    for name, (model, optimizer) in runs.items():
        losses = []
        for inputs, target in _batches(STEPS):
            optimizer.zero_grad()
            # FSDP2 casts the inputs (cast_forward_inputs); Megatron-FSDP computes in the module's dtype
            output = model(_local(inputs) if name == "fsdp2" else _local(inputs).to(torch.bfloat16))
            loss = F.mse_loss(output.float(), _local(target))
            loss.backward()
            param = next(iter(model.parameters()))
            results[f"{name}_dtypes"] = (output.dtype, param.dtype, param.grad.dtype)
            optimizer.step()
            losses.append(_mean_over_ranks(loss.item()))
        results[name] = losses
        results[f"{name}_state_dtypes"] = {v.dtype for s in optimizer.state.values() for k, v in s.items()
                                           if k != "step"}
    return results


@pytest.mark.parametrize("world_size", [2])
def test_fsdp2_method_calls(world_size):
    for strategy in (1, 3):
        synced, switched = (run_on_ranks(world_size, _accumulate, strategy, flag)[0] for flag in (False, True))
        for name, value in synced.items():
            assert torch.equal(switched[name], value), (strategy, name)
        for messages in run_on_ranks(world_size, _errors, strategy):
            for name in ("reshard_after_forward", "reshard_after_backward"):
                assert "zero_dp_strategy" in messages[name] and "optim_grads" in messages[name], name
            assert "gathered_parameters()" in messages["unshard"]
            assert "out of Megatron-FSDP's sharded buffers" in messages["to_bf16"]
            assert strategy == 3 or "zero_dp_strategy='optim_grads_params'" in messages["reshard"]
            assert messages["same_device_is_noop"]
        assert max(run_on_ranks(world_size, _apply_after_wrap, strategy)) == 0.0, strategy


@pytest.mark.parametrize("world_size", [2])
def test_bf16_compute_fp32_reduction_matches_fsdp2_mixed_precision(world_size):
    for result in run_on_ranks(world_size, _mixed_precision_parity):
        # Both compute in bf16 from the same bf16 casts of the same fp32 main weights, reduce fp32 gradients of
        # the same bf16 backward, and step fp32 weights with fp32 AdamW state: nothing is rounded differently, so
        # the losses agree to fp32 rounding (without the fp32 load, the main weights start as bf16 roundings of
        # the fp32 ones, 2^-9 relative, and later losses differ by about a percent).
        assert result["megatron_fsdp"] == pytest.approx(result["fsdp2"], rel=1e-6, abs=0)
        assert result["fsdp2_dtypes"] == (torch.bfloat16, torch.float32, torch.float32)
        # Megatron-FSDP: the module shows its compute weights (bf16); gradients in the main grads dtype (fp32)
        assert result["megatron_fsdp_dtypes"] == (torch.bfloat16, torch.bfloat16, torch.float32)
        assert result["fsdp2_state_dtypes"] == result["megatron_fsdp_state_dtypes"] == {torch.float32}
