"""Each tensor-parallel mapping: forward values and the gradient its backward produces."""

import pytest
import torch
import torch.distributed as dist

from megatron.core.tensor_parallel import mappings
from tests.unit_tests.multiprocess_harness import run_on_ranks
from tests.unit_tests.tensor_parallel.tp_helpers import assert_close, chunk, setup_tensor_parallel, shared_randn


def _apply(mapping, x, upstream, **kwargs):
    x = x.clone().requires_grad_()
    y = mapping(x, **kwargs)
    y.backward(upstream)
    return y.detach(), x.grad


def _mappings_forward_and_backward():
    _, rank, tp = setup_tensor_parallel()
    full = shared_randn(8, 2, 4 * tp, seed=1)
    full_grad = shared_randn(8, 2, 4 * tp, seed=2)
    per_rank = [shared_randn(8, 2, 4 * tp, seed=10 + r) for r in range(tp)]
    per_rank_grad = [shared_randn(8, 2, 4 * tp, seed=20 + r) for r in range(tp)]
    total, total_grad = sum(per_rank), sum(per_rank_grad)

    y, g = _apply(mappings.copy_to_tensor_model_parallel_region, full, per_rank_grad[rank])
    assert_close(y, full, "copy forward")
    assert_close(g, total_grad, "copy backward sums")

    y, g = _apply(mappings.reduce_from_tensor_model_parallel_region, per_rank[rank], full_grad)
    assert_close(y, total, "reduce forward sums")
    assert_close(g, full_grad, "reduce backward identity")

    y, g = _apply(mappings.scatter_to_tensor_model_parallel_region, full, chunk(full_grad, -1, rank, tp))
    assert_close(y, chunk(full, -1, rank, tp), "scatter forward")
    assert_close(g, full_grad, "scatter backward gathers")

    y, g = _apply(mappings.gather_from_tensor_model_parallel_region, chunk(full, -1, rank, tp), full_grad)
    assert_close(y, full, "gather forward")
    assert_close(g, chunk(full_grad, -1, rank, tp), "gather backward splits")

    y, g = _apply(mappings.scatter_to_sequence_parallel_region, full, chunk(full_grad, 0, rank, tp))
    assert_close(y, chunk(full, 0, rank, tp), "sequence scatter forward")
    assert_close(g, full_grad, "sequence scatter backward gathers")

    y, g = _apply(mappings.gather_from_sequence_parallel_region, chunk(full, 0, rank, tp), per_rank_grad[rank])
    assert_close(y, full, "sequence gather forward")
    assert_close(g, chunk(total_grad, 0, rank, tp), "sequence gather backward reduce-scatters")

    y, g = _apply(
        mappings.gather_from_sequence_parallel_region, chunk(full, 0, rank, tp), full_grad,
        tensor_parallel_output_grad=False,
    )
    assert_close(g, chunk(full_grad, 0, rank, tp), "sequence gather backward splits")

    y, g = _apply(mappings.reduce_scatter_to_sequence_parallel_region, per_rank[rank], chunk(full_grad, 0, rank, tp))
    assert_close(y, chunk(total, 0, rank, tp), "reduce-scatter forward")
    assert_close(g, full_grad, "reduce-scatter backward gathers")

    with pytest.raises(ValueError, match="not divisible by tensor-parallel size"):
        mappings.scatter_to_sequence_parallel_region(torch.zeros(tp + 1, 2))
    dist.barrier()
    return True


@pytest.mark.parametrize("world_size", [2, 4])
def test_mappings(world_size):
    assert run_on_ranks(world_size, _mappings_forward_and_backward) == [True] * world_size


def test_mappings_are_identity_without_tensor_parallelism():
    x = torch.randn(4, 3)
    for mapping in (
        mappings.copy_to_tensor_model_parallel_region,
        mappings.reduce_from_tensor_model_parallel_region,
        mappings.scatter_to_tensor_model_parallel_region,
        mappings.gather_from_tensor_model_parallel_region,
        mappings.scatter_to_sequence_parallel_region,
        mappings.gather_from_sequence_parallel_region,
        mappings.reduce_scatter_to_sequence_parallel_region,
        mappings.all_gather_last_dim_from_tensor_parallel_region,
        mappings.reduce_scatter_last_dim_to_tensor_parallel_region,
    ):
        assert torch.equal(mapping(x), x)


def test_copy_and_reduce_regions_copy_nothing_without_tensor_parallelism():
    """On one tensor-parallel rank the copy-to region (input of a column-parallel linear) and the reduce-from
    region (output of a row-parallel one) hand the tensor on as it is: no copy in the forward or the backward."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class CountCopies(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.copies = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket in (torch.ops.aten.clone, torch.ops.aten.copy_, torch.ops.aten._to_copy):
                self.copies.append(str(func))
            return func(*args, **(kwargs or {}))

    for mapping in (mappings.copy_to_tensor_model_parallel_region, mappings.reduce_from_tensor_model_parallel_region):
        x = torch.randn(4, 3, requires_grad=True)
        with CountCopies() as counter:
            y = mapping(x)
            (y * 2).sum().backward()
        assert y is x, mapping.__name__
        assert counter.copies == [], (mapping.__name__, counter.copies)
        assert torch.equal(x.grad, torch.full((4, 3), 2.0))


def _upstream_mappings_match_a_single_process_reference():
    """Upstream's other exported mappings at TP = world size, against references built from the full tensors."""
    from megatron.core import tensor_parallel

    _, rank, tp = setup_tensor_parallel()
    group = mappings.parallel_state.get_tensor_model_parallel_group()
    full = shared_randn(4, 2, 4 * tp, seed=1)
    full_grad = shared_randn(4, 2, 4 * tp, seed=2)
    per_rank = [shared_randn(4, 2, 4 * tp, seed=10 + r) for r in range(tp)]
    per_rank_grad = [shared_randn(4, 2, 4 * tp, seed=20 + r) for r in range(tp)]
    total, total_grad = sum(per_rank), sum(per_rank_grad)

    y, g = _apply(tensor_parallel.all_gather_last_dim_from_tensor_parallel_region, chunk(full, -1, rank, tp),
                  per_rank_grad[rank])
    assert_close(y, full, "last-dim all-gather forward")
    assert_close(g, chunk(total_grad, -1, rank, tp), "last-dim all-gather backward reduce-scatters")

    y, g = _apply(tensor_parallel.reduce_scatter_last_dim_to_tensor_parallel_region, per_rank[rank],
                  chunk(full_grad, -1, rank, tp), group=group)
    assert_close(y, chunk(total, -1, rank, tp), "last-dim reduce-scatter forward")
    assert_close(g, full_grad, "last-dim reduce-scatter backward gathers")

    # Equal splits: block r of every rank's rows lands on rank r, in source-rank order.
    rows = [shared_randn(2 * tp, 3, seed=30 + r) for r in range(tp)]
    rows_grad = [shared_randn(2 * tp, 3, seed=40 + r) for r in range(tp)]
    y, g = _apply(lambda x: tensor_parallel.all_to_all(group, x), rows[rank], rows_grad[rank])
    assert_close(y, torch.cat([chunk(rows[s], 0, rank, tp) for s in range(tp)]), "all_to_all forward")
    assert_close(g, torch.cat([chunk(rows_grad[s], 0, rank, tp) for s in range(tp)]), "all_to_all backward")

    # Uneven splits: rank s sends s + t + 1 rows to rank t.
    def sent(s, t, tensor):
        start = sum(s + u + 1 for u in range(t))
        return tensor[start : start + s + t + 1]

    uneven = [shared_randn(sum(s + t + 1 for t in range(tp)), 3, seed=50 + s) for s in range(tp)]
    received_grad = [shared_randn(sum(s + t + 1 for s in range(tp)), 3, seed=60 + t) for t in range(tp)]
    in_splits = [rank + t + 1 for t in range(tp)]
    out_splits = [s + rank + 1 for s in range(tp)]
    y, g = _apply(lambda x: tensor_parallel.all_to_all(group, x, out_splits, in_splits), uneven[rank],
                  received_grad[rank])
    assert_close(y, torch.cat([sent(s, rank, uneven[s]) for s in range(tp)]), "uneven all_to_all forward")

    def block_from(source, t):  # rows of received_grad[t] that came from `source`
        start = sum(s + t + 1 for s in range(source))
        return received_grad[t][start : start + source + t + 1]

    assert_close(g, torch.cat([block_from(rank, t) for t in range(tp)]), "uneven all_to_all backward")

    flat, flat_grad = full.reshape(-1, 4 * tp), full_grad.reshape(-1, 4 * tp)
    y, g = _apply(tensor_parallel.all_to_all_sp2hp, chunk(full, 0, rank, tp), chunk(flat_grad, -1, rank, tp))
    assert_close(y, chunk(flat, -1, rank, tp), "sp2hp forward")
    assert_close(g, chunk(full_grad, 0, rank, tp), "sp2hp backward")
    y, g = _apply(tensor_parallel.all_to_all_hp2sp, chunk(flat, -1, rank, tp), chunk(flat_grad, 0, rank, tp))
    assert_close(y, chunk(flat, 0, rank, tp), "hp2sp forward")
    assert_close(g, chunk(flat_grad, -1, rank, tp), "hp2sp backward")

    with pytest.raises(ValueError, match=r"all_to_all\(group=None\): pass the process group"):
        tensor_parallel.all_to_all(None, full)
    with pytest.raises(ValueError, match="pass both output_split_sizes_ and input_split_sizes"):
        tensor_parallel.all_to_all(group, full, [1] * tp)
    dist.barrier()
    return True


def test_upstream_mappings_at_tp2():
    assert run_on_ranks(2, _upstream_mappings_match_a_single_process_reference) == [True, True]


def _sequence_mappings_with_upstream_keywords():
    """gather_from_sequence_parallel_region / reduce_scatter_to_sequence_parallel_region called with upstream's
    keywords (an explicit group, uneven split sizes, use_global_buffer), against full-tensor references."""
    _, rank, tp = setup_tensor_parallel()
    group = mappings.parallel_state.get_tensor_model_parallel_group()
    sizes = [r + 1 for r in range(tp)]  # rank r holds r + 1 rows
    start = sum(sizes[:rank])
    full = shared_randn(sum(sizes), 2, 3, seed=1)
    per_rank_grad = [shared_randn(sum(sizes), 2, 3, seed=20 + r) for r in range(tp)]
    total_grad = sum(per_rank_grad)
    mine = full[start : start + sizes[rank]]

    y, g = _apply(mappings.gather_from_sequence_parallel_region, mine, per_rank_grad[rank], group=group,
                  output_split_sizes=sizes, use_global_buffer=True)
    assert_close(y, full, "uneven sequence gather forward")
    assert_close(g, total_grad[start : start + sizes[rank]], "uneven sequence gather backward reduce-scatters")

    y, g = _apply(mappings.gather_from_sequence_parallel_region, mine, per_rank_grad[0],
                  tensor_parallel_output_grad=False, output_split_sizes=sizes)
    assert_close(g, per_rank_grad[0][start : start + sizes[rank]], "uneven sequence gather backward splits")

    per_rank = [shared_randn(sum(sizes), 2, 3, seed=10 + r) for r in range(tp)]
    total = sum(per_rank)
    mine_grad = per_rank_grad[0][start : start + sizes[rank]]
    y, g = _apply(mappings.reduce_scatter_to_sequence_parallel_region, per_rank[rank], mine_grad, group=group,
                  input_split_sizes=sizes, use_global_buffer=False)
    assert_close(y, total[start : start + sizes[rank]], "uneven reduce-scatter forward")
    gathered_grad = torch.cat([per_rank_grad[0][sum(sizes[:r]) : sum(sizes[: r + 1])] for r in range(tp)])
    assert_close(g, gathered_grad, "uneven reduce-scatter backward gathers")

    # Equal shares over an explicit group, and the tensor-parallel regions with upstream's group keyword.
    even = shared_randn(2 * tp, 2, 2 * tp, seed=3)
    y, g = _apply(mappings.reduce_scatter_to_sequence_parallel_region, even, chunk(even, 0, rank, tp), group=group)
    assert_close(y, tp * chunk(even, 0, rank, tp), "reduce-scatter over an explicit group")
    assert_close(g, even, "reduce-scatter over an explicit group: backward")
    y, g = _apply(mappings.copy_to_tensor_model_parallel_region, even, even, group=group)
    assert_close(g, tp * even, "copy region over an explicit group: backward sums")
    y, _ = _apply(mappings.reduce_from_tensor_model_parallel_region, even, even, group=group)
    assert_close(y, tp * even, "reduce region over an explicit group")
    y, g = _apply(mappings.scatter_to_tensor_model_parallel_region, even, chunk(even, -1, rank, tp), group=group)
    assert_close(y, chunk(even, -1, rank, tp), "scatter region over an explicit group")
    y, g = _apply(mappings.gather_from_tensor_model_parallel_region, chunk(even, -1, rank, tp), even, group=group)
    assert_close(y, even, "gather region over an explicit group")
    y, g = _apply(mappings.scatter_to_sequence_parallel_region, even, chunk(even, 0, rank, tp), group=group)
    assert_close(g, even, "sequence scatter over an explicit group: backward gathers")

    wrong = list(sizes)
    wrong[rank] += 4  # every rank fails its own check before any collective
    expected = rf"output_split_sizes\[{rank}\] = {sizes[rank] + 4} but this rank's input has {sizes[rank]} rows"
    with pytest.raises(ValueError, match=expected):
        mappings.gather_from_sequence_parallel_region(mine, output_split_sizes=wrong)
    with pytest.raises(ValueError, match="input_split_sizes sum to"):
        mappings.reduce_scatter_to_sequence_parallel_region(full, input_split_sizes=[1] * tp)
    dist.barrier()
    return True


def test_sequence_parallel_mappings_take_upstream_keywords_at_tp2():
    assert run_on_ranks(2, _sequence_mappings_with_upstream_keywords) == [True, True]
