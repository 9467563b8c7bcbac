"""Global grad norm / zero count over hand-partitioned TP and PP parameters equals the single-process value."""

import math

import pytest
import torch

from megatron.core import parallel_state
from megatron.core.optimizer import OptimizerConfig, count_zeros_fp32, get_grad_norm_fp32, get_megatron_optimizer
from megatron.core.optimizer.clip_grads import grads_for_grad_stats
from tests.unit_tests.multiprocess_harness import run_on_ranks

# name -> (full shape, TP partition dim or None if duplicated across TP, PP stages holding it, shared embedding)
LOGICAL_PARAMS = {
    "embedding": ((10, 6), 0, (0, -1), True),
    "norm": ((6,), None, (0,), False),
    "column_weight": ((8, 6), 0, (0,), False),
    "column_bias": ((8,), 0, (0,), False),
    "row_weight": ((4, 8), 1, (-1,), False),
    "row_bias": ((4,), None, (-1,), False),
}


def _full_grads():
    generator = torch.Generator().manual_seed(11)
    grads = {name: torch.randn(shape, generator=generator) for name, (shape, _, _, _) in LOGICAL_PARAMS.items()}
    grads["column_weight"][0, :] = 0.0  # 6 known zeros
    grads["row_bias"][1] = 0.0  # and one more
    return grads


def _reference_stats():
    grads = list(_full_grads().values())
    l2 = math.sqrt(sum(float(g.pow(2).sum()) for g in grads))
    inf = max(float(g.abs().max()) for g in grads)
    zeros = sum(int((g == 0).sum()) for g in grads)
    return l2, inf, zeros


def _local_module():
    """This rank's pieces of the logical model, with the TP attributes a tensor-parallel layer would set."""
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    pp_size = parallel_state.get_pipeline_model_parallel_world_size()
    module = torch.nn.Module()
    for name, grad in _full_grads().items():
        _, partition_dim, stages, shared = LOGICAL_PARAMS[name]
        if pp_rank not in {stage % pp_size for stage in stages}:
            continue
        if partition_dim is not None:
            grad = grad.chunk(tp_size, dim=partition_dim)[tp_rank]
        param = torch.nn.Parameter(torch.zeros_like(grad))
        param.grad = grad.clone()
        param.tensor_model_parallel = partition_dim is not None
        if partition_dim is not None:
            param.partition_dim = partition_dim
        if shared:
            param.shared_embedding = True
        module.register_parameter(name, param)
    return module


def _grad_stats(tp, pp):
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    module = _local_module()
    params = list(module.parameters())
    groups = [parallel_state.get_model_parallel_group()]
    grads = grads_for_grad_stats(params)
    l2 = get_grad_norm_fp32(grads, 2.0, groups)
    inf = get_grad_norm_fp32(grads, math.inf, groups)
    zeros = count_zeros_fp32(grads, groups)

    # Through the optimizer: clipping scales every local piece by max_norm / total_norm.
    optimizer = get_megatron_optimizer(OptimizerConfig(lr=0.0, clip_grad=1.0, log_num_zeros_in_grad=True), [module])
    before = {name: param.grad.clone() for name, param in module.named_parameters()}
    optimizer_norm = optimizer.clip_grad_norm(1.0)
    for name, param in module.named_parameters():
        torch.testing.assert_close(param.grad, before[name] / (l2 + 1e-6), atol=1e-7, rtol=1e-6)
    return l2, inf, zeros, optimizer_norm, optimizer.count_zeros()


@pytest.mark.parametrize("world_size, tp, pp", [(2, 2, 1), (2, 1, 2), (4, 2, 2)])
def test_grad_norm_counts_each_parameter_once(world_size, tp, pp):
    expected_l2, expected_inf, expected_zeros = _reference_stats()
    for l2, inf, zeros, optimizer_norm, optimizer_zeros in run_on_ranks(world_size, _grad_stats, tp, pp):
        assert l2 == pytest.approx(expected_l2, rel=1e-6)
        assert optimizer_norm == pytest.approx(expected_l2, rel=1e-6)
        assert inf == pytest.approx(expected_inf, rel=1e-7)
        assert zeros == expected_zeros and optimizer_zeros == expected_zeros


def test_single_process_norm_without_parallel_state():
    grads = list(_full_grads().values())
    expected_l2, expected_inf, expected_zeros = _reference_stats()
    assert get_grad_norm_fp32(grads) == pytest.approx(expected_l2, rel=1e-6)
    assert get_grad_norm_fp32(grads, norm_type=math.inf) == pytest.approx(expected_inf)
    assert count_zeros_fp32(grads) == expected_zeros


def _fused_and_separate_norms():
    """The dense and expert norms of `global_norms_fp32` against one `global_norm_fp32` per part, with the
    all-reduces counted: parts reduced over the same ranks share one, parts over different ranks do not."""
    import torch.distributed as dist

    from megatron.core.optimizer.clip_grads import global_norm_fp32, global_norms_fp32

    generator = torch.Generator().manual_seed(100 + dist.get_rank())
    dense = [torch.randn(7, 3, generator=generator), torch.randn(5, generator=generator), torch.empty(0)]
    expert = [torch.randn(4, 4, generator=generator), None]
    world = dist.group.WORLD
    calls = []
    all_reduce = dist.all_reduce

    def counted(tensor, *args, **kwargs):
        calls.append(tensor.numel())
        return all_reduce(tensor, *args, **kwargs)

    dist.all_reduce = counted
    try:
        fused = global_norms_fp32([(dense, [world]), (expert, [world])])
        fused_calls, calls[:] = list(calls), []
        separate = [global_norm_fp32(dense, 2.0, [world]), global_norm_fp32(expert, 2.0, [world])]
        calls[:] = []
        # reduced over different ranks (here: the world once, and twice): not fused
        mixed = global_norms_fp32([(dense, [world]), (expert, [world, world])])
        mixed_calls = list(calls)
    finally:
        dist.all_reduce = all_reduce
    reference = [math.sqrt(sum(float(t.double().pow(2).sum()) for t in _gathered(part)))
                 for part in (dense, expert)]
    return fused, fused_calls, separate, reference, mixed, mixed_calls


def _gathered(tensors):
    import torch.distributed as dist

    tensors = [t for t in tensors if t is not None]
    flat = torch.cat([t.reshape(-1) for t in tensors])
    out = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(out, flat)
    return out


@pytest.mark.parametrize("world_size", [2, 3])
def test_dense_and_expert_norms_share_one_all_reduce_when_reduced_over_the_same_ranks(world_size):
    for fused, fused_calls, separate, reference, mixed, mixed_calls in run_on_ranks(
            world_size, _fused_and_separate_norms):
        assert fused_calls == [2]  # one all-reduce of both sums
        assert fused == separate  # the same numbers as one reduction per part
        assert fused == pytest.approx(reference, rel=1e-6)
        assert mixed_calls == [1, 1, 1] and mixed[0] == separate[0]


def _clipped_dtensor_and_plain():
    """DTensor gradients (sharded, replicated, a pending sum) clipped by the global norm, against the same values
    as plain tensors."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    generator = torch.Generator().manual_seed(5 + dist.get_rank())
    locals_ = [torch.randn(3, 2, generator=generator) for _ in range(3)]
    dtensors = [DTensor.from_local(tensor.clone(), mesh, [placement])
                for tensor, placement in zip(locals_, (Shard(0), Replicate(), Partial()))]
    plain = [tensor.clone() for tensor in locals_]
    clip_grad_by_total_norm_fp32(dtensors, max_norm=0.5, total_norm=2.0)
    clip_grad_by_total_norm_fp32(plain, max_norm=0.5, total_norm=2.0)
    unclipped = [tensor.clone() for tensor in locals_]
    clip_grad_by_total_norm_fp32(unclipped, max_norm=5.0, total_norm=2.0)  # under max_norm: untouched
    return ([torch.equal(d.to_local(), p) for d, p in zip(dtensors, plain)],
            [torch.equal(p, t * (0.5 / (2.0 + 1.0e-6))) for p, t in zip(plain, locals_)],
            [torch.equal(u, t) for u, t in zip(unclipped, locals_)],
            [type(d).__name__ for d in dtensors])


def test_clipping_scales_dtensor_gradients_as_their_local_values():
    for same, scaled, untouched, types in run_on_ranks(2, _clipped_dtensor_and_plain):
        assert same == scaled == untouched == [True, True, True]
        assert types == ["DTensor"] * 3
