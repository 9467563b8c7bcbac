"""A torch training loop that edits the gradients element-wise before the step trains a wrapped model as it trains
the plain one, 0-dim parameters (a learned temperature at the root, a gain inside a unit) included:
`torch.nn.utils.clip_grad_value_(model.parameters(), ...)` and `p.grad.clamp_(...)` run on every `.grad`, which
for a 0-dim parameter is a `Replicate()` DTensor holding the reduced gradient on every rank.

So does a loop that edits the weights between steps: in place inside `with model.gathered_parameters():` (kept
on exit under every strategy, ZeRO-3 included), and element-wise on a 0-dim parameter at rest (`p.clamp_`),
which under ZeRO-3 is a `Replicate()` DTensor holding the value on every rank."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

NUM_STEPS = 3
GLOBAL_BATCH = 12
WIDTH = 6
CLIP_VALUE = 0.05  # below the largest gradients of the first step, so clipping changes the run


class GainBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(WIDTH, WIDTH)
        self.gain = nn.Parameter(torch.tensor(0.7))

    def forward(self, x):
        return x + self.gain * torch.tanh(self.fc(x))


class TemperatureNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(WIDTH, WIDTH)
        self.blocks = nn.ModuleList([GainBlock() for _ in range(2)])
        self.out = nn.Linear(WIDTH, WIDTH)
        self.temperature = nn.Parameter(torch.tensor(1.3))

    def forward(self, x):
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.out(h) * self.temperature


def _build():
    torch.manual_seed(0)
    module = TemperatureNet()
    return module, torch.optim.AdamW(module.parameters(), lr=1e-2, weight_decay=0.1)


def _batches():
    generator = torch.Generator().manual_seed(1)
    return [(torch.randn(GLOBAL_BATCH, WIDTH, generator=generator),
             torch.randn(GLOBAL_BATCH, WIDTH, generator=generator)) for _ in range(NUM_STEPS)]


def _clip(model, clamp_by_hand):
    if clamp_by_hand:
        for param in model.parameters():
            if param.grad is not None:
                param.grad.clamp_(-CLIP_VALUE, CLIP_VALUE)
    else:
        torch.nn.utils.clip_grad_value_(model.parameters(), CLIP_VALUE)


def _reference(clamp_by_hand):
    """Single-process training on the whole batch: losses, the first step's gradients of the temperature and a
    gain before clipping, the temperature's after, and the final weights."""
    module, optimizer = _build()
    losses, first_grads = [], None
    for inputs, target in _batches():
        optimizer.zero_grad()
        loss = F.mse_loss(module(inputs), target)
        loss.backward()
        unclipped = (module.temperature.grad.item(), module.blocks[0].gain.grad.item())
        _clip(module, clamp_by_hand)
        if first_grads is None:
            first_grads = (unclipped, module.temperature.grad.item())
        optimizer.step()
        losses.append(loss.item())
    return losses, first_grads, {name: p.detach().clone() for name, p in module.named_parameters()}


def _train_sharded(strategy, clamp_by_hand):
    import torch.distributed as dist
    from torch.distributed.tensor import Replicate

    import megatron_fsdp

    rank, world = dist.get_rank(), dist.get_world_size()
    module, optimizer = _build()
    model, optimizer = megatron_fsdp.fully_shard(module, optimizer, fsdp_unit_modules=[GainBlock],
                                                 zero_dp_strategy=strategy)
    losses, first_grad = [], None
    for inputs, target in _batches():
        per_rank = GLOBAL_BATCH // world
        inputs, target = inputs[rank * per_rank:(rank + 1) * per_rank], target[rank * per_rank:(rank + 1) * per_rank]
        optimizer.zero_grad()
        loss = F.mse_loss(model(inputs), target)
        loss.backward()
        temperature, gain = model.module.temperature, model.module.blocks[0].gain
        unclipped = (temperature.grad.to_local().item(), gain.grad.to_local().item())
        placements = [list(temperature.grad.placements), list(gain.grad.placements)]
        _clip(model, clamp_by_hand)
        if first_grad is None:
            first_grad = (placements == [[Replicate()]] * 2, unclipped, temperature.grad.to_local().item())
        optimizer.step()
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss)
        losses.append(mean_loss.item() / world)
    weights = {name: (value.full_tensor() if hasattr(value, "full_tensor") else value).detach().clone()
               for name, value in model.state_dict().items()}
    return losses, first_grad, weights


@pytest.mark.parametrize("world_size", [2])
def test_element_wise_gradient_clipping_trains_like_one_process(world_size):
    from tests.unit_tests.multiprocess_harness import run_on_ranks

    for clamp_by_hand in (False, True):
        reference_losses, (unclipped, clipped), reference_weights = _reference(clamp_by_hand)
        assert abs(unclipped[0]) > CLIP_VALUE and abs(clipped) == pytest.approx(CLIP_VALUE)
        for strategy in (0, 1, 2, 3):
            for rank_losses, (replicated, rank_unclipped, rank_clipped), weights in run_on_ranks(
                    world_size, _train_sharded, strategy, clamp_by_hand):
                # every rank holds the reduced gradients of both 0-dim parameters, and the clipped one
                assert replicated, strategy
                assert rank_unclipped == pytest.approx(unclipped, abs=1e-7), strategy
                assert rank_clipped == pytest.approx(clipped, abs=1e-7), strategy
                assert rank_losses == pytest.approx(reference_losses, abs=1e-6), strategy
                assert set(weights) == set(reference_weights)
                for name, value in reference_weights.items():
                    torch.testing.assert_close(weights[name], value, atol=1e-6, rtol=0, msg=f"{strategy} {name}")


WRITE_SEED = 7


def _edit_gathered(module):
    """Writes a user makes to the full weights: scaled in place, shifted through `.data`, a layer re-initialised
    (seeded alike on every rank), a 0-dim gain set."""
    with torch.no_grad():
        module.out.weight.mul_(0.5)
        module.inp.bias.data.add_(0.25)
        torch.manual_seed(WRITE_SEED)
        module.blocks[1].fc.reset_parameters()
        module.blocks[0].gain.copy_(torch.tensor(0.4))


def _edit_scalars_at_rest(module):
    with torch.no_grad():
        module.temperature.clamp_(0.0, 1.0)  # 1.3 before: clamped
        module.blocks[1].gain.clamp_(max=0.5)


def _weights(named_tensors):
    return {name: (value.full_tensor() if hasattr(value, "full_tensor") else value).detach().clone()
            for name, value in named_tensors}


def _reference_with_weight_edits():
    """One process: a step, the edits, two more steps. Losses, the weights right after the edits, the final ones."""
    module, optimizer = _build()
    losses, edited = [], None
    for step, (inputs, target) in enumerate(_batches()):
        if step == 1:
            _edit_gathered(module)
            _edit_scalars_at_rest(module)
            edited = _weights(module.named_parameters())
        optimizer.zero_grad()
        loss = F.mse_loss(module(inputs), target)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, edited, _weights(module.named_parameters())


def _train_sharded_with_weight_edits(strategies):
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Replicate

    import megatron_fsdp

    rank, world = dist.get_rank(), dist.get_world_size()
    results = {}
    for strategy in strategies:
        module, optimizer = _build()
        model, optimizer = megatron_fsdp.fully_shard(module, optimizer, fsdp_unit_modules=[GainBlock],
                                                     zero_dp_strategy=strategy)
        losses, edited, at_rest = [], None, None
        for step, (inputs, target) in enumerate(_batches()):
            if step == 1:
                with model.gathered_parameters() as inner:
                    _edit_gathered(inner)
                edited_by_gathered = _weights(model.state_dict().items())
                _edit_scalars_at_rest(model.module)
                temperature = model.module.temperature
                local = temperature.to_local() if isinstance(temperature, DTensor) else temperature
                at_rest = (not isinstance(temperature, DTensor) or list(temperature.placements) == [Replicate()],
                           float(local.detach()))
                edited = (edited_by_gathered, _weights(model.state_dict().items()))
            per_rank = GLOBAL_BATCH // world
            inputs = inputs[rank * per_rank:(rank + 1) * per_rank]
            target = target[rank * per_rank:(rank + 1) * per_rank]
            optimizer.zero_grad()
            loss = F.mse_loss(model(inputs), target)
            loss.backward()
            optimizer.step()
            mean_loss = loss.detach().clone()
            dist.all_reduce(mean_loss)
            losses.append(mean_loss.item() / world)
        results[strategy] = (losses, edited, at_rest, _weights(model.state_dict().items()))
    return results


@pytest.mark.parametrize("world_size", [2])
def test_weight_edits_between_steps_train_like_one_process(world_size):
    """Writes inside `gathered_parameters()` and `clamp_` on resting 0-dim parameters persist: the state dict
    right after holds them, and training on matches a process that made the same edits."""
    from tests.unit_tests.multiprocess_harness import run_on_ranks

    reference_losses, reference_edited, reference_final = _reference_with_weight_edits()
    unedited = _weights(_build()[0].named_parameters())
    assert reference_edited["temperature"].item() == 1.0 and reference_edited["blocks.1.gain"].item() == 0.5
    assert not torch.equal(reference_edited["blocks.1.fc.weight"], unedited["blocks.1.fc.weight"])
    strategies = (0, 1, 2, 3)
    for by_strategy in run_on_ranks(world_size, _train_sharded_with_weight_edits, strategies):
        for strategy in strategies:
            losses, (after_gathered, after_clamp), (replicated, temperature), final = by_strategy[strategy]
            assert replicated and temperature == 1.0, strategy  # this rank's copy of the clamped value
            for name, value in reference_edited.items():
                # one step of data-parallel training before: fp32 rounding apart from the single process
                if name not in ("temperature", "blocks.1.gain"):  # clamped after the gathered writes
                    torch.testing.assert_close(after_gathered[name], value, atol=1e-6, rtol=0, msg=f"{strategy} {name}")
                torch.testing.assert_close(after_clamp[name], value, atol=1e-6, rtol=0, msg=f"{strategy} {name}")
            assert losses == pytest.approx(reference_losses, abs=1e-6), strategy
            for name, value in reference_final.items():
                torch.testing.assert_close(final[name], value, atol=1e-6, rtol=0, msg=f"{strategy} {name}")


def _bf16_weight_edits(strategy):
    """A bf16 model with fp32 main weights: after two steps, whether any rank's compute weights differ from its
    main weights (the 0-dim copies must not count as writes); then the output weight inside
    `gathered_parameters()` before it is halved, the optimizer's fp32 main weights right after the writes, and
    the weights after another step at learning rate 0."""
    import torch.distributed as dist

    import megatron_fsdp

    torch.manual_seed(0)
    module = TemperatureNet().to(torch.bfloat16)
    model, optimizer = megatron_fsdp.fully_shard(module, torch.optim.SGD(module.parameters(), lr=0.1),
                                                 fsdp_unit_modules=[GainBlock], zero_dp_strategy=strategy)
    inputs = torch.randn(2, WIDTH, generator=torch.Generator().manual_seed(dist.get_rank())).to(torch.bfloat16)

    def step():
        optimizer.zero_grad()
        model(inputs).float().square().mean().backward()
        optimizer.step()

    step()
    step()
    copies_seen_as_writes = any(group.compute_written() for group in model.groups)
    with model.gathered_parameters() as inner, torch.no_grad():
        before = inner.out.weight.detach().clone()
        inner.out.weight.data.mul_(0.5)
        inner.temperature.fill_(0.75)
    main = {name: state["main_param"].full_tensor().clone() for name, state in optimizer.state_dict()["state"].items()
            if name in ("out.weight", "temperature")}
    for param_group in optimizer.param_groups:
        param_group["lr"] = 0.0
    step()
    return copies_seen_as_writes, before, main, _weights(model.state_dict().items())


@pytest.mark.parametrize("world_size", [2])
def test_bf16_writes_inside_gathered_parameters_reach_the_fp32_main_weights(world_size):
    from tests.unit_tests.multiprocess_harness import run_on_ranks

    for strategy in (1, 3):
        for copies_seen_as_writes, before, main, weights in run_on_ranks(world_size, _bf16_weight_edits, strategy):
            assert not copies_seen_as_writes, strategy
            expected_out = before.float() * 0.5  # exact: halving a bf16 value
            assert main["out.weight"].dtype == torch.float32, strategy
            torch.testing.assert_close(main["out.weight"], expected_out, atol=0, rtol=0, msg=str(strategy))
            assert main["temperature"].item() == 0.75, strategy
            assert torch.equal(weights["out.weight"], expected_out.to(torch.bfloat16)), strategy
            assert weights["temperature"].item() == 0.75, strategy


def _bf16_scalar_writes_at_rest(strategy):
    """A bf16 model with fp32 main weights: a step, then 0-dim parameters written at rest on every rank, then
    `optimizer.state_dict()` on rank 0 only (the save habit), then on every rank, then a step at learning rate 0.
    The saved main weights of the two 0-dim parameters each time, and the weights after the last step."""
    import torch.distributed as dist

    import megatron_fsdp

    torch.manual_seed(0)
    module = TemperatureNet().to(torch.bfloat16)
    # overlap_param_gather=False: under strategies 1/2 a write at rest is then made after the post-step gather
    model, optimizer = megatron_fsdp.fully_shard(module, torch.optim.Adam(module.parameters(), lr=0.1),
                                                 fsdp_unit_modules=[GainBlock], zero_dp_strategy=strategy,
                                                 overlap_param_gather=False)
    inputs = torch.randn(2, WIDTH, generator=torch.Generator().manual_seed(dist.get_rank())).to(torch.bfloat16)

    def step():
        optimizer.zero_grad()
        model(inputs).float().square().mean().backward()
        optimizer.step()

    def saved_main():
        state = optimizer.state_dict()["state"]
        return {name: float(_weights([(name, state[name]["main_param"])])[name])
                for name in ("temperature", "blocks.0.gain")}

    step()
    with torch.no_grad():
        model.module.temperature.fill_(0.75)
        model.module.blocks[0].gain.clamp_(max=0.5)
    on_rank0_only = saved_main() if dist.get_rank() == 0 else None
    dist.barrier()
    on_every_rank = saved_main()
    for param_group in optimizer.param_groups:
        param_group["lr"] = 0.0
    step()
    return on_rank0_only, on_every_rank, _weights(model.state_dict().items())


@pytest.mark.parametrize("world_size", [2])
def test_bf16_scalar_writes_at_rest_reach_every_ranks_optimizer_state_dict(world_size):
    """Rank 0 alone holds a 0-dim parameter's fp32 main weight; a write to the parameter at rest moves it there only.
    The optimizer state dict still issues no collective (rank 0 may save alone) and holds the written value on every
    rank."""
    from tests.unit_tests.multiprocess_harness import run_on_ranks

    expected = {"temperature": 0.75, "blocks.0.gain": 0.5}  # the gain (0.7 after a step at lr 0.1) clamped
    for strategy in (1, 2, 3):
        results = run_on_ranks(world_size, _bf16_scalar_writes_at_rest, strategy)
        assert results[0][0] == expected, strategy
        for rank, (on_rank0_only, on_every_rank, weights) in enumerate(results):
            assert on_rank0_only is None or rank == 0
            assert on_every_rank == expected, (strategy, rank)
            assert weights["temperature"].item() == 0.75 and weights["blocks.0.gain"].item() == 0.5, strategy
