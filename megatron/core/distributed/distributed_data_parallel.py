"""`DistributedDataParallel`: gradients accumulate into flat per-dtype buffers and are reduced bucket by bucket.

Each parameter gets `param.main_grad`, a view into its buffer. A post-accumulate-grad hook adds `param.grad`
into it and frees `param.grad`. With `overlap_grad_reduce` a bucket's reduction starts as soon as every
parameter in it has its gradient (buckets are issued in one fixed order on all ranks, which collectives
require); otherwise everything is reduced in `finish_grad_sync()`. Inside `no_sync()` gradients only
accumulate. Gradients are pre-scaled by 1/DP before a SUM (gloo has no PREMUL_SUM), or averaged by the
collective with `average_in_collective`.

Mixture-of-Experts expert parameters (`allreduce=False`, see `megatron.core.expert_parameters`) get buffers of
their own, reduced (and, with the distributed optimizer, sharded) over the expert data-parallel group with the
same 1/(DP x CP) scaling as the dense gradients: an expert's gradient already sums the tokens that every
expert-parallel rank sent it (with `average_in_collective`: AVG's 1/expert-DP times a pre-scale of
expert-DP/DP). With several distributed-optimizer instances, dense and expert buffers alike are
sharded (reduce-scattered) inside an instance and all-reduced across the instances.
"""

from contextlib import contextmanager

import torch
import torch.distributed as dist

from megatron.core.distributed.data_parallel_base import DataParallelWrapper, tensor_bytes
from megatron.core.distributed.distributed_data_parallel_config import DistributedDataParallelConfig
from megatron.core.distributed.param_and_grad_buffer import BucketCommunicationGroups, ParamAndGradBuffer
from megatron.core.expert_parameters import expert_data_parallel_group, is_expert_parameter
from megatron.core.fused_weight_grad import is_untouched_placeholder
from megatron.core.timers import timed

DEFAULT_OVERLAP_BUCKET_SIZE = 40_000_000


def _default_groups(ddp_config):
    """DP(+CP) groups from parallel state when it is initialised, else the whole world."""
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return BucketCommunicationGroups(dist.group.WORLD)
    data_parallel_group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    if ddp_config.num_distributed_optimizer_instances > 1:
        return BucketCommunicationGroups(
            data_parallel_group,
            shard_group=parallel_state.get_inner_data_parallel_group(),
            outer_group=parallel_state.get_outer_data_parallel_group(),
        )
    return BucketCommunicationGroups(data_parallel_group)


def _default_expert_groups(ddp_config):
    """The expert data-parallel group (the ranks holding the same experts); with several distributed-optimizer
    instances, sharded over its ranks in this instance and all-reduced across the instances (parallel_state's
    inner and outer expert data-parallel groups, which refuse an instance count not dividing expert DP)."""
    from megatron.core import parallel_state

    if ddp_config.num_distributed_optimizer_instances > 1 and parallel_state.model_parallel_is_initialized():
        return BucketCommunicationGroups(
            parallel_state.get_expert_data_parallel_group(),
            shard_group=parallel_state.get_expert_data_parallel_group(partial_expert_data_parallel=True),
            outer_group=parallel_state.get_outer_expert_data_parallel_group(),
        )
    return BucketCommunicationGroups(expert_data_parallel_group())


def _pg_collection_group(pg_collection, name, purpose):
    group = getattr(pg_collection, name, None)
    if group is None:
        raise ValueError(
            f"DistributedDataParallel(pg_collection=...): {purpose} needs pg_collection.{name}; set it, or pass "
            "pg_collection=None to use parallel_state's groups."
        )
    return group


def _groups_from_pg_collection(pg_collection, ddp_config):
    """Upstream's `pg_collection` (a `ProcessGroupCollection`, or any object with its attribute names): `dp_cp`
    for the reduction; with several distributed-optimizer instances `intra_dp_cp` (sharding) and `inter_dist_opt`
    (across instances). Returns the dense groups and a function giving the expert ones (`expt_dp`), asked for
    only when the model has expert parameters."""
    hybrid = ddp_config.num_distributed_optimizer_instances > 1
    hybrid_purpose = "num_distributed_optimizer_instances > 1"
    data_parallel_group = _pg_collection_group(pg_collection, "dp_cp", "the data-parallel gradient reduction")
    if hybrid:
        groups = BucketCommunicationGroups(
            data_parallel_group,
            shard_group=_pg_collection_group(pg_collection, "intra_dp_cp", hybrid_purpose),
            outer_group=_pg_collection_group(pg_collection, "inter_dist_opt", hybrid_purpose),
        )
    else:
        groups = BucketCommunicationGroups(data_parallel_group)

    def expert_groups():
        if hybrid:
            raise ValueError(
                "DistributedDataParallel(pg_collection=...) with expert parameters and "
                "num_distributed_optimizer_instances > 1 is not supported; pass pg_collection=None to use "
                "parallel_state's expert data-parallel groups."
            )
        return BucketCommunicationGroups(
            _pg_collection_group(pg_collection, "expt_dp", "reducing the expert parameters' gradients"))

    return groups, expert_groups


class DistributedDataParallel(DataParallelWrapper):
    """Wraps `module`; `config` is the model's (Transformer/ModelParallel) config, `ddp_config` the DDP one.

    Build it through `megatron.core.distributed.wrap_data_parallel` to have the config pick the wrapper; the
    config rules (e.g. `fp8_param_gather` needs `use_distributed_optimizer`) are checked by the config.

    The process groups come from parallel_state (the world when it is not initialised), from upstream's
    `pg_collection`, or from `groups` / `expert_groups` given directly."""

    def __init__(self, config, ddp_config: DistributedDataParallelConfig, module, disable_bucketing=False,
                 pg_collection=None, *, groups: BucketCommunicationGroups = None,
                 expert_groups: BucketCommunicationGroups = None):
        super().__init__(config, ddp_config)
        expert_groups_from_collection = None
        if pg_collection is not None:
            if groups is not None or expert_groups is not None:
                raise ValueError("DistributedDataParallel: give pg_collection or groups/expert_groups, not both.")
            groups, expert_groups_from_collection = _groups_from_pg_collection(pg_collection, ddp_config)
        if ddp_config.fp8_param_gather and not getattr(config, "fp8", None):
            # A rule between the model config and this one: neither config sees the other.
            raise ValueError(
                "DistributedDataParallel: ddp_config.fp8_param_gather (--fp8-param-gather) gathers the weights of "
                "FP8 layers, but the model config has no FP8 format; set --fp8-format (config.fp8) or drop it."
            )
        self.module = module
        self.groups = groups if groups is not None else _default_groups(ddp_config)
        self.data_parallel_group = self.groups.data_parallel_group
        data_parallel_size = dist.get_world_size(self.data_parallel_group)

        bucket_size = ddp_config.bucket_size
        if bucket_size is None and ddp_config.overlap_grad_reduce:
            bucket_size = max(DEFAULT_OVERLAP_BUCKET_SIZE, 1_000_000 * data_parallel_size)
        if disable_bucketing:
            bucket_size = None
        self.bucket_size = bucket_size

        per_token_loss = getattr(config, "calculate_per_token_loss", False)
        # Per-token losses are divided by the global token count in finalize_model_grads; AVG divides itself.
        averaged_by_collective = per_token_loss or ddp_config.average_in_collective
        gradient_scaling_factor = 1.0 if averaged_by_collective else 1.0 / data_parallel_size

        param_names = {param: name for name, param in module.named_parameters()}
        self._param_names = param_names
        params_by_dtype = {}
        fp8_weights = set()
        if ddp_config.fp8_param_gather:
            from megatron.core.fp8.params import fp8_weight_params

            fp8_weights = set(fp8_weight_params(module, config))
        for param in reversed(list(module.parameters())):
            if not param.requires_grad:
                continue
            grad_dtype = torch.float32 if ddp_config.grad_reduce_in_fp32 else param.dtype
            key = (is_expert_parameter(param), param.dtype, grad_dtype, param in fp8_weights)
            params_by_dtype.setdefault(key, []).append(param)
        self.expert_groups = None
        if any(is_expert for is_expert, *_ in params_by_dtype):
            if expert_groups is None and expert_groups_from_collection is not None:
                expert_groups = expert_groups_from_collection()
            self.expert_groups = expert_groups if expert_groups is not None else _default_expert_groups(ddp_config)
        expert_gradient_scaling_factor = gradient_scaling_factor
        if self.expert_groups is not None and ddp_config.average_in_collective and not per_token_loss:
            # AVG over the expert data-parallel group divides by its size, DP / EP: expert gradients need 1 / DP too.
            expert_data_parallel_size = dist.get_world_size(self.expert_groups.data_parallel_group)
            expert_gradient_scaling_factor = expert_data_parallel_size / data_parallel_size
        # Dense buffers first, then the experts': the same order on every rank.
        self.buffers = [
            ParamAndGradBuffer(ddp_config, params, param_dtype, grad_dtype, bucket_size,
                               self.expert_groups if is_expert else self.groups,
                               expert_gradient_scaling_factor if is_expert else gradient_scaling_factor,
                               param_names, fp8_config=config if is_fp8 else None)
            for (is_expert, param_dtype, grad_dtype, is_fp8), params in sorted(
                params_by_dtype.items(), key=lambda item: item[0][0])
        ]
        # One global issue order for all buckets of all buffers: every rank must start collectives in the same order.
        self._buckets = [bucket for buffer in self.buffers for bucket in buffer.buckets]
        self._param_to_bucket = {
            param: bucket for buffer in self.buffers for param, bucket in buffer.param_to_bucket.items()
        }
        self._next_bucket_to_start = 0
        self._ready_buckets = set()
        self.is_last_microbatch = True

        # Parameters frozen when wrapped have no main_grad: a gradient they get later is not reduced.
        self._params_outside_buffers = [param for param in module.parameters() if param not in self._param_to_bucket]

        self._hook_handles = [
            param.register_post_accumulate_grad_hook(self._accumulate_into_main_grad)
            for param in self._param_to_bucket
        ]
        self._forward_pre_hook_handles = []
        if ddp_config.overlap_param_gather:
            self.enable_forward_pre_hook()

    # ---- hooks -------------------------------------------------------------------------------------------------
    def _accumulate_into_main_grad(self, param):
        if self._param_to_bucket[param].grad_sync_started:
            raise RuntimeError(
                f"DistributedDataParallel: a gradient for {self._param_names[param]} arrived after its bucket's "
                "reduction started; run earlier microbatches under no_sync() and call zero_grad_buffer() "
                "before each step."
            )
        # A fused weight-gradient kernel has already added its share into main_grad and contributed zeros to
        # param.grad; what param.grad holds beyond them is the sum of the other uses of the parameter (e.g. the
        # embedding lookup of a weight tied to the output layer), so it is added unless it is still those zeros.
        if param.grad is not None and not is_untouched_placeholder(param):
            param.main_grad.add_(param.grad)
        param.grad = None
        param.grad_added_to_main_grad = False
        if self.ddp_config.overlap_grad_reduce and self.is_last_microbatch:
            bucket = self._param_to_bucket[param]
            if bucket.register_grad_ready(param):
                self._ready_buckets.add(id(bucket))
                self._start_ready_buckets_in_order()

    def _start_ready_buckets_in_order(self):
        while self._next_bucket_to_start < len(self._buckets):
            bucket = self._buckets[self._next_bucket_to_start]
            if id(bucket) not in self._ready_buckets:
                return
            bucket.start_grad_sync(async_op=True)
            self._next_bucket_to_start += 1

    def _wait_for_param_gather(self, submodule, args):
        for param in submodule.parameters(recurse=False):
            bucket = self._param_to_bucket.get(param)
            if bucket is not None and bucket.param_sync_pending():
                bucket.finish_param_sync()

    # ---- public API ------------------------------------------------------------------------------------------
    @contextmanager
    def no_sync(self):
        """Accumulate gradients locally; the reduction happens after the first backward outside the context."""
        self.is_last_microbatch = False
        try:
            yield
        finally:
            self.is_last_microbatch = True

    def start_grad_sync(self, *unused):
        """Start reducing every bucket not yet started (asynchronously), in the fixed bucket order. Positional
        arguments (the parameters upstream's schedules pass to `config.grad_sync_func`) are ignored."""
        for bucket in self._buckets[self._next_bucket_to_start:]:
            bucket.start_grad_sync(async_op=True)
        self._next_bucket_to_start = len(self._buckets)

    def finish_grad_sync(self):
        """Complete all gradient reductions; afterwards every `main_grad` (or owned shard) is reduced."""
        self._check_no_gradient_outside_buffers()
        self.finish_param_sync()
        for bucket in self._buckets[self._next_bucket_to_start:]:
            bucket.start_grad_sync(async_op=False)
        for bucket in self._buckets:
            bucket.finish_grad_sync()
        self._next_bucket_to_start = 0
        self._ready_buckets = set()
        for bucket in self._buckets:
            bucket.reset_grad_state()

    def _check_no_gradient_outside_buffers(self):
        for param in self._params_outside_buffers:
            if param.requires_grad and param.grad is not None:
                raise RuntimeError(
                    f"DistributedDataParallel: {self._param_names[param]} has a gradient, but it had "
                    "requires_grad=False when the model was wrapped, so it has no main_grad and its gradient is not "
                    "reduced over the data-parallel ranks; set requires_grad before wrapping the model in "
                    "DistributedDataParallel (parameters cannot be unfrozen after wrapping)."
                )

    def zero_grad_buffer(self):
        """Zero all main grads and forget this step's communication state (call before each step)."""
        for param in self._param_to_bucket:
            param.grad = None
            param.grad_added_to_main_grad = False
        for buffer in self.buffers:
            buffer.reset()
        self._next_bucket_to_start = 0
        self._ready_buckets = set()

    def zero_grad(self, set_to_none: bool = True):
        """torch's `Module.zero_grad`, which also zeroes the gradient buffers: the gradients live in `main_grad`
        (same as `zero_grad_buffer()`)."""
        super().zero_grad(set_to_none=set_to_none)
        self.zero_grad_buffer()

    def scale_gradients(self, scaling_factor):
        for buffer in self.buffers:
            buffer.scale_gradients(scaling_factor)

    def start_param_sync(self, *unused, force_sync=False, force_dispatch=False):
        """All-gather updated parameter shards (distributed optimizer); async with overlap_param_gather.

        Upstream's signature: positional arguments (the parameters upstream's schedules pass to
        `config.param_sync_func`) are ignored, and so is `force_dispatch`, which only matters with
        --overlap-param-gather-with-optimizer-step (not offered here)."""
        async_op = self.ddp_config.overlap_param_gather and not force_sync
        if async_op:
            for bucket in self._buckets:
                bucket.start_param_sync(async_op=True)
            return
        # The synchronous gather after the optimizer step is timed as `params-all-gather` (level 1).
        timers = getattr(self.config, "timers", None) if self.ddp_config.use_distributed_optimizer else None
        barrier = getattr(self.config, "barrier_with_L1_time", False)
        with timed(timers, "params-all-gather", log_level=1, barrier=barrier):
            for bucket in self._buckets:
                bucket.start_param_sync(async_op=False)
            self.finish_param_sync()

    def _check_forward_pre_hooks_in_use(self, method):
        if not self.ddp_config.overlap_param_gather:
            raise RuntimeError(
                f"DistributedDataParallel.{method}(): the forward pre-hooks wait for parameter all-gathers, which "
                "only overlap_param_gather=True (--overlap-param-gather) uses; call it only with that setting."
            )

    def enable_forward_pre_hook(self):
        """Install the forward pre-hooks that wait for each module's parameter all-gather (with
        `overlap_param_gather`, where the wrapper installs them itself; again after `disable_forward_pre_hook`)."""
        self._check_forward_pre_hooks_in_use("enable_forward_pre_hook")
        if self._forward_pre_hook_handles:
            raise RuntimeError("DistributedDataParallel.enable_forward_pre_hook(): the hooks are already installed; "
                               "call disable_forward_pre_hook() first.")
        for submodule in self.module.modules():
            if any(True for _ in submodule.parameters(recurse=False)):
                self._forward_pre_hook_handles.append(submodule.register_forward_pre_hook(self._wait_for_param_gather))

    def disable_forward_pre_hook(self, param_sync=True):
        """Remove the forward pre-hooks (as upstream's loop does around evaluation and checkpointing); with
        `param_sync`, complete the parameter all-gather now so that the model holds the updated weights."""
        self._check_forward_pre_hooks_in_use("disable_forward_pre_hook")
        if not self._forward_pre_hook_handles:
            raise RuntimeError("DistributedDataParallel.disable_forward_pre_hook(): the hooks are not installed; "
                               "call enable_forward_pre_hook() first.")
        for handle in self._forward_pre_hook_handles:
            handle.remove()
        self._forward_pre_hook_handles = []
        if param_sync:
            self.start_param_sync(force_sync=True)

    def finish_param_sync(self):
        """Wait for the parameter all-gathers `start_param_sync` started."""
        for bucket in self._buckets:
            bucket.finish_param_sync()

    def broadcast_params(self):
        """Copy DP rank 0's parameters to every data-parallel replica (expert parameters: expert-DP rank 0's to
        the ranks holding the same experts)."""
        with torch.no_grad():
            for param in self.module.parameters():
                group = self.data_parallel_group
                if is_expert_parameter(param) and self.expert_groups is not None:
                    group = self.expert_groups.data_parallel_group
                dist.broadcast(param.data, src=dist.get_global_rank(group, 0), group=group)

    def state_bytes(self):
        """What this rank holds for the model: its flat gradient buffers, bucket padding included; with the
        distributed optimizer its flat parameter buffers, which hold the bucketed parameters, else those
        parameters; and the parameters outside any buffer (frozen ones) with their gradients if any. The
        optimizer's main weights and state are counted from the optimizer by the memory line. Under
        `--fp8-param-gather` the FP8 bytes and scales of the FP8 layers' weights are compute weights too
        (upstream's FP8 parameters): `params_bytes`."""
        params_bytes = grads_bytes = 0
        for buffer in self.buffers:
            grads_bytes += tensor_bytes(buffer.grad_data)
            if buffer.param_data is not None:
                params_bytes += tensor_bytes(buffer.param_data)
            fp8_storage = getattr(buffer, "fp8_storage", None)
            if fp8_storage is not None:
                params_bytes += tensor_bytes(fp8_storage.data) + sum(
                    tensor_bytes(scale) for scale in fp8_storage.scales.values())
        buffer_of = {param: buffer for buffer in self.buffers for param in buffer.params}
        for param in self.module.parameters():
            buffer = buffer_of.get(param)
            if buffer is None or buffer.param_data is None:
                params_bytes += tensor_bytes(param)
            if buffer is None and param.grad is not None:
                grads_bytes += tensor_bytes(param.grad)
        return {"params_bytes": params_bytes, "grads_bytes": grads_bytes}
