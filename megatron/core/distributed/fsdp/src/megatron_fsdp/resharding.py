"""The copies between a group's gathered (rank-major) and unsharded (param-major) forms (see layout.py).

An all-gather leaves every rank's shard end to end; the module computes with contiguous full parameters. One
strided copy per parameter goes from one to the other: viewed as a `(dp_size, shard_numel)` matrix, the
gathered buffer holds parameter `i` in columns `[shard_offset_i, shard_offset_i + chunk_numel_i)`, and those
columns, read row by row, are the parameter followed by its padding. The copy in the other direction arranges
a full gradient rank-major for the reduce-scatter; it is fused with the write of the gradient into the flat
buffer (which happens anyway), so it costs no extra pass. Everything here is local: no torch.distributed.
"""

from typing import Optional

import torch

from .layout import GroupLayout


def copy_gathered_to_unsharded(layout: GroupLayout, gathered: torch.Tensor, unsharded: torch.Tensor):
    """THE copy-out after an all-gather: every rank's chunks in `gathered` (rank-major) -> the contiguous full
    parameters in `unsharded` (param-major), padding included. One strided copy per parameter, in one call."""
    if gathered.data_ptr() == unsharded.data_ptr():
        return
    if layout.forms_coincide:
        unsharded.copy_(gathered)
        return
    dp, shard = layout.dp_size, layout.shard_numel
    sizes = [chunk.chunk_numel for chunk in layout.chunks]
    tail = shard - layout.used_shard_numel
    outputs = []
    for index in range(len(sizes)):
        start, end = layout.padded_region(index)
        outputs.append(unsharded[start:end].view(dp, sizes[index]))
    if tail:
        sizes.append(tail)
        outputs.append(unsharded[dp * layout.used_shard_numel:].view(dp, tail))
    torch.split_with_sizes_copy(gathered.view(dp, shard), sizes, dim=1, out=outputs)


def piece_sizes(layout: GroupLayout) -> list:
    """Sizes of the pieces a shard is made of: each parameter's chunk (empty ones left out), then the tail pad."""
    sizes = [chunk.chunk_numel for chunk in layout.chunks if chunk.chunk_numel]
    tail = layout.shard_numel - layout.used_shard_numel
    return sizes + [tail] if tail else sizes


def rank_pieces_of_unsharded(layout: GroupLayout, unsharded: torch.Tensor, rank: int) -> list:
    """Where rank `rank`'s shard lives in the unsharded form: one contiguous view per piece (`piece_sizes`), so
    an all-gather from point-to-point messages can receive each piece straight into place (no copy-out)."""
    dp = layout.dp_size
    pieces = []
    for index, chunk in enumerate(layout.chunks):
        if chunk.chunk_numel:
            start, end = layout.padded_region(index)
            pieces.append(unsharded[start:end].view(dp, chunk.chunk_numel)[rank])
    tail = layout.shard_numel - layout.used_shard_numel
    if tail:
        pieces.append(unsharded[dp * layout.used_shard_numel:].view(dp, tail)[rank])
    return pieces


def shard_of_unsharded(layout: GroupLayout, unsharded: torch.Tensor, rank: int, out: torch.Tensor):
    """Rank `rank`'s shard (its chunk of every parameter, padding included) out of the unsharded form, into
    `out` (cast to its dtype). Used where a full group was written locally: at init and when loading."""
    dp = layout.dp_size
    for index, chunk in enumerate(layout.chunks):
        if chunk.chunk_numel:
            start, end = layout.padded_region(index)
            out[chunk.shard_offset:chunk.shard_offset + chunk.chunk_numel].copy_(
                unsharded[start:end].view(dp, chunk.chunk_numel)[rank])
    tail = layout.shard_numel - layout.used_shard_numel
    if tail:
        out[layout.used_shard_numel:].copy_(unsharded[dp * layout.used_shard_numel:].view(dp, tail)[rank])


def copy_grad_in(layout: GroupLayout, gathered: torch.Tensor, index: int, grad: torch.Tensor, scale: float,
                 accumulate: bool):
    """THE copy-in before a reduce-scatter: parameter `index`'s full gradient `grad` (any shape) -> its chunks
    in the rank-major buffer `gathered`, multiplied by `scale`, added to what is there (`accumulate`) or written
    with its padding zeroed. A low-precision gradient is cast first, so the scale is applied in the buffer's
    dtype (scaling in bf16/fp16 would round, or underflow at large DP, before the cast). Runs once per
    parameter and microbatch, so the common case (rows that divide evenly: no padding) is one strided op."""
    chunk = layout.chunks[index]
    size = chunk.chunk_numel
    if size == 0:
        return
    even = even_copy_views(layout, gathered, index, grad)
    if even is not None:  # the hot path, once per parameter and microbatch: one view of each side, then the write
        _write_scaled(even[0], even[1], scale, accumulate)
        return
    dp = layout.dp_size
    flat = grad.reshape(-1)
    columns = gathered.view(dp, layout.shard_numel)[:, chunk.shard_offset:chunk.shard_offset + size]
    full_ranks, remainder = divmod(flat.numel(), size)
    _write_scaled(columns[:full_ranks], flat[:full_ranks * size].view(full_ranks, size), scale, accumulate)
    if remainder:
        _write_scaled(columns[full_ranks, :remainder], flat[full_ranks * size:], scale, accumulate)
    if not accumulate:
        zero_chunk_padding(layout, gathered, index)


def even_copy_views(layout: GroupLayout, gathered: torch.Tensor, index: int, grad: torch.Tensor):
    """(target, source) for parameter `index`'s copy-in when every rank's chunk of it is full (nothing to pad, the
    common case): its columns of the rank-major buffer and its gradient, both viewed as `(dp_size, chunk_numel)`.
    None when the parameter has padding or no chunk, or `gathered` is not a dense 1-D buffer."""
    size, dp = layout.chunks[index].chunk_numel, layout.dp_size
    if size == 0 or grad.numel() != dp * size or gathered.stride() != (1,):
        return None
    columns = gathered.as_strided((dp, size), (layout.shard_numel, 1),
                                  gathered.storage_offset() + layout.chunks[index].shard_offset)
    return columns, grad.view(dp, size) if grad.is_contiguous() else grad.reshape(dp, size)


def _write_scaled(target: torch.Tensor, source: torch.Tensor, scale: float, accumulate: bool):
    if accumulate:
        target.add_(source, alpha=scale) if scale != 1.0 else target.add_(source)
    elif scale != 1.0 and source.dtype == target.dtype:
        torch.mul(source, scale, out=target)
    else:
        target.copy_(source)
        if scale != 1.0:
            target.mul_(scale)


def zero_chunk_padding(layout: GroupLayout, gathered: torch.Tensor, index: Optional[int] = None):
    """Zero the padding of parameter `index`'s chunks in a rank-major buffer (every parameter's chunks and the
    tail pad when `index` is None), so padding reduces to zeros."""
    dp, shard = layout.dp_size, layout.shard_numel
    rows = gathered.view(dp, shard)
    indices = range(len(layout.chunks)) if index is None else [index]
    for param_index in indices:
        chunk = layout.chunks[param_index]
        if chunk.chunk_numel == 0:
            continue
        numel = chunk.rows * chunk.row_numel
        full_ranks, remainder = divmod(numel, chunk.chunk_numel)
        columns = rows[:, chunk.shard_offset:chunk.shard_offset + chunk.chunk_numel]
        if full_ranks < dp:
            columns[full_ranks, remainder:].zero_()
            columns[full_ranks + 1:].zero_()
    if index is None and layout.used_shard_numel < shard:
        rows[:, layout.used_shard_numel:].zero_()


def zero_param_chunks(layout: GroupLayout, gathered: torch.Tensor, index: int):
    """Zero all of parameter `index`'s chunks in a rank-major buffer (a parameter that got no gradient)."""
    chunk = layout.chunks[index]
    if chunk.chunk_numel:
        gathered.view(layout.dp_size, layout.shard_numel)[
            :, chunk.shard_offset:chunk.shard_offset + chunk.chunk_numel].zero_()
