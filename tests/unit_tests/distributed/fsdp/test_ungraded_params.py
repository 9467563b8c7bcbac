"""A torch optimizer over a Megatron-FSDP model leaves alone the parameters no rank gave a gradient in a step, as
it does in one process: an unused head keeps its initial weights exactly, a branch that no sample of a step takes
is not moved by AdamW's momentum or weight decay in that step, and a branch one rank's samples take is stepped on
every rank. Their `.grad` is None where torch's would be."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

WIDTH = 5
GLOBAL_BATCH = 6
# Per step, which samples of the global batch take branch b (the others take branch a), at two and at three ranks:
# samples of every rank, none, samples of every rank again (every rank uses both branches in those steps); or one
# sample of the last rank only, none, one of rank 0 only.
ON_EVERY_RANK = [[True, False] * 3, [False] * 6, [True, False] * 3]
ON_SOME_RANKS = [[False] * 5 + [True], [False] * 6, [True] + [False] * 5]


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        return torch.tanh(self.fc(x))


class RoutedNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(WIDTH, WIDTH)
        self.block = Block()
        self.branch_a = nn.Linear(WIDTH, WIDTH)
        self.branch_b = nn.Linear(WIDTH, WIDTH)
        self.unused_head = nn.Linear(WIDTH, WIDTH)

    def forward(self, x, to_b):
        h = self.block(self.inp(x))
        out = h.new_zeros(h.shape)
        if (~to_b).any():
            out[~to_b] = self.branch_a(h[~to_b])
        if to_b.any():
            out[to_b] = self.branch_b(h[to_b])
        return out


def _build():
    torch.manual_seed(0)
    module = RoutedNet()
    return module, torch.optim.AdamW(module.parameters(), lr=1e-2, weight_decay=0.1)


def _batches(routes):
    generator = torch.Generator().manual_seed(3)
    return [(torch.randn(GLOBAL_BATCH, WIDTH, generator=generator), torch.randn(GLOBAL_BATCH, WIDTH,
                                                                                 generator=generator),
             torch.tensor(to_b)) for to_b in routes]


def _full(value):
    return (value.full_tensor() if hasattr(value, "full_tensor") else value).detach().clone()


def _graded(module):
    return {name: param.grad is not None for name, param in module.named_parameters()}


def _reference(routes):
    module, optimizer = _build()
    losses, graded = [], []
    for inputs, target, to_b in _batches(routes):
        optimizer.zero_grad()
        loss = F.mse_loss(module(inputs, to_b), target)
        loss.backward()
        graded.append(_graded(module))
        optimizer.step()
        losses.append(loss.item())
    return losses, graded, {name: _full(value) for name, value in module.state_dict().items()}


def _train_sharded(runs):
    """`runs`: (strategy, routes) pairs."""
    import torch.distributed as dist

    import megatron_fsdp

    rank, world = dist.get_rank(), dist.get_world_size()
    per_rank = GLOBAL_BATCH // world
    mine = slice(rank * per_rank, (rank + 1) * per_rank)
    results = {}
    for strategy, routes in runs:
        module, optimizer = _build()
        model, optimizer = megatron_fsdp.fully_shard(module, optimizer, fsdp_unit_modules=[Block],
                                                     zero_dp_strategy=strategy)
        losses, graded = [], []
        for inputs, target, to_b in _batches(routes):
            optimizer.zero_grad()
            loss = F.mse_loss(model(inputs[mine], to_b[mine]), target[mine])
            loss.backward()
            optimizer.step()
            graded.append(_graded(model.module))  # `.grad` stays attached after the step until zero_grad()
            mean_loss = loss.detach().clone()
            dist.all_reduce(mean_loss)
            losses.append(mean_loss.item() / world)
        results[(strategy, str(routes))] = (losses, graded, {name: _full(value) for name, value in model.state_dict().items()})
    return results


@pytest.mark.parametrize("world_size", [2, 3])
def test_parameters_without_gradients_are_left_alone_as_in_one_process(world_size):
    from tests.unit_tests.multiprocess_harness import run_on_ranks

    initial = {name: _full(value) for name, value in _build()[0].state_dict().items()}
    references = {str(routes): _reference(routes) for routes in (ON_EVERY_RANK, ON_SOME_RANKS)}
    for _, graded, _ in references.values():  # the head never has a gradient, branch b none in the second step
        assert not any(step["unused_head.weight"] for step in graded)
        assert [step["branch_b.weight"] for step in graded] == [True, False, True]
    runs = [(strategy, ON_EVERY_RANK) for strategy in (0, 1, 2, 3)] + [(strategy, ON_SOME_RANKS)
                                                                       for strategy in (0, 1, 2)]
    for by_run in run_on_ranks(world_size, _train_sharded, runs):
        for strategy, routes in runs:
            losses, graded, final = by_run[(strategy, str(routes))]
            reference_losses, reference_graded, reference_final = references[str(routes)]
            assert graded == reference_graded, (strategy, routes)
            assert losses == pytest.approx(reference_losses, abs=1e-6), (strategy, routes)
            for name, value in reference_final.items():
                torch.testing.assert_close(final[name], value, atol=1e-6, rtol=0, msg=f"{strategy} {routes} {name}")
            for name in ("unused_head.weight", "unused_head.bias"):
                assert torch.equal(final[name], initial[name]), (strategy, routes, name)
