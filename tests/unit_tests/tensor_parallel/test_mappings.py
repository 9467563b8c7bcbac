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
