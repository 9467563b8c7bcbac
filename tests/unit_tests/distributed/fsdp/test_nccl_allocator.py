"""NCCL user buffers (nccl_allocator.py): which allocator a wrapper gets, the pool's registration bookkeeping
(against a fake NCCL backend that records the calls), the hooks that route Megatron-FSDP's buffers through it
(training is unchanged), and the double-buffer pool's fallback. On a GPU (`gpu` tests, one rank, one-rank NCCL
group): buffers come from the pool, collectives on them are right, and a ZeRO-3 model with NCCL user buffers
trains the same losses as without."""

import contextlib

import pytest
import torch

from tests.unit_tests.distributed.fsdp import fsdp_test_models as models
from tests.unit_tests.multiprocess_harness import run_on_ranks

NUM_STEPS = 3


class FakeNcclBackend:
    """Records register / deregister calls as ProcessGroupNCCL would receive them."""

    def __init__(self, calls):
        self.calls = calls

    def register_mem_pool(self, pool, symm=False):
        """register_mem_pool(self, pool, symm: bool = False) -> None"""
        self.calls.append(("register", pool, symm))

    def deregister_mem_pool(self, pool):
        self.calls.append(("deregister", pool))


class CountingPool:
    """Stands in for `torch.cuda.use_mem_pool(pool)`: counts the allocation blocks entered."""

    def __init__(self):
        self.entered = 0

    @contextlib.contextmanager
    def use(self):
        self.entered += 1
        yield


def _pooled(manual, symmetric=True, warm_ups=None):
    from megatron_fsdp.nccl_allocator import PooledBuffers

    calls, routing = [], CountingPool()
    allocator = PooledBuffers("pool", [FakeNcclBackend(calls)], routing.use, manual_registration=manual,
                              symmetric=symmetric,
                              warm_up=(lambda: warm_ups.append(len(calls))) if warm_ups is not None else None)
    return allocator, calls, routing


def test_registration_after_each_allocation_block():
    warm_ups = []
    allocator, calls, routing = _pooled(manual=False, warm_ups=warm_ups)
    with allocator.buffers():
        assert calls == [] and routing.entered == 1
    assert calls == [("register", "pool", True)] and allocator.registered and warm_ups == [0]
    with allocator.buffers():  # the registration of the existing segments is dropped while the pool grows
        assert calls[-1] == ("deregister", "pool") and not allocator.registered
    assert calls[-1] == ("register", "pool", True) and allocator.registrations == 2
    with allocator.transient():  # a step's allocations use the pool without touching its registration
        pass
    allocator.buffers_built()
    assert len(calls) == 3 and routing.entered == 3 and warm_ups == [0]


def test_manual_registration_registers_once_after_the_buffers():
    allocator, calls, routing = _pooled(manual=True, symmetric=False)
    for _ in range(3):
        with allocator.buffers():
            pass
    assert calls == [] and routing.entered == 3 and not allocator.registered
    allocator.buffers_built()
    allocator.buffers_built()
    assert calls == [("register", "pool", False)] and allocator.registrations == 1


def test_failed_allocation_registers_nothing():
    allocator, calls, _ = _pooled(manual=False)
    with pytest.raises(torch.OutOfMemoryError):
        with allocator.buffers():
            raise torch.OutOfMemoryError("no room")
    assert calls == [] and not allocator.registered


def test_symmetric_registration_detected_from_the_signature():
    from megatron_fsdp.nccl_allocator import symmetric_registration_supported

    class OldBackend:
        def register_mem_pool(self, pool):
            """register_mem_pool(self, pool: torch._C._MemPool) -> None"""

    assert symmetric_registration_supported(FakeNcclBackend([]))
    assert not symmetric_registration_supported(OldBackend())


def test_missing_pool_api_is_named(monkeypatch):
    from megatron_fsdp import nccl_allocator

    monkeypatch.delattr(torch.cuda, "use_mem_pool")
    assert nccl_allocator._missing_api([object()]) == [
        "ProcessGroupNCCL.deregister_mem_pool", "ProcessGroupNCCL.register_mem_pool", "use_mem_pool"]
    assert nccl_allocator._missing_api([FakeNcclBackend([])]) == ["use_mem_pool"]


def test_no_options_or_cpu_device_allocate_plainly():
    from megatron_fsdp.nccl_allocator import NcclUserBuffers, UnpooledBuffers, buffer_allocator_for

    assert isinstance(buffer_allocator_for(None, [], torch.device("cuda")), UnpooledBuffers)
    plain = buffer_allocator_for(NcclUserBuffers(), [object()], torch.device("cpu"))
    assert isinstance(plain, UnpooledBuffers) and not plain.active
    assert plain.reason == "NCCL user buffers need a CUDA device; this wrapper runs on cpu"


def _chooser_on_gloo():
    import torch.distributed as dist

    from megatron_fsdp.nccl_allocator import NcclUserBuffers, buffer_allocator_for

    chosen = buffer_allocator_for(NcclUserBuffers(), [dist.group.WORLD, None], torch.device("cuda"))
    return type(chosen).__name__, chosen.reason


def _train(nccl_user_buffers, fake_pool, double_buffer=False, pool_fails=False, persist_on_fail=False):
    """ZeRO-3 training on the ranks; with `fake_pool` the wrapper gets a PooledBuffers over a fake backend."""
    import megatron_fsdp
    from megatron_fsdp import megatron_fsdp as wrapper_module
    from megatron_fsdp.nccl_allocator import PooledBuffers

    calls, routing = [], CountingPool()
    original_chooser, original_pool = wrapper_module.buffer_allocator_for, wrapper_module.DoubleBufferPool
    if fake_pool:
        wrapper_module.buffer_allocator_for = lambda options, groups, device: PooledBuffers(
            "pool", [FakeNcclBackend(calls)], routing.use, manual_registration=options.manual_registration,
            symmetric=options.symmetric)
    if pool_fails:
        class FailingPool(original_pool):
            def __init__(self, *args, **kwargs):
                raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        wrapper_module.DoubleBufferPool = FailingPool
    try:
        module = models.make_model(0)
        optimizer = models.make_optimizer(module.parameters())
        config = megatron_fsdp.DistributedDataParallelConfig(
            data_parallel_sharding_strategy=3, fsdp_double_buffer=double_buffer,
            fsdp_db_use_persist_buf_on_alloc_fail=persist_on_fail)
        model = megatron_fsdp.MegatronFSDP(module, config, fsdp_unit_modules=[models.Block],
                                           nccl_user_buffers=nccl_user_buffers)
        optimizer = megatron_fsdp.fully_shard_optimizer(optimizer)
        built = dict(calls=list(calls), entered=routing.entered, groups=len(model.groups),
                     allocator=type(model.buffer_allocator).__name__,
                     reason=getattr(model.buffer_allocator, "reason", None), pool=model.pool is not None)
        losses = models.train_sharded(model, optimizer, NUM_STEPS)
        return losses, built, dict(calls=list(calls), entered=routing.entered)
    finally:
        wrapper_module.buffer_allocator_for, wrapper_module.DoubleBufferPool = original_chooser, original_pool


def _through_fully_shard():
    """The package's entry point with NCCL user buffers on gloo: plain allocations, the same training."""
    import megatron_fsdp

    module = models.make_model(0)
    model, optimizer = megatron_fsdp.fully_shard(module, models.make_optimizer(module.parameters()),
                                                 fsdp_unit_modules=[models.Block],
                                                 nccl_user_buffers=megatron_fsdp.NcclUserBuffers())
    built = dict(allocator=type(model.buffer_allocator).__name__, reason=model.buffer_allocator.reason)
    return models.train_sharded(model, optimizer, NUM_STEPS), built, None


def _runs_on_gloo():
    from megatron_fsdp.nccl_allocator import NcclUserBuffers

    results = {"chooser": _chooser_on_gloo(), "plain": _train(None, False)}
    results["gloo"] = _through_fully_shard()
    results["auto"] = _train(NcclUserBuffers(), True, double_buffer=True)
    results["manual"] = _train(NcclUserBuffers(manual_registration=True, symmetric=False), True)
    results["double_buffer"] = _train(None, False, double_buffer=True)
    results["fallback"] = _train(None, False, double_buffer=True, pool_fails=True, persist_on_fail=True)
    try:
        _train(None, False, double_buffer=True, pool_fails=True)
    except torch.OutOfMemoryError as error:
        results["no_fallback"] = str(error)
    return results


@pytest.fixture(scope="module")
def gloo_runs():
    return run_on_ranks(2, _runs_on_gloo)[0]


def test_gloo_groups_allocate_plainly(gloo_runs):
    assert gloo_runs["chooser"] == ("UnpooledBuffers", "NCCL user buffers need every data-parallel group to run NCCL")
    losses, built, _ = gloo_runs["gloo"]
    assert built["allocator"] == "UnpooledBuffers" and built["reason"] == "NCCL user buffers need a CUDA device; " \
        "this wrapper runs on cpu"
    assert losses == gloo_runs["plain"][0]


def test_pooled_buffers_register_after_each_group_and_train_the_same(gloo_runs):
    losses, built, after = gloo_runs["auto"]
    # One allocation block per group plus the double-buffer pool, each followed by a registration (and,
    # from the second on, preceded by dropping the previous one).
    blocks = built["groups"] + 1
    assert built["entered"] == blocks
    assert built["calls"] == [("register", "pool", True)] + [("deregister", "pool"), ("register", "pool", True)] * (
        blocks - 1)
    # The steps' gathers and reductions allocate through the pool and register nothing.
    assert after["calls"] == built["calls"] and after["entered"] > blocks
    assert losses == gloo_runs["double_buffer"][0]


def test_manual_registration_registers_once_after_construction(gloo_runs):
    losses, built, after = gloo_runs["manual"]
    assert built["calls"] == [("register", "pool", False)] and built["entered"] == built["groups"]
    assert after["calls"] == built["calls"] and after["entered"] > built["entered"]
    assert losses == gloo_runs["plain"][0]


def test_double_buffer_pool_falls_back_to_group_buffers(gloo_runs):
    losses, built, _ = gloo_runs["fallback"]
    assert not built["pool"] and gloo_runs["double_buffer"][1]["pool"]
    assert losses == gloo_runs["plain"][0]
    assert gloo_runs["no_fallback"] == "CUDA out of memory (simulated)"


def test_fallback_flag_needs_double_buffer():
    import megatron_fsdp

    with pytest.raises(ValueError, match=r"^fsdp_db_use_persist_buf_on_alloc_fail=True is the fallback of "
                                         r"fsdp_double_buffer=True; set fsdp_double_buffer=True or drop it$"):
        megatron_fsdp.DistributedDataParallelConfig(data_parallel_sharding_strategy=3,
                                                    fsdp_db_use_persist_buf_on_alloc_fail=True)


# ---- GPU: one rank, a one-rank NCCL group -----------------------------------------------------------------------
def _in_pool(pool, tensor):
    return any(seg["address"] <= tensor.data_ptr() < seg["address"] + seg["total_size"] for seg in pool.snapshot())


def _nccl_group():
    import torch.distributed as dist

    torch.cuda.set_device(0)
    return dist.new_group(backend="nccl")


def _collectives_on_pool_buffers(symmetric):
    import torch.distributed as dist

    from megatron_fsdp.nccl_allocator import NcclUserBuffers, PooledBuffers, buffer_allocator_for

    group, device = _nccl_group(), torch.device("cuda", 0)
    allocator = buffer_allocator_for(NcclUserBuffers(symmetric=symmetric), [group], device)
    assert isinstance(allocator, PooledBuffers), allocator
    with allocator.buffers():
        send = torch.arange(1 << 16, dtype=torch.float32, device=device)
        gathered = torch.empty_like(send)
    with allocator.transient():
        reduced = torch.empty_like(send)
    dist.all_gather_into_tensor(gathered, send, group=group)
    dist.reduce_scatter_tensor(reduced, send * 3, group=group)
    torch.cuda.synchronize()
    expected = torch.arange(1 << 16, dtype=torch.float32, device=device)
    return dict(in_pool=[_in_pool(allocator.pool, t) for t in (send, gathered, reduced)],
                default_in_pool=_in_pool(allocator.pool, torch.empty(16, device=device)),
                gathered=bool(torch.equal(gathered, expected)), reduced=bool(torch.equal(reduced, expected * 3)),
                registered=allocator.registered, registrations=allocator.registrations,
                symmetric=allocator.symmetric, source=allocator.source)


@pytest.mark.gpu
@pytest.mark.parametrize("symmetric", [True, False])
def test_gpu_pool_buffers_carry_collectives(symmetric):
    result = run_on_ranks(1, _collectives_on_pool_buffers, symmetric)[0]
    assert result["in_pool"] == [True, True, True] and not result["default_in_pool"], result
    assert result["gathered"] and result["reduced"], result
    assert result["registered"] and result["registrations"] == 1, result
    # Window (symmetric) registration needs NCCL's own allocator; the fallback pool registers locally.
    assert result["symmetric"] == (symmetric and result["source"].startswith("NCCL")), result


def _train_on_gpu(nccl_user_buffers):
    from torch.distributed.device_mesh import DeviceMesh

    import megatron_fsdp

    group, device = _nccl_group(), torch.device("cuda", 0)
    mesh = DeviceMesh.from_group(group, "cuda", mesh_dim_names=("dp",))
    module = models.make_model(0)
    optimizer = models.make_optimizer(module.parameters())
    config = megatron_fsdp.DistributedDataParallelConfig(data_parallel_sharding_strategy=3, overlap_grad_reduce=True,
                                                         overlap_param_gather=True)
    model = megatron_fsdp.MegatronFSDP(module, config, device_mesh=mesh, dp_shard_dim="dp",
                                       fsdp_unit_modules=[models.Block], nccl_user_buffers=nccl_user_buffers)
    optimizer = megatron_fsdp.fully_shard_optimizer(optimizer)
    allocator = model.buffer_allocator
    losses = []
    for step, (inputs, target) in enumerate(models.make_batches(NUM_STEPS + 1)):
        loss = models.loss_fn(model(inputs.to(device)), target.to(device))
        losses.append(loss.item())
        if step < NUM_STEPS:
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    torch.cuda.synchronize()
    placement = None
    if allocator.active:
        group0 = model.groups[0]
        placement = dict(shard=_in_pool(allocator.pool, group0.compute_shard),
                         registrations=allocator.registrations, groups=len(model.groups),
                         registered=allocator.registered)
    return losses, type(allocator).__name__, placement


@pytest.mark.gpu
@pytest.mark.parametrize("manual", [False, True])
def test_gpu_zero3_with_nccl_user_buffers_trains_the_same(manual):
    from megatron_fsdp.nccl_allocator import NcclUserBuffers

    reference, kind, _ = run_on_ranks(1, _train_on_gpu, None)[0]
    assert kind == "UnpooledBuffers"
    losses, kind, placement = run_on_ranks(1, _train_on_gpu, NcclUserBuffers(manual_registration=manual))[0]
    assert kind == "PooledBuffers" and placement["shard"] and placement["registered"], placement
    assert placement["registrations"] == (1 if manual else placement["groups"]), placement
    # Same kernels on the same device in the same order: pooled buffers change where the bytes live, not the math.
    assert losses == pytest.approx(reference, abs=1e-6), (losses, reference)
