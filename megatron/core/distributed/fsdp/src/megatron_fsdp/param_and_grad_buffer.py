"""Flat storage of one parameter group: compute weights, fp32 main weights and gradients, and views into them.

Which tensors exist depends on the sharding strategy (S = shard size, N = padded group size = S * DP; the
row-aligned layout of layout.py: a rank's shard is its rows of every parameter):

| strategy            | compute weights          | main weights (optimizer)    | gradients                          |
|---------------------|--------------------------|-----------------------------|------------------------------------|
| 0 no_shard          | N, persistent            | N (is compute if same dtype)| N, persistent                      |
| 1 optim             | N, persistent            | S (rows of compute if same) | N persistent; reduced into a shard |
| 2 optim_grads       | N, persistent            | S (rows of compute if same) | S main + N transient in backward   |
| 3 optim_grads_params| S shard; N while gathered| S (is the shard if same)    | S main + N transient in backward   |

The compute weights are unsharded (param-major: contiguous full parameters); shards, main weights and the
gradient buffers that are reduce-scattered are rank-major. Under strategies 1/2 main weights in the compute
dtype are this rank's rows of the compute buffer (one view per parameter: the rows are not one slice of it),
and the post-step gather sends a shard assembled from them. A gather
lands in a transient rank-major staging buffer (unless the two forms coincide) and is copied out into the
compute buffer (`copy_gathered_into_compute`); gradients are copied in rank-major as they arrive
(`write_grad`).

A strategy-3 group sharded over one rank (S = N: experts at expert data-parallel size 1, say) is *resident*: its
compute buffer is its compute shard (and, in the main dtype, its main weights), never released, so gathering and
releasing it move no bytes; with no outer dim its gradients are added straight into the main gradients.

Under strategies 2/3 the S main gradients hold no storage from `zero_grad` until the first reduction of the
next backward (they are all zero then); they are counted at their full size in `persistent_bytes`.

HFSDP (strategy 3 with `outer_size` > 1) shards the optimizer's side once more over the outer ranks: main
weights and the gradients handed to the optimizer are sub-shards of S / outer_size elements (see layout.py).
The S main gradients are then only the target of the backward's reduce-scatters: `finish_grad_sync`
reduce-scatters them over the outer group into the sub-shard gradients and drops their storage, so they count
as transient. The S compute shard is a buffer of its own, refreshed from every outer rank's main weights by an
all-gather over the outer group after each optimizer step.

Model parameters are views into the flat compute buffer. Under strategy 3 the buffer's storage is resized to
zero when released and back when gathered, so the views (and any views autograd saved, such as `weight.t()`)
stay valid across gathers without re-pointing anything. Gradients arrive through a post-accumulate-grad hook
that writes `param.grad` into the flat gradient buffer and drops it, so gradients are reduced straight from
one flat buffer. The optimizer sees one view of the main weights per parameter: its rows, flattened
(strategies 1-3; under HFSDP the part of them in this outer rank's sub-shard) or the whole parameter
(strategy 0, original shape).

A group with a gather codec (gather_codec.py, strategy 3) also holds a wire shard (one wire element per shard
element), re-encoded from the compute shard before the first gather after the shard changed; its all-gather
lands in a rank-major wire staging buffer, and the copy-out rearranges it param-major and hands it to the
codec, which decodes it into the compute buffer.

Optimizer CPU offload: a standalone main-weight buffer (not the compute weights) can be split per parameter
(`separate_main_weights`), each view getting a storage of its own, so an offloading optimizer moves the views it
steps on the host into host memory and the device keeps only the rest; the moves around the step then read and
write the views one by one.

Where each part lives: this module allocates a group's buffers (`ParamGroup.__init__`) and keeps its views and
byte accounting; `weight_buffers.py` fills and drops the compute weights (gathers, release, main-weight moves;
also `WeightState` and `DoubleBufferPool`); `grad_buffers.py` writes, reduces from and hands out the gradients.
"""

import contextlib
from typing import Callable, Dict, List, Optional, Sequence

import torch
import torch.nn as nn

from .collectives import PendingCollective
from .distributed_data_parallel_config import ShardingStrategy
from .gather_codec import GatherCodec
from .grad_buffers import GroupGrads
from .grad_state import GradState, OuterGradState
from .layout import GroupLayout, chunk_rows
from .mixed_precision import MixedPrecisionPolicy
from .offload import ShardOffload
from .ungraded_params import GradMarks
from .utils import tensor_bytes
# DoubleBufferPool and WeightState live with the compute weights and stay importable from here.
from .weight_buffers import DoubleBufferPool, GroupWeights, WeightState  # noqa: F401


class ParamGroup(GroupWeights, GroupGrads):
    """One unit of communication: parameters of one dtype and requires_grad, laid out flat and sharded."""

    # Set by MegatronFSDP after construction: the DataParallelTopology whose shard group (`topology.dp_group`,
    # of `dp_size` ranks) this group is sharded, gathered and reduced over (the expert data-parallel one for
    # expert parameters), and whether its parameters are expert parameters.
    topology = None
    expert = False

    def __init__(
        self,
        params: Sequence[nn.Parameter],
        names: Sequence[str],
        *,
        strategy: ShardingStrategy,
        dp_rank: int,
        dp_size: int,
        device: torch.device,
        policy: MixedPrecisionPolicy,
        unit_index: Optional[int],
        compute_buffer: Optional[torch.Tensor] = None,
        outer_rank: int = 0,
        outer_size: int = 1,
        gather_codec: Optional[GatherCodec] = None,
        offload: Optional[ShardOffload] = None,
        transient_allocation: Optional[Callable[[], contextlib.AbstractContextManager]] = None,
    ):
        """`outer_rank` / `outer_size`: this rank's place among the outer ranks that shard the main weights
        further (HFSDP); 1 when the main weights are only sharded over the `dp_size` ranks."""
        self.params: List[nn.Parameter] = list(params)
        self.names = list(names)
        self.strategy = strategy
        self.unit_index = unit_index
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.device = device
        self.trainable = self.params[0].requires_grad
        self.param_dtype = self.params[0].dtype
        self.main_dtype = policy.main_dtype_for(self.param_dtype)
        self.grad_dtype = policy.grads_dtype_for(self.param_dtype)
        self.comm_dtype = policy.comm_dtype_for(self.param_dtype)
        self.outer_rank, self.outer_size = outer_rank, outer_size
        self.outer_sharded = outer_size > 1  # the topology admits it under strategy 3 only
        # Nothing is sharded under no_shard: its buffers are laid out for one rank (no row padding).
        sharded = strategy != ShardingStrategy.no_shard
        self.layout = GroupLayout([tuple(p.shape) for p in self.params], dp_size if sharded else 1, outer_size)
        self.pieces = self.layout.local_pieces(dp_rank if sharded else 0)  # pieces of the compute shard
        # Pieces of the main weights (and of the optimizer's gradients and state): the sub-shard under HFSDP.
        self.main_pieces = self.layout.sub_shard_pieces(dp_rank, outer_rank) if self.outer_sharded else self.pieces
        sub_shard_start = self.layout.sub_shard_offset(outer_rank)
        self.sub_shard_slice = slice(sub_shard_start, sub_shard_start + self.layout.sub_shard_numel)
        shard_start, shard_end = self.layout.shard_range(dp_rank)
        padded, shard = self.layout.padded_numel, self.layout.shard_numel
        self.shards_params = strategy == ShardingStrategy.optim_grads_params
        self.uses_pool = compute_buffer is not None
        # param_offload (offload.py): the shard buffers of strategy 3 rest in host memory.
        self.offload = offload if self.shards_params else None
        # The context the per-step device allocations of collectives run in (nccl_allocator.py: the registered
        # pool with NCCL user buffers).
        self.transient_allocation = transient_allocation or contextlib.nullcontext

        # A strategy-3 group sharded over one rank (e.g. experts whose expert data-parallel group is this rank alone)
        # is *resident*: its shard is the whole group, so the compute buffer is the compute shard itself and stays
        # allocated; gathering and releasing it move no bytes (see `GroupWeights.start_gather`).
        self.resident = (self.shards_params and dp_size == 1 and outer_size == 1 and gather_codec is None
                         and self.offload is None and compute_buffer is None)
        self.compute_buffer = compute_buffer if compute_buffer is not None else self._zeros(padded, self.param_dtype)
        self._compute_nbytes = padded * self.compute_buffer.element_size()
        self.weight_state = WeightState.GATHERED
        self.pending_gather: Optional[PendingCollective] = None  # the all-gather in flight while GATHERING
        # While an all-gather is in flight: the rank-major buffer it fills (None when it fills the compute
        # buffer directly) and the tensor it sends (kept alive until it lands).
        self.gather_staging: Optional[torch.Tensor] = None
        self._gather_send: Optional[torch.Tensor] = None
        self._rank_pieces: Optional[List[List[torch.Tensor]]] = None  # each rank's chunks in the compute buffer

        self.main_weights = self.compute_shard = self.grad_buffer = self.main_grads = None
        same_dtype = self.main_dtype == self.param_dtype
        if self.trainable:
            if strategy == ShardingStrategy.no_shard:
                self.main_weights = self.compute_buffer if same_dtype else self._zeros(padded, self.main_dtype)
            elif strategy in (ShardingStrategy.optim, ShardingStrategy.optim_grads):
                # In the compute dtype the main weights are this rank's rows of the compute buffer itself: each
                # parameter's rows are contiguous there (a main view per parameter), though not the shard as a
                # whole, so a gather sends a shard assembled from them.
                self.main_weights = self.compute_buffer if same_dtype else self._zeros(shard, self.main_dtype)
            elif self.resident and same_dtype:
                self.main_weights = self.compute_buffer
            else:
                self.main_weights = self._shard_zeros(self.layout.sub_shard_numel, self.main_dtype)
            if strategy in (ShardingStrategy.no_shard, ShardingStrategy.optim):
                self.grad_buffer = self._zeros(padded, self.grad_dtype)
                self.main_grads = self.grad_buffer if strategy == ShardingStrategy.no_shard else (
                    self.grad_buffer[shard_start:shard_end])
            else:
                self.main_grads = self._shard_zeros(shard, self.grad_dtype)
        # The gradients the optimizer steps with: the main gradients, or under HFSDP their outer sub-shard.
        self.optim_grads = self.main_grads
        if self.outer_sharded and self.main_grads is not None:
            self.optim_grads = self._zeros(self.layout.sub_shard_numel, self.grad_dtype)
        # Strategies 2/3 reduce into a shard-sized gradient buffer that holds nothing between zero_grad and the
        # first reduction of the next backward, so it gives its storage back in that window (the forward and
        # the start of backward, where activations peak) and gets it back, zeroed, when a reduction needs it.
        self.releases_main_grads = self.main_grads is not None and self.grad_buffer is None and self.offload is None
        self.main_grads_released = False
        self.release_main_grads()
        # Under HFSDP the compute shard is written by an all-gather over the outer group (see
        # `outer_gather_source`); `compute_shard_stale` says the main weights changed since the last one.
        self.compute_shard_stale = False
        if self.shards_params:
            reuse_main = self.trainable and same_dtype and not self.outer_sharded
            if self.resident:
                self.compute_shard = self.compute_buffer
            else:
                self.compute_shard = self.main_weights if reuse_main else self._shard_zeros(shard, self.param_dtype)
        # Encoded gathers: the wire shard this rank sends and, while gathered, the gathered wire elements
        # (param-major, viewed by whatever the codec attached to the parameters).
        self.codec = gather_codec
        self.wire_shard = self.wire_gathered = None
        self.wire_shard_stale = False
        if gather_codec is not None:
            if not (self.shards_params and self.trainable and not self.outer_sharded):
                raise ValueError("a gather codec encodes trainable parameters of strategy 3 (optim_grads_params) "
                                 "without outer-dim sharding of the main weights")
            self.wire_shard = self._zeros(shard, gather_codec.wire_dtype)
            self.wire_shard_stale = True

        # Views the optimizer steps on, one per parameter.
        self.main_param_views: List[Optional[torch.Tensor]] = []
        for index, param in enumerate(self.params):
            if not self.trainable:
                self.main_param_views.append(None)
            elif self.main_in_compute_buffer:
                span, piece = self.layout.spans[index], self.pieces[index]
                self.main_param_views.append(self.compute_buffer[span.flat_start + piece.param_start:
                                                                 span.flat_start + piece.param_end])
            else:
                self.main_param_views.append(self._main_view(self.main_weights, index))
        self._optimizer_grad_storage = None
        # Gradient bookkeeping for the current backward.
        self.transient_grads: Optional[torch.Tensor] = None
        self.stashed_grads: Dict[int, torch.Tensor] = {}  # small grads that arrived before the flat buffer
        self.filled = [False] * len(self.params)
        self._main_grad_targets: Dict[int, tuple] = {}  # resident groups: index -> (main_grads, view in its shape)
        self._persistent_grad_targets: Dict[int, torch.Tensor] = {}  # strategy 0: index -> its span, in its shape
        self.grads_pending = 0  # params whose grad arrived since the last reduction
        # Root groups: trainable parameters whose gradient arrived in this backward; early release is blocked
        # for the rest of the backward when a gradient arrives from a nested (reentrant checkpoint) backward.
        self.grads_received = set()
        self.early_release_blocked = False
        # Parameters whose gradient arrived on this rank since the last clearing (ungraded_params.py).
        self.grad_marks = GradMarks(len(self.params))
        # Where the step's gradients are (grad_state.py); moved by the schedule, zeroed by zero_grads.
        self.grad_state = GradState.EMPTY
        self.outer_grad_state = OuterGradState.NONE
        # HFSDP: an outer reduction wrote the sub-shard gradients this step (later ones add to them).
        self.optim_grads_written = False
        # Scale applied to already-reduced gradients before more local gradients are added on top, so that a
        # second reduction in the same step counts them once (set by the schedule from the collective ops).
        self.reopen_factor = 1.0

    # ---- construction helpers -------------------------------------------------------------------------------
    def _zeros(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(numel, dtype=dtype, device=self.device)

    def _shard_zeros(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A shard-sized buffer: in host memory with param_offload, else on the device."""
        return self.offload.zeros(numel, dtype) if self.offload is not None else self._zeros(numel, dtype)

    def trainable_count(self) -> int:
        return len(self.params) if self.trainable else 0

    def _main_view(self, flat: torch.Tensor, index: int) -> torch.Tensor:
        if self.strategy == ShardingStrategy.no_shard:
            span = self.layout.spans[index]
            return flat[span.flat_start:span.flat_end].view(span.shape)
        piece = self.main_pieces[index]
        return flat[piece.shard_start:piece.shard_end]

    def param_view(self, index: int) -> torch.Tensor:
        span = self.layout.spans[index]
        return self.compute_buffer[span.flat_start:span.flat_end].view(span.shape)

    def row_range(self, index: int):
        """Rows `[start, end)` of parameter `index` that this rank holds as a `Shard(0)` DTensor (state dicts,
        `.grad`): `layout.chunk_rows` over the data-parallel ranks, whatever the strategy."""
        return chunk_rows(self.layout.chunks[index].rows, self.dp_size, self.dp_rank)

    def rows_of_shard(self, shard: torch.Tensor, index: int) -> torch.Tensor:
        """This rank's rows of parameter `index` as a view of a whole (not HFSDP sub-) shard, e.g. the compute
        shard or the main gradients: shape `(rows, *shape[1:])`. A 0-dim parameter gives its slot in the shard
        (its value on rank 0, the zero padding elsewhere)."""
        piece = self.pieces[index]
        if not self.layout.shapes[index]:
            return shard[piece.shard_start:piece.shard_start + 1].view(())
        return shard[piece.shard_start:piece.shard_end].view(self.layout.local_shape(index, self.dp_rank))

    # ---- reporting -------------------------------------------------------------------------------------------
    def persistent_bytes(self) -> dict:
        """Bytes this group holds outside transient buffers, by kind (aliased storage counted once)."""
        compute = 0
        if not self.shards_params:
            compute = tensor_bytes(self.compute_buffer)
        elif self.compute_shard is not None and self.compute_shard is not self.main_weights:
            compute = tensor_bytes(self.compute_shard)
        if self.wire_shard is not None:
            compute += tensor_bytes(self.wire_shard)
        main = 0
        if self.main_weights is not None:
            aliased = (not self.shards_params) and self.main_weights.untyped_storage().data_ptr() == (
                self.compute_buffer.untyped_storage().data_ptr())
            main = 0 if aliased else self.main_weights_device_bytes()
        grads = tensor_bytes(self.grad_buffer) if self.grad_buffer is not None else tensor_bytes(self.optim_grads)
        return {"compute_weights": compute, "main_weights": main, "grads": grads}

    def transient_bytes(self) -> int:
        gathered = self.compute_bytes_held() if self.shards_params else 0
        gathered += tensor_bytes(self.gather_staging) + tensor_bytes(self.wire_gathered)
        if self.pending_gather is not None:
            gathered += self.pending_gather.staging_bytes
        if self._gather_send is not None and self._gather_send.untyped_storage().data_ptr() != (
                self.compute_buffer.untyped_storage().data_ptr()) and self._gather_send.data_ptr() not in (
                self.main_weights.data_ptr() if self.main_weights is not None else None,
                self.compute_shard.data_ptr() if self.compute_shard is not None else None,
                self.wire_shard.data_ptr() if self.wire_shard is not None else None):
            gathered += tensor_bytes(self._gather_send)  # main weights cast to the compute dtype for a gather
        stashed = sum(tensor_bytes(grad) for grad in self.stashed_grads.values())
        # HFSDP: the shard-sized reduce-scatter target lives from the first reduction to finish_grad_sync.
        shard_grads = self.main_grads.untyped_storage().nbytes() if (
            self.outer_sharded and self.main_grads is not None) else 0
        return gathered + tensor_bytes(self.transient_grads) + stashed + shard_grads
