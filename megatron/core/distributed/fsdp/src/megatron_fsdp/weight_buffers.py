"""A parameter group's compute weights: their storage, the all-gathers that fill it, and the main weights.

`GroupWeights` is the part of `param_and_grad_buffer.ParamGroup` that moves weights: it gives the flat compute
buffer its storage and drops it again (strategy 3), gathers every rank's shard into it (through a rank-major
staging buffer, straight into place, or through a gather codec's wire elements), and moves values between the
compute weights, the compute shard and the main weights around the optimizer step. The buffers themselves are
allocated by `ParamGroup.__init__` (the table in param_and_grad_buffer.py says which exist per strategy).
`WeightState` is where a group's full weights are; `DoubleBufferPool` holds the gathered weights of strategy-3
units that share two fixed slots instead of owning a compute buffer each.
"""

import enum
from typing import Callable, Optional

import torch

from .collectives import PendingCollective
from .distributed_data_parallel_config import ShardingStrategy
from .resharding import copy_gathered_to_unsharded, piece_sizes, rank_pieces_of_unsharded, shard_of_unsharded


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


_BITS_OF_SIZE = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def _as_bits(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` viewed as integers of its element size: compared bit for bit, faster than bf16 arithmetic on
    CPUs, and a NaN left in place compares equal."""
    return tensor.view(_BITS_OF_SIZE[tensor.element_size()])


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(_as_bits(a), _as_bits(b))


def _written_elements(compute: torch.Tensor, main: torch.Tensor) -> torch.Tensor:
    """Where `compute` no longer holds `main` cast to its dtype."""
    return _as_bits(compute).ne(_as_bits(main.to(compute.dtype)))


class GroupWeights:
    """Compute-weight storage, gathers and main-weight moves of a `ParamGroup` (mixed into it; reads the buffers
    and layout its constructor sets up: `compute_buffer`, `compute_shard`, `main_weights`, `wire_shard`, ...)."""

    # ---- main weights ----------------------------------------------------------------------------------------
    # Set by `separate_main_weights`: each main-weight view has a storage of its own (possibly in host memory)
    # and the flat `main_weights` buffer holds none; whole-buffer moves then go parameter by parameter.
    main_separated = False

    @property
    def main_in_compute_buffer(self) -> bool:
        """Strategies 1/2 with main weights in the compute dtype: they are this rank's rows of the compute buffer
        (`main_weights` is the compute buffer; `main_param_views` its rows)."""
        return self.main_weights is self.compute_buffer and self.strategy in (ShardingStrategy.optim,
                                                                              ShardingStrategy.optim_grads)

    @property
    def main_weights_standalone(self) -> bool:
        """Whether the main weights are a device buffer of their own: neither the compute weights (main weights
        in the compute dtype) nor a host-resident shard of param_offload."""
        return (self.main_weights is not None and self.offload is None
                and self.main_weights is not self.compute_buffer and self.main_weights is not self.compute_shard)

    def separate_main_weights(self):
        """Give every main-weight view a storage of its own (the same tensor objects, so an optimizer holding them
        keeps them) and release the flat main buffer. An optimizer may then move some views to host memory
        (optimizer CPU offload) and the device keeps only the others; every move below reads and writes the
        views one by one, wherever each lives."""
        if self.main_separated:
            return
        if not self.main_weights_standalone:
            raise ValueError("separate_main_weights: this group's main weights are its compute weights (or rest on "
                             "the host already); there is no separate buffer to split")
        for view in self.main_param_views:
            view.data = view.detach().clone()
        self.main_weights.untyped_storage().resize_(0)
        self.main_separated = True
        self.main_installed_versions = {}  # see note_main_installed

    def main_install_target(self, index: int) -> Optional[torch.Tensor]:
        """Where the compute weights hold the values of main view `index` (in the compute dtype, the view's
        shape): its piece of the compute shard (strategy 3), this rank's rows of it in the compute buffer
        (strategies 1/2, sent by the post-step gather), the parameter itself (no_shard); None under HFSDP (the
        compute shard is rebuilt from every outer rank's main weights)."""
        if self.outer_sharded:
            return None
        if self.strategy == ShardingStrategy.no_shard:
            return self.param_view(index)
        if self.shards_params:
            return self._main_view(self.compute_shard, index)
        span, piece = self.layout.spans[index], self.pieces[index]
        return self.compute_buffer[span.flat_start + piece.param_start:span.flat_start + piece.param_end]

    def note_main_installed(self, index: int):
        """Someone else (an offloading optimizer, right after stepping it) copied main view `index`'s current values
        into `main_install_target(index)`: the moves below take them from there, and skip the copy, until the view
        is written again (its version counter moves)."""
        self.main_installed_versions[index] = self.main_param_views[index]._version

    def _main_installed(self, index: int) -> bool:
        return self.main_installed_versions.get(index) == self.main_param_views[index]._version

    def main_weights_flat(self, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """The main weights as laid out in `main_weights`, on the device, in `dtype` (default the main dtype): the
        buffer itself when no cast is needed, else a new tensor (assembled from the views once separated)."""
        dtype = dtype or self.main_dtype
        if not self.main_separated:
            return self.main_weights.to(dtype)
        flat = torch.zeros(self.main_weights.numel(), dtype=dtype, device=self.device)
        for index, view in enumerate(self.main_param_views):
            installed = dtype == self.param_dtype and self._main_installed(index)
            self._main_view(flat, index).copy_(self.main_install_target(index) if installed else view)
        return flat

    def main_weights_device_bytes(self) -> int:
        """Bytes of main weights this group holds on its device (the flat buffer, or the views still there)."""
        if not self.main_separated:
            return self.main_weights.numel() * self.main_weights.element_size()
        return sum(view.numel() * view.element_size() for view in self.main_param_views
                   if view.device.type == self.device.type)

    def write_main_weights(self, values: torch.Tensor):
        """Set the main weights from `values` laid out as they are (a shard, an HFSDP sub-shard, or the full group
        for no_shard), also where they live in the compute buffer's rows or in separate storages."""
        if self.main_separated:
            for index, view in enumerate(self.main_param_views):
                view.copy_(self._main_view(values, index))
            return
        if not self.main_in_compute_buffer:
            self.main_weights.copy_(values)
            return
        for piece, view in zip(self.pieces, self.main_param_views):
            view.copy_(values[piece.shard_start:piece.shard_end])

    def _compute_and_main(self) -> list:
        """(compute weights, main weights) pairs, laid out alike, covering this rank's main weights: the flat
        buffers where they match, else one pair per parameter. Empty when the main weights are the compute
        weights (same dtype) or there are none."""
        if self.main_weights is None or self.main_in_compute_buffer or self.main_weights is self.compute_shard:
            return []
        if not self.main_separated and self.strategy in (ShardingStrategy.no_shard,
                                                         ShardingStrategy.optim_grads_params):
            compute = self.compute_buffer if self.strategy == ShardingStrategy.no_shard else self.compute_shard
            return [(compute[self.sub_shard_slice] if self.outer_sharded else compute, self.main_weights)]
        if self.layout.forms_coincide and not self.main_separated:  # strategies 1/2: this rank's slot
            return [(self.compute_buffer[slice(*self.layout.shard_range(self.dp_rank))], self.main_weights)]
        return [(self.main_install_target(index) if not self.outer_sharded else
                 self._main_view(self.compute_shard[self.sub_shard_slice], index), view)
                for index, view in enumerate(self.main_param_views)]

    def _differs_from_main(self, pairs) -> torch.Tensor:
        """Whether any compute weight differs from its main weight cast to the compute dtype: a device flag
        (no host synchronisation)."""
        flags = [_written_elements(compute.to(main.device), main).any() for compute, main in pairs]
        return flags[0] if len(flags) == 1 else torch.stack(flags).any()

    def compute_written(self) -> bool:
        """Between steps: whether the compute weights were written since the main weights were last installed
        into them (False when there is nothing to compare: no separate main weights, or the compute weights are
        not up to date with them now). Two passes over the shard (a cast, an early-exit comparison) and a host
        synchronisation per pair. See `adopt_written_compute_weights`."""
        if (self.outer_sharded and self.compute_shard_stale) or self.weight_state is WeightState.GATHERING:
            return False
        return not all(_bits_equal(compute.to(main.device), main.to(compute.dtype))
                       for compute, main in self._compute_and_main())

    def adopt_written_compute_weights(self):
        """Take in-place writes to the compute weights since the last install into the main weights.

        Between steps the module's parameters (strategy 3's resting DTensors, the full parameters otherwise) are
        the compute weights; a write to them (`p.add_`, `p.data.copy_`, `p.lerp_`, `torch.nn.init`, ...) would be
        overwritten by the next install of the main weights. Every element of this rank's compute weights that
        no longer equals its main weight cast to the compute dtype takes the written value; the others keep the
        main precision. Called where `compute_written_flag()` is set; strategies 1/2: once the post-step
        all-gather has landed (writes made while it was in flight are lost to it, see
        `_raise_if_written_during_param_sync`)."""
        for compute, main in self._compute_and_main():
            compute = compute.to(main.device)
            torch.where(_written_elements(compute, main), compute.to(main.dtype), main, out=main)

    # ---- writes into the model state dict (strategies 0-2, see state_dict.py) ---------------------------------
    # `state_dict()`'s DTensors view this rank's rows of the full compute buffer through `state_dict_alias`, its
    # storage under a version counter of its own: only writes into those DTensors move it, not the gathers and
    # steps that write the compute buffer. `state_dict_alias_version` is its count when the full weights were
    # last known to agree on every rank (after `load_state_dict`); a write since then is refused at the forward.
    state_dict_alias = None
    state_dict_alias_version = 0
    # Strategy 3: every rank's copy of the group's 0-dim compute weights, and the version counts (compute shard,
    # replicas) when they were taken (see state_dict.py).
    scalar_replicas = None
    scalar_replicas_versions = None

    # ---- post-step all-gather of strategies 1/2 and writes racing it -----------------------------------------
    # Between a step and the landing of the all-gather that follows it, the module's parameters (views of the
    # compute buffer) hold other ranks' rows of the previous weights; a write to them then is overwritten by the
    # gather, and is an error. Two checks see it: the parameters' version counters (writes through the
    # parameters: `p.add_`, `p.copy_`, `p.lerp_`, torch.nn.init; raised when the gather lands) and, with main
    # weights of their own dtype, this rank's rows compared with the main weights just before the gather lands
    # (any write, `p.data.copy_` too; a device flag, raised by `take_param_sync_write_flag`'s caller).
    _param_sync_version = None  # the sum of the parameters' version counters when the gather was queued
    _written_during_param_sync = False
    _rows_written_flag = None

    def _params_version(self) -> int:
        return sum(param._version for param in self.params)

    def note_param_sync_queued(self):
        """Strategies 1/2: the post-step all-gather of this group is queued."""
        self._param_sync_version = self._params_version()
        self._written_during_param_sync = False

    def _note_writes_during_param_sync(self):
        if self._param_sync_version is not None and self._params_version() != self._param_sync_version:
            self._written_during_param_sync = True

    def _compare_rows_before_landing(self):
        """Flag (on the device, no host synchronisation) whether this rank's rows of the compute buffer, which
        the step set to the main weights and no collective rewrites, differ from them now."""
        pairs = self._compute_and_main() if self._param_sync_version is not None else []
        if not pairs:
            return
        differ = self._differs_from_main(pairs)
        self._rows_written_flag = differ if self._rows_written_flag is None else self._rows_written_flag | differ

    def take_param_sync_write_flag(self) -> Optional[torch.Tensor]:
        """The device flag of `_compare_rows_before_landing` since the last call (None if never compared)."""
        flag, self._rows_written_flag = self._rows_written_flag, None
        return flag

    def param_sync_write_error(self) -> RuntimeError:
        return RuntimeError(
            f"parameters of Megatron-FSDP group {self.names[:3]}{'...' if len(self.names) > 3 else ''} were "
            "written in place between optimizer steps while their post-step all-gather (zero_dp_strategy 1/2 "
            "with overlap_param_gather=True) was in flight; it overwrote them with the optimizer's weights, so "
            "the write is lost. Write them with `model.apply(fn)` (which waits for the all-gather and keeps "
            "the write), or inside `with model.gathered_parameters():`, or set overlap_param_gather=False")

    def _raise_if_written_during_param_sync(self):
        """After the all-gather landed (every rank finished the collective): a write it overwrote is an error."""
        written, self._written_during_param_sync, self._param_sync_version = (
            self._written_during_param_sync, False, None)
        if written:
            raise self.param_sync_write_error()

    # ---- compute-weight storage and gathers -----------------------------------------------------------------
    def allocate_compute(self):
        """Give the compute buffer its full storage (values are undefined until gathered or written)."""
        if not self.uses_pool and not self.resident:
            storage = self.compute_buffer.untyped_storage()
            if storage.nbytes() != self._compute_nbytes:
                with self.transient_allocation():
                    storage.resize_(self._compute_nbytes)

    def release_compute(self):
        """Drop the gathered compute weights (strategy 3 only); the parameter views stay registered."""
        if not self.shards_params:
            return
        if not self.uses_pool and not self.resident:
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
        self._note_writes_during_param_sync()
        if self.resident:  # the compute buffer is this rank's shard, which is the whole group
            self.weight_state = WeightState.GATHERED
            return
        if issue_in_place is not None and self.codec is None and not self.layout.forms_coincide:
            if self._rank_pieces is None:  # views of the compute buffer: they survive its storage being resized
                self._rank_pieces = [rank_pieces_of_unsharded(self.layout, self.compute_buffer, rank)
                                     for rank in range(self.layout.dp_size)]
            outputs = self._rank_pieces
            if self.strategy in (ShardingStrategy.optim, ShardingStrategy.optim_grads):
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
            with self.transient_allocation():
                self.gather_staging = output = torch.empty(self.layout.padded_numel, dtype=dtype, device=self.device)
        self._gather_send = self.gather_source()
        self.pending_gather = issue(output, self._gather_send)
        self.weight_state = WeightState.GATHERING

    def finish_gather(self):
        """Wait for the all-gather in flight, if any, and copy it out: the compute buffer then holds the full
        weights."""
        if self.pending_gather is not None:
            self._note_writes_during_param_sync()
            self._compare_rows_before_landing()
            pending, self.pending_gather = self.pending_gather, None
            pending.wait()
            self.copy_gathered_into_compute()
            if self.weight_state is WeightState.GATHERING:
                self.weight_state = WeightState.GATHERED
            self._raise_if_written_during_param_sync()

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
        """Bytes of gathered weights held beyond the shard (none for a pooled or a resident group)."""
        if self.uses_pool or self.resident:
            return 0
        return self.compute_buffer.untyped_storage().nbytes()

    def gather_source(self) -> torch.Tensor:
        """The shard this rank contributes to a gather of the compute weights: the compute shard (strategy 3),
        or the main weights in the compute dtype (strategies 1/2, after the optimizer step); the wire shard with
        a codec."""
        if self.codec is not None:
            return self.wire_shard
        if self.shards_params:
            # param_offload: the host shard travels to the device for the collective.
            return self.compute_shard if self.offload is None else self.offload.to_compute_device(self.compute_shard)
        if self.strategy in (ShardingStrategy.optim, ShardingStrategy.optim_grads):  # rows installed in place
            if self.layout.forms_coincide:  # this rank's rows are its slot of the compute buffer: gather in place
                return self.compute_buffer[slice(*self.layout.shard_range(self.dp_rank))]
            shard = torch.empty(self.layout.shard_numel, dtype=self.param_dtype, device=self.device)
            shard_of_unsharded(self.layout, self.compute_buffer, self.dp_rank, shard)
            return shard
        return self.main_weights_flat(self.param_dtype)

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
            if self.main_separated:
                shard = torch.empty(self.layout.shard_numel, dtype=self.main_dtype, device=self.device)
                shard_of_unsharded(self.layout, self.compute_buffer, self.dp_rank, shard)
                self.write_main_weights(shard)
            elif not self.main_in_compute_buffer:
                shard_of_unsharded(self.layout, self.compute_buffer, self.dp_rank, self.main_weights)
            return
        if self.main_separated:
            self.write_main_weights(source)
        elif self.main_weights.data_ptr() != source.data_ptr():
            self.main_weights.copy_(source)
        self.compute_shard_stale = False
        self.wire_shard_stale = self.codec is not None

    def install_main_into_compute(self):
        """Cast the updated main weights into the compute weights of this rank (the shard, or everything).

        Under HFSDP the main weights are only a sub-shard of the compute shard: the compute shard is marked
        stale instead, and the schedule refreshes it with an all-gather of `outer_gather_source()` over the
        outer group before gathering it. Under strategies 1/2 this rank's rows of the compute buffer take them,
        and the all-gather that follows the step sends them from there (`gather_source()`) to the other ranks."""
        if self.main_weights is None:
            return
        if self.outer_sharded:
            self.compute_shard_stale = True
            return
        if self.strategy in (ShardingStrategy.optim, ShardingStrategy.optim_grads):
            if not self.main_in_compute_buffer:
                for index, view in enumerate(self.main_param_views):
                    if not (self.main_separated and self._main_installed(index)):
                        self.main_install_target(index).copy_(view)
            return
        target = self.compute_shard if self.shards_params else self.compute_buffer
        if self.main_separated:  # each parameter's piece from wherever its main weights live (host or device)
            for index, view in enumerate(self.main_param_views):
                if not self._main_installed(index):
                    self._main_view(target, index).copy_(view)
        elif target.data_ptr() != self.main_weights.data_ptr():
            target.copy_(self.main_weights)
        self.wire_shard_stale = self.codec is not None

    def outer_gather_source(self) -> torch.Tensor:
        """HFSDP: this rank's contribution to the all-gather over the outer group that rebuilds the compute
        shard, i.e. its main weights in the compute dtype (no copy when the dtypes match)."""
        return self.main_weights_flat(self.param_dtype)
