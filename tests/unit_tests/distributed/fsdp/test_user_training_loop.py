"""A torch training loop that edits the gradients element-wise before the step trains a wrapped model as it trains
the plain one, 0-dim parameters (a learned temperature at the root, a gain inside a unit) included:
`torch.nn.utils.clip_grad_value_(model.parameters(), ...)` and `p.grad.clamp_(...)` run on every `.grad`, which
for a 0-dim parameter is a `Replicate()` DTensor holding the reduced gradient on every rank."""

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
