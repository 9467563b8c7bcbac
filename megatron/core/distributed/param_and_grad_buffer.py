"""Flat gradient (and parameter) storage for DDP, cut into buckets that are reduced as one collective each.

Layout: parameters are laid out one after another in the order given (DDP passes them in reverse, roughly
the order their gradients appear in backward). A bucket closes once it holds at least `bucket_size` elements
and is padded so its length divides the data-parallel shard count (with the distributed optimizer and
`pad_buckets_for_high_nccl_busbw`, lcm(shard count, 128, 2**16)); every parameter's `main_grad` (and, with
the distributed optimizer, its `.data`) is a view into the flat buffer. With the distributed optimizer, rank
`r` of the shard group owns elements `[r * n / D, (r + 1) * n / D)` of every bucket of length `n`.

Communication: `Bucket.start_grad_sync` reduces a bucket (all-reduce, or reduce-scatter with the distributed
optimizer), `Bucket.start_param_sync` all-gathers the updated parameter shards; both may run asynchronously
and are completed by the matching `finish_*` call. A buffer of FP8 weights (`--fp8-param-gather`, see
`megatron.core.fp8.params`) all-gathers their FP8 bytes instead of the high-precision values.
"""

import logging
import math

import torch
import torch.distributed as dist

from megatron.core.rerun_state_machine import get_rerun_state_machine

logger = logging.getLogger(__name__)

# --check-for-large-grads (upstream's values): a bucket's gradient norm this many times the largest of the first
# bucket norms is rejected; a rerun within this relative difference reproduces it (reduction orders may vary).
LARGE_GRADS_FACTOR = 10
LARGE_GRADS_TOLERANCE = 1e-3


def _as_float(result):
    return float(result.item() if torch.is_tensor(result) else result)


def _is_gloo(group):
    return "gloo" in str(dist.get_backend(group)).lower()


def _world_size(group):
    return 1 if group is None else dist.get_world_size(group)


def _rank(group):
    return 0 if group is None else dist.get_rank(group)


class BucketCommunicationGroups:
    """Who a bucket talks to.

    `data_parallel_group` spans every replica of the gradients; `shard_group` is the group the distributed
    optimizer shards over (the whole DP group, or its inner part under hybrid sharding, with
    `outer_group` connecting the shard-group replicas).
    """

    def __init__(self, data_parallel_group, shard_group=None, outer_group=None):
        self.data_parallel_group = data_parallel_group
        self.shard_group = shard_group if shard_group is not None else data_parallel_group
        self.outer_group = outer_group if _world_size(outer_group) > 1 else None


class Bucket:
    """A contiguous slice of the buffer holding whole parameters; the unit of communication."""

    def __init__(self, bucket_id, params, offset, numel, grad_data, param_data, buffer):
        self.bucket_id = bucket_id
        self.params = params
        self.offset = offset
        self.numel = numel
        self.grad_data = grad_data
        self.param_data = param_data
        self.buffer = buffer
        self._params_with_grad = set()
        self._grad_works = []
        self._fp32_staging = None  # the fp32 copy a bucket is reduced in (reduce_scatter_with_fp32_accumulation)
        self._param_gather_works = []
        self._fp8_install_pending = False
        self.grad_sync_started = False

    # ---- sharding arithmetic --------------------------------------------------------------------------------
    def shard_size(self):
        return self.numel // _world_size(self.buffer.groups.shard_group)

    def local_shard_range(self):
        """This rank's `[start, end)` within the bucket (bucket-relative)."""
        shard_size = self.shard_size()
        start = _rank(self.buffer.groups.shard_group) * shard_size
        return start, start + shard_size

    # ---- gradient reduction ---------------------------------------------------------------------------------
    def register_grad_ready(self, param):
        """Records that `param`'s gradient is final for this step; True once the whole bucket is ready."""
        self._params_with_grad.add(param)
        return len(self._params_with_grad) == len(self.params)

    def start_grad_sync(self, async_op):
        if self.grad_sync_started:
            return
        self.grad_sync_started = True
        config = self.buffer.ddp_config
        if config.check_for_nan_in_grad or config.check_for_large_grads:
            self._check_grads(config)
        if self.buffer.gradient_scaling_factor != 1.0:
            self.grad_data.mul_(self.buffer.gradient_scaling_factor)
        op = dist.ReduceOp.AVG if config.average_in_collective else dist.ReduceOp.SUM
        groups = self.buffer.groups
        reduced = self.grad_data
        if config.reduce_scatter_with_fp32_accumulation and reduced.dtype != torch.float32:
            # Copied back into the bucket by finish_grad_sync, once the collectives are done.
            self._fp32_staging = reduced = self.grad_data.float()
        if not config.use_distributed_optimizer:
            if _world_size(groups.data_parallel_group) > 1:
                self._grad_works.append(
                    dist.all_reduce(reduced, op=op, group=groups.data_parallel_group, async_op=async_op)
                )
        elif _is_gloo(groups.data_parallel_group):
            # gloo's reduce-scatter is several times slower than its all-reduce of the same size (measured),
            # so reduce everything; the shard this rank owns then holds exactly the reduce-scatter result.
            if _world_size(groups.data_parallel_group) > 1:
                self._grad_works.append(
                    dist.all_reduce(reduced, op=op, group=groups.data_parallel_group, async_op=async_op)
                )
        else:
            start, end = self.local_shard_range()
            shard = reduced[start:end]
            if _world_size(groups.shard_group) > 1:
                self._grad_works.append(
                    dist.reduce_scatter_tensor(
                        shard, reduced, op=op, group=groups.shard_group, async_op=async_op
                    )
                )
            if groups.outer_group is not None:
                # Issued after the reduce-scatter on the same device stream, so it sees the reduced shard.
                self._grad_works.append(dist.all_reduce(shard, op=op, group=groups.outer_group, async_op=async_op))
        self._grad_works = [work for work in self._grad_works if work is not None]

    def finish_grad_sync(self):
        if not self.grad_sync_started:
            self.start_grad_sync(async_op=False)
        for work in self._grad_works:
            work.wait()
        self._grad_works = []
        if self._fp32_staging is not None:
            self.grad_data.copy_(self._fp32_staging)
            self._fp32_staging = None

    def reset_grad_state(self):
        self._params_with_grad = set()
        self._grad_works = []
        self._fp32_staging = None
        self.grad_sync_started = False

    def _check_grads(self, config):
        norm = self.grad_data.float().norm()
        rank = dist.get_rank() if dist.is_initialized() else 0
        norm_value = norm.item() if config.check_for_nan_in_grad else 0.0
        if not math.isfinite(norm_value):
            kind = "NaN" if math.isnan(norm_value) else "Inf"
            culprits = [param for param in self.params if not torch.isfinite(param.main_grad).all()]
            where = (f"non-finite gradients in: {self._names(culprits)}" if culprits else
                     "every gradient is finite, their squared sum overflows fp32")
            raise RuntimeError(
                f"Rank {rank}: found {kind} in local grad norm ({norm_value}) of bucket {self.bucket_id} before the "
                f"data-parallel reduction; {where}."
            )
        if config.check_for_large_grads:
            self._check_for_large_grads(norm)

    def _check_for_large_grads(self, norm):
        """As upstream: the rerun state machine rejects (not fatally) a bucket norm >= 10x the largest of the first
        100 bucket norms (context "grads"); its mode decides what a rejection does (see rerun_state_machine)."""
        machine = get_rerun_state_machine()

        def is_large(result):
            large = machine.is_unexpectedly_large(result, threshold=LARGE_GRADS_FACTOR, context="grads")
            if large:
                largest = sorted(self.params, key=lambda param: -param.main_grad.float().norm().item())[:4]
                logger.warning(f"bucket {self.bucket_id}: local grad norm {_as_float(result):.3e}; largest "
                               f"gradients in: {self._names(largest)}")
            return large

        machine.validate_result(
            norm, is_large,
            message=f"found unexpectedly large grads in bucket #{self.bucket_id} in backward pass before "
            "data-parallel communication collective",
            tolerance=LARGE_GRADS_TOLERANCE, fatal=False,
        )

    def _names(self, params):
        return ", ".join(self.buffer.param_names[param] for param in params)

    # ---- parameter all-gather (distributed optimizer) ---------------------------------------------------------
    def start_param_sync(self, async_op):
        shard_group = self.buffer.groups.shard_group
        fp8_storage = self.buffer.fp8_storage
        if fp8_storage is not None:
            self._fp8_install_pending = True
        if self.param_data is None or _world_size(shard_group) == 1 or self._param_gather_works:
            return
        # FP8 weights travel as their bytes (uint8: gloo rejects float8 dtypes).
        gathered = self.param_data if fp8_storage is None else fp8_storage.data[self.offset:self.offset + self.numel]
        start, end = self.local_shard_range()
        # The input is a copy: gathering a tensor into a buffer that contains it is not safe on every backend.
        local_shard = gathered[start:end].clone()
        work = dist.all_gather_into_tensor(gathered, local_shard, group=shard_group, async_op=async_op)
        if work is not None:
            self._param_gather_works.append(work)

    def finish_param_sync(self):
        for work in self._param_gather_works:
            work.wait()
        self._param_gather_works = []
        if self._fp8_install_pending:
            self._fp8_install_pending = False
            self.buffer.fp8_storage.install(self.params, self.buffer.param_index_map)

    def param_sync_pending(self):
        return bool(self._param_gather_works) or self._fp8_install_pending


class ParamAndGradBuffer:
    """Flat storage for the gradients (and, with the distributed optimizer, the values) of same-dtype params."""

    def __init__(self, ddp_config, params, param_dtype, grad_dtype, bucket_size, groups, gradient_scaling_factor,
                 param_names=None, fp8_config=None):
        """`fp8_config`: the model config of FP8 weights (`--fp8-param-gather`); the buffer then also keeps
        their FP8 bytes and scales (`fp8_storage`) and all-gathers those."""
        self.ddp_config = ddp_config
        self.param_dtype = param_dtype
        self.grad_dtype = grad_dtype
        self.groups = groups
        self.gradient_scaling_factor = gradient_scaling_factor
        self.param_names = param_names or {param: f"param{index}" for index, param in enumerate(params)}
        self.params = list(params)
        device = self.params[0].device

        bucket_bounds, self.param_index_map = self._layout(self.params, bucket_size)
        self.numel = bucket_bounds[-1][1] if bucket_bounds else 0
        self.grad_data = torch.zeros(self.numel, dtype=grad_dtype, device=device)
        self.param_data = None
        if ddp_config.use_distributed_optimizer:
            self.param_data = torch.zeros(self.numel, dtype=param_dtype, device=device)
        self.fp8_storage = None
        if fp8_config is not None:
            from megatron.core.fp8.params import Fp8ParamStorage

            self.fp8_storage = Fp8ParamStorage.from_config(self.numel, device, fp8_config)

        for param in self.params:
            start, end, _ = self.param_index_map[param]
            if self.param_data is not None:
                with torch.no_grad():
                    self.param_data[start:end].copy_(param.data.reshape(-1))
                param.data = self.param_data[start:end].view(param.shape)
            param.main_grad = self.grad_data[start:end].view(param.shape)

        self.buckets = []
        for bucket_id, (start, end) in enumerate(bucket_bounds):
            bucket_params = [p for p in self.params if self.param_index_map[p][2] == bucket_id]
            self.buckets.append(
                Bucket(
                    bucket_id,
                    bucket_params,
                    start,
                    end - start,
                    self.grad_data[start:end],
                    None if self.param_data is None else self.param_data[start:end],
                    self,
                )
            )
        self.param_to_bucket = {param: self.buckets[index] for param, (_, _, index) in self.param_index_map.items()}

    def _pad_divisor(self):
        shard_count = _world_size(self.groups.shard_group)
        if self.ddp_config.pad_buckets_for_high_nccl_busbw and self.ddp_config.use_distributed_optimizer:
            # As upstream: bucket lengths divisible by 2**16 as well, for NCCL's bus bandwidth on the
            # reduce-scatter and all-gather of large data-parallel groups (at most that many padding elements).
            return math.lcm(shard_count, 128, 2**16)
        return shard_count

    def _layout(self, params, bucket_size):
        """Returns bucket bounds `[(start, end)]` and `{param: (start, end, bucket_id)}`."""
        divisor = self._pad_divisor()
        separate_shared_embedding = self.ddp_config.use_distributed_optimizer
        bounds, index_map = [], {}
        bucket_start, offset, open_params = 0, 0, []

        def close_bucket():
            nonlocal bucket_start, offset, open_params
            offset = -(-offset // divisor) * divisor
            bounds.append((bucket_start, offset))
            bucket_start, open_params = offset, []

        for param in params:
            # A shared embedding gets a bucket of its own so that the first and last pipeline stages shard it
            # identically and can all-reduce its gradient shard after the data-parallel reduce-scatter.
            is_shared_embedding = separate_shared_embedding and getattr(param, "shared_embedding", False)
            if is_shared_embedding and open_params:
                close_bucket()
            index_map[param] = (offset, offset + param.numel(), len(bounds))
            offset += param.numel()
            open_params.append(param)
            if is_shared_embedding or (bucket_size is not None and offset - bucket_start >= bucket_size):
                close_bucket()
        if open_params:
            close_bucket()
        return bounds, index_map

    def local_shard_ranges(self, param):
        """The part of `param` owned by this rank: `(param_start, param_end, buffer_start)` or None."""
        start, end, bucket_id = self.param_index_map[param]
        bucket = self.buckets[bucket_id]
        shard_start, shard_end = bucket.local_shard_range()
        shard_start += bucket.offset
        shard_end += bucket.offset
        overlap_start, overlap_end = max(start, shard_start), min(end, shard_end)
        if overlap_start >= overlap_end:
            return None
        return overlap_start - start, overlap_end - start, overlap_start

    def reset(self):
        self.grad_data.zero_()
        for bucket in self.buckets:
            bucket.reset_grad_state()

    def scale_gradients(self, factor):
        self.grad_data.mul_(factor)
