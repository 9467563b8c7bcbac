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
"""

import enum
from typing import Callable, Dict, List, Optional, Sequence

import torch
import torch.nn as nn

from .collectives import PendingCollective
from .distributed_data_parallel_config import ShardingStrategy
from .gather_codec import GatherCodec
from .layout import GroupLayout, chunk_rows
from .grad_state import GradState, OuterGradState, checked_transition
from .mixed_precision import MixedPrecisionPolicy
from .resharding import (copy_grad_in, copy_gathered_to_unsharded, piece_sizes, rank_pieces_of_unsharded,
                         shard_of_unsharded, zero_param_chunks)
from .utils import tensor_bytes


class WeightState(enum.Enum):
    """Where a group's full compute weights are: only this rank's shard holds data (strategy 3 at rest), an
    all-gather is filling the compute buffer, or the compute buffer holds them."""

    SHARDED = "sharded"
    GATHERING = "gathering"
    GATHERED = "gathered"


class DoubleBufferPool:
    """Two fixed byte buffers, each large enough for the largest unit's gathered weights.

    Unit `i` always gathers into slot `i % 2` at the same offsets, so views saved by autograd in forward
    still point at the right bytes when the unit is gathered again for backward.
    """

    ALIGN_BYTES = 64

    def __init__(self, slot_bytes: int, device: torch.device):
        self.slot_bytes = slot_bytes
        self.slots = [torch.empty(slot_bytes, dtype=torch.uint8, device=device) for _ in range(2)]
        self.owner = [None, None]

    @classmethod
    def aligned(cls, num_bytes: int) -> int:
        return -(-num_bytes // cls.ALIGN_BYTES) * cls.ALIGN_BYTES

    def view(self, slot: int, byte_offset: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        num_bytes = numel * torch.empty((), dtype=dtype).element_size()
        return self.slots[slot][byte_offset:byte_offset + num_bytes].view(dtype)

    def total_bytes(self) -> int:
        return 2 * self.slot_bytes


class ParamGroup:
    """One unit of communication: parameters of one dtype and requires_grad, laid out flat and sharded."""

    # A gradient smaller than 1/STASH_FRACTION of the group that arrives before the flat transient buffer exists
    # is kept aside instead of allocating the buffer (a root group's norm gradient arriving long before its
    # embedding gradient, say).
    STASH_FRACTION = 8

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
            else:
                self.main_weights = self._zeros(self.layout.sub_shard_numel, self.main_dtype)
            if strategy in (ShardingStrategy.no_shard, ShardingStrategy.optim):
                self.grad_buffer = self._zeros(padded, self.grad_dtype)
                self.main_grads = self.grad_buffer if strategy == ShardingStrategy.no_shard else (
                    self.grad_buffer[shard_start:shard_end])
            else:
                self.main_grads = self._zeros(shard, self.grad_dtype)
        # The gradients the optimizer steps with: the main gradients, or under HFSDP their outer sub-shard.
        self.optim_grads = self.main_grads
        if self.outer_sharded and self.main_grads is not None:
            self.optim_grads = self._zeros(self.layout.sub_shard_numel, self.grad_dtype)
        # Strategies 2/3 reduce into a shard-sized gradient buffer that holds nothing between zero_grad and the
        # first reduction of the next backward, so it gives its storage back in that window (the forward and
        # the start of backward, where activations peak) and gets it back, zeroed, when a reduction needs it.
        self.releases_main_grads = self.main_grads is not None and self.grad_buffer is None
        self.main_grads_released = False
        self.release_main_grads()
        # Under HFSDP the compute shard is written by an all-gather over the outer group (see
        # `outer_gather_source`); `compute_shard_stale` says the main weights changed since the last one.
        self.compute_shard_stale = False
        if self.shards_params:
            reuse_main = self.trainable and same_dtype and not self.outer_sharded
            self.compute_shard = self.main_weights if reuse_main else self._zeros(shard, self.param_dtype)
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
        self.grads_pending = 0  # params whose grad arrived since the last reduction
        # Root groups: trainable parameters whose gradient arrived in this backward; early release is blocked
        # for the rest of the backward when a gradient arrives from a nested (reentrant checkpoint) backward.
        self.grads_received = set()
        self.early_release_blocked = False
        # Where the step's gradients are (grad_state.py); moved by the schedule, zeroed by zero_grads.
        self.grad_state = GradState.EMPTY
        self.outer_grad_state = OuterGradState.NONE
        # HFSDP: an outer reduction wrote the sub-shard gradients this step (later ones add to them).
        self.optim_grads_written = False
        # Scale applied to already-reduced gradients before more local gradients are added on top, so that a
        # second reduction in the same step counts them once (set by the schedule from the collective ops).
        self.reopen_factor = 1.0

    # ---- gradient state ----------------------------------------------------------------------------------------
    def move_grads_to(self, state: GradState):
        self.grad_state = checked_transition(self.grad_state, state, self.names[0])

    def move_outer_grads_to(self, state: OuterGradState):
        self.outer_grad_state = checked_transition(self.outer_grad_state, state, self.names[0])

    @property
    def grads_dirty(self) -> bool:
        """Local gradients are present that no reduction has taken yet."""
        return self.grad_state is GradState.ACCUMULATING

    @property
    def persistent_grads_reduced(self) -> bool:
        """Strategies 0/1: a reduction of the persistent buffer was issued this step and no gradient was added
        since; adding more first needs that reduction (and any outer one) complete, and the buffer reopened."""
        return self.grad_buffer is not None and self.grad_state is GradState.REDUCED

    @property
    def main_in_compute_buffer(self) -> bool:
        """Strategies 1/2 with main weights in the compute dtype: they are this rank's rows of the compute buffer
        (`main_weights` is the compute buffer; `main_param_views` its rows)."""
        return self.main_weights is self.compute_buffer and self.strategy in (ShardingStrategy.optim,
                                                                              ShardingStrategy.optim_grads)

    def write_main_weights(self, values: torch.Tensor):
        """Set the main weights from `values` laid out as they are (a shard, an HFSDP sub-shard, or the full group
        for no_shard), also where they live in the compute buffer's rows."""
        if not self.main_in_compute_buffer:
            self.main_weights.copy_(values)
            return
        for piece, view in zip(self.pieces, self.main_param_views):
            view.copy_(values[piece.shard_start:piece.shard_end])

    # ---- construction helpers -------------------------------------------------------------------------------
    def _zeros(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(numel, dtype=dtype, device=self.device)

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

    # ---- compute-weight storage -----------------------------------------------------------------------------
    def allocate_compute(self):
        """Give the compute buffer its full storage (values are undefined until gathered or written)."""
        if not self.uses_pool:
            storage = self.compute_buffer.untyped_storage()
            if storage.nbytes() != self._compute_nbytes:
                storage.resize_(self._compute_nbytes)

    def release_compute(self):
        """Drop the gathered compute weights (strategy 3 only); the parameter views stay registered."""
        if not self.shards_params:
            return
        if not self.uses_pool:
            self.compute_buffer.untyped_storage().resize_(0)
        if self.wire_gathered is not None:  # gathered (and decoded) through the codec
            self.codec.release(self.params)
            self.wire_gathered = None
        self.weight_state = WeightState.SHARDED

    @property
    def gathered(self) -> bool:
        """Whether the compute buffer holds (or an all-gather in flight is filling it with) the full weights."""
        return self.weight_state is not WeightState.SHARDED

    @gathered.setter
    def gathered(self, value: bool):
        self.weight_state = WeightState.GATHERED if value else WeightState.SHARDED

    def start_gather(self, issue: Callable[[torch.Tensor, torch.Tensor], PendingCollective],
                     issue_in_place: Optional[Callable[[list, list], PendingCollective]] = None):
        """Gather every rank's shard: `issue(output, shard)` starts the all-gather of `gather_source()` into a
        rank-major buffer (a staging buffer, or the compute buffer itself when the forms coincide). An earlier
        gather still in flight is finished first. `issue_in_place(outputs_by_rank, own_pieces)`, where the
        collective can land each parameter's chunk apart (gloo's point-to-point all-gather), receives every
        rank's chunks straight into the compute buffer instead: no staging buffer, no copy-out."""
        self.finish_gather()
        if issue_in_place is not None and self.codec is None and not self.layout.forms_coincide:
            if self._rank_pieces is None:  # views of the compute buffer: they survive its storage being resized
                self._rank_pieces = [rank_pieces_of_unsharded(self.layout, self.compute_buffer, rank)
                                     for rank in range(self.layout.dp_size)]
            outputs = self._rank_pieces
            if self.main_in_compute_buffer and not self.shards_params:
                self._gather_send, own = None, outputs[self.dp_rank]  # the updated rows are in place already
            else:
                self._gather_send = self.gather_source()
                own = list(torch.split(self._gather_send, piece_sizes(self.layout)))
            self.pending_gather = issue_in_place(outputs, own)
            self.weight_state = WeightState.GATHERING
            return
        output = self.compute_buffer
        if self.codec is not None or not self.layout.forms_coincide:
            dtype = self.param_dtype if self.codec is None else self.codec.wire_dtype
            self.gather_staging = output = torch.empty(self.layout.padded_numel, dtype=dtype, device=self.device)
        self._gather_send = self.gather_source()
        self.pending_gather = issue(output, self._gather_send)
        self.weight_state = WeightState.GATHERING

    def finish_gather(self):
        """Wait for the all-gather in flight, if any, and copy it out: the compute buffer then holds the full
        weights."""
        if self.pending_gather is not None:
            pending, self.pending_gather = self.pending_gather, None
            pending.wait()
            self.copy_gathered_into_compute()
            if self.weight_state is WeightState.GATHERING:
                self.weight_state = WeightState.GATHERED

    def copy_gathered_into_compute(self):
        """The copy-out of a landed all-gather: staging (every rank's shard, rank-major) -> the compute buffer
        (contiguous full parameters). Nothing to do when the gather landed in the compute buffer. With a codec,
        the gathered wire elements are rearranged param-major and decoded into the compute buffer."""
        if self.codec is not None and self.gather_staging is not None:
            self._decode_gathered(self.gather_staging)
        elif self.gather_staging is not None:
            copy_gathered_to_unsharded(self.layout, self.gather_staging, self.compute_buffer)
        self.gather_staging = self._gather_send = None

    def encode_wire_shard(self, shard_group):
        """With a codec: re-encode the wire shard if the compute shard changed since the last encoding. A
        collective over `shard_group` (and the codec's own groups): called before every gather of the group."""
        if self.codec is None or not self.wire_shard_stale:
            return
        self.codec.encode([self.compute_shard[piece.shard_start:piece.shard_end] for piece in self.pieces],
                          [self.wire_shard[piece.shard_start:piece.shard_end] for piece in self.pieces], shard_group)
        self.wire_shard_stale = False

    def _decode_gathered(self, staging: torch.Tensor):
        wire = staging if self.layout.forms_coincide else torch.empty_like(staging)
        copy_gathered_to_unsharded(self.layout, staging, wire)
        self.wire_gathered = wire
        wire_params = [wire[span.flat_start:span.flat_end].view(span.shape) for span in self.layout.spans]
        with torch.no_grad():
            self.codec.decode(wire_params, [self.param_view(index) for index in range(len(self.params))],
                              self.params)

    def compute_bytes_held(self) -> int:
        if self.uses_pool:
            return 0
        return self.compute_buffer.untyped_storage().nbytes()

    def gather_source(self) -> torch.Tensor:
        """The shard this rank contributes to a gather of the compute weights: the compute shard (strategy 3),
        or the main weights in the compute dtype (strategies 1/2, after the optimizer step); the wire shard with
        a codec."""
        if self.codec is not None:
            return self.wire_shard
        if self.shards_params:
            return self.compute_shard
        if self.main_in_compute_buffer:
            shard = torch.empty(self.layout.shard_numel, dtype=self.param_dtype, device=self.device)
            shard_of_unsharded(self.layout, self.compute_buffer, self.dp_rank, shard)
            return shard
        return self.main_weights.to(self.param_dtype)

    def commit_compute_to_shards(self):
        """After the full compute buffer was written (init, load): derive this rank's shard and main weights."""
        if self.shards_params and self.compute_shard is not None:
            shard_of_unsharded(self.layout, self.compute_buffer, self.dp_rank, self.compute_shard)
        self.commit_compute_shard_to_main()

    def commit_compute_shard_to_main(self):
        """Derive the main weights from this rank's (up-to-date) compute shard or compute buffer."""
        if self.main_weights is None:
            return
        if self.strategy == ShardingStrategy.no_shard:
            source = self.compute_buffer
        elif self.shards_params:
            source = self.compute_shard[self.sub_shard_slice] if self.outer_sharded else self.compute_shard
        else:
            if not self.main_in_compute_buffer:
                shard_of_unsharded(self.layout, self.compute_buffer, self.dp_rank, self.main_weights)
            return
        if self.main_weights.data_ptr() != source.data_ptr():
            self.main_weights.copy_(source)
        self.compute_shard_stale = False
        self.wire_shard_stale = self.codec is not None

    def install_main_into_compute(self):
        """Cast the updated main weights into the compute weights of this rank (the shard, or everything).

        Under HFSDP the main weights are only a sub-shard of the compute shard: the compute shard is marked
        stale instead, and the schedule refreshes it with an all-gather of `outer_gather_source()` over the
        outer group before gathering it. Under strategies 1/2 the all-gather that follows the step
        (`gather_source()`) installs them."""
        if self.main_weights is None:
            return
        if self.outer_sharded:
            self.compute_shard_stale = True
            return
        if self.strategy in (ShardingStrategy.optim, ShardingStrategy.optim_grads):
            return
        target = self.compute_shard if self.shards_params else self.compute_buffer
        if target.data_ptr() != self.main_weights.data_ptr():
            target.copy_(self.main_weights)
        self.wire_shard_stale = self.codec is not None

    def outer_gather_source(self) -> torch.Tensor:
        """HFSDP: this rank's contribution to the all-gather over the outer group that rebuilds the compute
        shard, i.e. its main weights in the compute dtype (no copy when the dtypes match)."""
        return self.main_weights.to(self.param_dtype)

    # ---- gradients -------------------------------------------------------------------------------------------
    def write_grad(self, index: int, grad: torch.Tensor, scale: float):
        """Add (or, in a fresh transient buffer, write) one parameter's gradient into the flat gradient buffer:
        param-major under strategy 0 (all-reduced), else rank-major, ready for the reduce-scatter (the
        copy-in, `resharding.copy_grad_in`)."""
        flat_grad = grad.reshape(-1)
        if self.grad_buffer is not None:
            if self.grad_state is GradState.REDUCED:
                self._reopen_reduced_grads()
            if self.strategy == ShardingStrategy.no_shard:
                span = self.layout.spans[index]
                target = self.grad_buffer[span.flat_start:span.flat_end]
                target.add_(flat_grad, alpha=scale) if scale != 1.0 else target.add_(flat_grad)
            else:
                copy_grad_in(self.layout, self.grad_buffer, index, flat_grad, scale, accumulate=True)
        else:
            if self.transient_grads is None and not self.starts_transient_grads(flat_grad):
                self._stash_grad(index, flat_grad, scale)
                self._mark_accumulating()
                return
            self._allocate_transient_grads()
            copy_grad_in(self.layout, self.transient_grads, index, flat_grad, scale, accumulate=self.filled[index])
            self.filled[index] = True
        self._mark_accumulating()

    def _mark_accumulating(self):
        if self.grad_state is not GradState.ACCUMULATING:
            self.move_grads_to(GradState.ACCUMULATING)

    def starts_transient_grads(self, grad: torch.Tensor) -> bool:
        """Whether writing `grad` now allocates the flat transient gradient buffer."""
        if self.grad_buffer is not None or self.transient_grads is not None:
            return False
        return grad.numel() * self.STASH_FRACTION >= self.layout.numel

    def _stash_grad(self, index: int, flat_grad: torch.Tensor, scale: float):
        """Keep a small gradient aside until a large one makes the flat transient buffer worth allocating."""
        scaled = flat_grad.to(self.comm_dtype, copy=True)
        if scale != 1.0:
            scaled.mul_(scale)
        previous = self.stashed_grads.get(index)
        self.stashed_grads[index] = scaled if previous is None else previous.add_(scaled)

    def _allocate_transient_grads(self):
        """Create the flat transient gradient buffer (once per reduction) and move stashed gradients into it."""
        if self.transient_grads is not None:
            return
        self.transient_grads = torch.empty(self.layout.padded_numel, dtype=self.comm_dtype, device=self.device)
        self.filled = [False] * len(self.params)
        for index, stashed in self.stashed_grads.items():
            copy_grad_in(self.layout, self.transient_grads, index, stashed, 1.0, accumulate=False)
            self.filled[index] = True
        self.stashed_grads = {}

    def _reopen_reduced_grads(self):
        """Make an already-reduced persistent buffer accept more local gradients (another microbatch)."""
        if self.strategy == ShardingStrategy.optim:
            shard_start, shard_end = self.layout.shard_range(self.dp_rank)
            self.grad_buffer[:shard_start].zero_()
            self.grad_buffer[shard_end:].zero_()
            target = self.main_grads
        else:
            target = self.grad_buffer
        if self.reopen_factor != 1.0:
            target.mul_(self.reopen_factor)

    def reduce_input(self) -> torch.Tensor:
        """The flat buffer to reduce: transient grads with unwritten spans zeroed, or the persistent buffer."""
        if self.grad_buffer is not None:
            return self.grad_buffer if self.comm_dtype == self.grad_dtype else self.grad_buffer.to(self.comm_dtype)
        self._allocate_transient_grads()
        for index, was_filled in enumerate(self.filled):
            if not was_filled:
                zero_param_chunks(self.layout, self.transient_grads, index)
        layout = self.layout
        if layout.used_shard_numel < layout.shard_numel:  # the tail pad of every shard
            self.transient_grads.view(layout.dp_size, layout.shard_numel)[:, layout.used_shard_numel:].zero_()
        return self.transient_grads

    def drop_transient_grads(self):
        self.transient_grads = None
        self.stashed_grads = {}
        self.filled = [False] * len(self.params)

    def release_main_grads(self):
        """Drop the storage of an all-zero shard gradient buffer (strategies 2/3); views stay registered."""
        if self.releases_main_grads and not self.main_grads_released:
            self.main_grads.untyped_storage().resize_(0)
            self.main_grads_released = True

    def ensure_main_grads(self):
        """Give a released shard gradient buffer its storage back, zeroed, before anything reads or adds to it."""
        if self.main_grads_released:
            self.main_grads.untyped_storage().resize_(self.main_grads.numel() * self.main_grads.element_size())
            self.main_grads.zero_()
            self.main_grads_released = False

    def zero_grads(self):
        if self.grad_buffer is not None:
            self.grad_buffer.zero_()
        elif self.main_grads is not None:
            self.release_main_grads()
        self.grad_state, self.outer_grad_state = GradState.EMPTY, OuterGradState.NONE  # zeroing: from any state
        self.optim_grads_written = False
        self._optimizer_grad_storage = None
        for view in self.main_param_views:
            if view is not None:
                view.grad = None

    def _grads_for_optimizer(self) -> torch.Tensor:
        if self.optim_grads is self.main_grads:
            self.ensure_main_grads()
        return self.optim_grads

    def attach_optimizer_grads(self):
        """Point each main-weight view's `.grad` at its gradient (cast to the main dtype when they differ)."""
        if self.main_weights is None:
            return
        grads = self._grads_for_optimizer()
        if grads.dtype != self.main_dtype:
            self._optimizer_grad_storage = grads.to(self.main_dtype)
            grads = self._optimizer_grad_storage
        for index, view in enumerate(self.main_param_views):
            view.grad = self._main_view(grads, index)

    def scale_grads(self, factor: float):
        """Multiply every gradient this group holds, wherever the step has put it: the persistent or shard
        buffer (before `finish_grad_sync`), the HFSDP sub-shard and the main-dtype copy handed to the optimizer
        (after it). Call only with no reduction in flight: one landing later would add unscaled values."""
        target = self.grad_buffer if self.grad_buffer is not None else self.main_grads
        if target is not None and not self.main_grads_released:  # a released buffer is all zeros
            target.mul_(factor)
        if self.optim_grads is not None and self.optim_grads is not self.main_grads:
            self.optim_grads.mul_(factor)
        if self._optimizer_grad_storage is not None:
            self._optimizer_grad_storage.mul_(factor)

    def reduced_grad_views(self) -> List[torch.Tensor]:
        """Per parameter, this rank's piece of the reduced gradients the optimizer will step with (before any
        cast to the main dtype)."""
        if self.optim_grads is None:
            return []
        return [self._main_view(self._grads_for_optimizer(), index) for index in range(len(self.params))]

    def optimizer_grad_views(self) -> List[torch.Tensor]:
        if self.main_weights is None:
            return []
        grads = self._grads_for_optimizer()
        if self._optimizer_grad_storage is not None:
            grads = self._optimizer_grad_storage
        return [self._main_view(grads, index) for index in range(len(self.params))]

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
            main = 0 if aliased else tensor_bytes(self.main_weights)
        grads = tensor_bytes(self.grad_buffer) if self.grad_buffer is not None else tensor_bytes(self.optim_grads)
        return {"compute_weights": compute, "main_weights": main, "grads": grads}

    def transient_bytes(self) -> int:
        gathered = self.compute_bytes_held() if self.shards_params else 0
        gathered += tensor_bytes(self.gather_staging) + tensor_bytes(self.wire_gathered)
        if self.pending_gather is not None:
            gathered += self.pending_gather.staging_bytes
        if self._gather_send is not None and self._gather_send.data_ptr() not in (
                self.main_weights.data_ptr() if self.main_weights is not None else None,
                self.compute_shard.data_ptr() if self.compute_shard is not None else None,
                self.wire_shard.data_ptr() if self.wire_shard is not None else None):
            gathered += tensor_bytes(self._gather_send)  # main weights cast to the compute dtype for a gather
        stashed = sum(tensor_bytes(grad) for grad in self.stashed_grads.values())
        # HFSDP: the shard-sized reduce-scatter target lives from the first reduction to finish_grad_sync.
        shard_grads = self.main_grads.untyped_storage().nbytes() if (
            self.outer_sharded and self.main_grads is not None) else 0
        return gathered + tensor_bytes(self.transient_grads) + stashed + shard_grads
