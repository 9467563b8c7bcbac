"""A torch optimizer over a Megatron-FSDP model leaves alone the parameters no rank gave a gradient in a step, as
it does in one process: an unused head keeps its initial weights exactly, a branch that no sample of a step takes
is not moved by AdamW's momentum or weight decay in that step, and a branch one rank's samples take is stepped on
every rank. Their `.grad` is None where torch's would be."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

WIDTH = 5
# Per step, which samples of the global batch take branch b (the others take branch a), at two and at three ranks:
# samples of every rank, none, samples of every rank again (every rank uses both branches in those steps); or one
# sample of the last rank only, none, one of rank 0 only.
ON_EVERY_RANK = [[True, False] * 3, [False] * 6, [True, False] * 3]
ON_SOME_RANKS = [[False] * 5 + [True], [False] * 6, [True] + [False] * 5]
# The same at four ranks (HSDP / HFSDP on a 2x2 mesh), two samples a rank.
ON_EVERY_RANK_OF_FOUR = [[True, False] * 4, [False] * 8, [True, False] * 4]
ON_SOME_RANKS_OF_FOUR = [[False] * 7 + [True], [False] * 8, [True] + [False] * 7]


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
    return [(torch.randn(len(to_b), WIDTH, generator=generator), torch.randn(len(to_b), WIDTH, generator=generator),
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


def _outer_mesh_kwargs(outer_strategy):
    """HSDP (`no_shard`) or HFSDP (`optim`) on a (dp_outer, dp_shard) mesh of 2x2 ranks."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_outer", "dp_shard"))
    return dict(device_mesh=mesh, dp_shard_dim="dp_shard", dp_outer_dim="dp_outer",
                hybrid_fsdp_group=mesh._flatten("dp_outer_shard").get_group(),
                outer_dp_sharding_strategy=outer_strategy)


def _train_sharded(runs, outer_strategy=None):
    """`runs`: (strategy, routes) pairs; `outer_strategy`: None, or HSDP / HFSDP's outer strategy at four ranks."""
    import torch.distributed as dist

    import megatron_fsdp

    rank, world = dist.get_rank(), dist.get_world_size()
    mesh_kwargs = _outer_mesh_kwargs(outer_strategy) if outer_strategy is not None else {}
    results = {}
    for strategy, routes in runs:
        per_rank = len(routes[0]) // world
        mine = slice(rank * per_rank, (rank + 1) * per_rank)
        module, optimizer = _build()
        model, optimizer = megatron_fsdp.fully_shard(module, optimizer, fsdp_unit_modules=[Block],
                                                     zero_dp_strategy=strategy, **mesh_kwargs)
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
        final = {name: _full(value) for name, value in model.state_dict().items()}
        results[(strategy, str(routes))] = (losses, graded, final)
    return results


def _check(by_run, runs):
    initial = {name: _full(value) for name, value in _build()[0].state_dict().items()}
    references = {}
    for _, routes in runs:
        if str(routes) not in references:
            references[str(routes)] = _reference(routes)
            graded = references[str(routes)][1]  # the head never has a gradient, branch b none in the second step
            assert not any(step["unused_head.weight"] for step in graded)
            assert [step["branch_b.weight"] for step in graded] == [True, False, True]
    for strategy, routes in runs:
        losses, graded, final = by_run[(strategy, str(routes))]
        reference_losses, reference_graded, reference_final = references[str(routes)]
        assert graded == reference_graded, (strategy, routes)
        assert losses == pytest.approx(reference_losses, abs=1e-6), (strategy, routes)
        for name, value in reference_final.items():
            torch.testing.assert_close(final[name], value, atol=1e-6, rtol=0, msg=f"{strategy} {routes} {name}")
        for name in ("unused_head.weight", "unused_head.bias"):
            assert torch.equal(final[name], initial[name]), (strategy, routes, name)


@pytest.mark.parametrize("world_size", [2, 3])
def test_parameters_without_gradients_are_left_alone_as_in_one_process(world_size):
    from tests.unit_tests.multiprocess_harness import run_on_ranks

    runs = [(strategy, ON_EVERY_RANK) for strategy in (0, 1, 2, 3)] + [(strategy, ON_SOME_RANKS)
                                                                       for strategy in (0, 1, 2)]
    for by_run in run_on_ranks(world_size, _train_sharded, runs):
        _check(by_run, runs)


@pytest.mark.parametrize("world_size", [4])
def test_ranks_agree_across_the_outer_dim_of_hsdp_and_hfsdp(world_size):
    """A branch taken on one replica only is stepped on both (HSDP at ZeRO-0..2, the marks agreed over the shard
    and the outer ranks); HSDP and HFSDP at ZeRO-3 with every rank taking the same branches."""
    from tests.unit_tests.multiprocess_harness import run_on_ranks

    hsdp_runs = [(3, ON_EVERY_RANK_OF_FOUR)] + [(strategy, ON_SOME_RANKS_OF_FOUR) for strategy in (0, 1, 2)]
    for by_run in run_on_ranks(world_size, _train_sharded, hsdp_runs, "no_shard"):
        _check(by_run, hsdp_runs)
    hfsdp_runs = [(3, ON_EVERY_RANK_OF_FOUR)]
    for by_run in run_on_ranks(world_size, _train_sharded, hfsdp_runs, "optim"):
        _check(by_run, hfsdp_runs)
