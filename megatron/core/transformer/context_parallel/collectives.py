"""The only place context-parallel attention talks to `torch.distributed`.

- `ring_exchange`: send a tensor to the next rank of the group and receive the previous rank's (the p2p ring),
  started asynchronously so the caller can compute while it travels;
- `all_gather_first_dim` / `reduce_scatter_first_dim`: the K/V gather of the allgather comm type and the
  reduce-scatter of its K/V gradients (the autograd around them is in `allgather_attention`);
- `SequenceToHeads` / `HeadsToSequence`: the Ulysses all-to-alls between sequence-sharded `[s/N, b, H, d]` and
  head-sharded `[s, b, H/N, d]` layouts; each one's backward is the other's forward.

Every collective here is a gloo- and NCCL-supported primitive (batch_isend_irecv, all_gather_single,
reduce_scatter_single, all_to_all_single).
"""

import torch
import torch.distributed as dist


class RingExchange:
    """One step of a ring: `start(tensor)` sends to the next rank and receives from the previous one; `wait()`
    returns the received tensor. In a ring of one rank (e.g. the outer level of --hierarchical-context-parallel-sizes
    A 1) the tensor comes back unchanged without a transfer: a rank cannot send to itself."""

    def __init__(self, group):
        self.group = group
        ranks = dist.get_process_group_ranks(group)
        index = ranks.index(dist.get_rank())
        self.next_rank = ranks[(index + 1) % len(ranks)]
        self.prev_rank = ranks[(index - 1) % len(ranks)]
        self._requests = []
        self._received = None

    def start(self, tensor: torch.Tensor):
        tensor = tensor.contiguous()
        if self.next_rank == dist.get_rank():
            self._received = tensor
            return self
        self._received = torch.empty_like(tensor)
        ops = [dist.P2POp(dist.isend, tensor, self.next_rank, group=self.group),
               dist.P2POp(dist.irecv, self._received, self.prev_rank, group=self.group)]
        self._requests = dist.batch_isend_irecv(ops)
        self._sent = tensor  # keep the send buffer alive until the exchange completes
        return self

    def wait(self) -> torch.Tensor:
        for request in self._requests:
            request.wait()
        self._requests, self._sent = [], None
        received, self._received = self._received, None
        return received


def all_gather_first_dim(tensor, group):
    """`[n, ...]` on each rank -> `[size * n, ...]`, the ranks' blocks in rank order."""
    size = dist.get_world_size(group)
    tensor = tensor.contiguous()
    output = torch.empty((size * tensor.shape[0], *tensor.shape[1:]), dtype=tensor.dtype, device=tensor.device)
    dist.all_gather_single(output, tensor, group=group)
    return output


def reduce_scatter_first_dim(tensor, group):
    """`[size * n, ...]` on each rank -> block `rank` of the sum over ranks, `[n, ...]`."""
    size = dist.get_world_size(group)
    tensor = tensor.contiguous()
    output = torch.empty((tensor.shape[0] // size, *tensor.shape[1:]), dtype=tensor.dtype, device=tensor.device)
    dist.reduce_scatter_single(output, tensor, group=group)
    return output


def _all_to_all_first_dim(tensor, group):
    """Block j of dimension 0 goes to rank j; block j of the result came from rank j."""
    tensor = tensor.contiguous()
    output = torch.empty_like(tensor)
    dist.all_to_all_single(output, tensor, group=group)
    return output


def _sequence_to_heads(tensor, group):
    size = dist.get_world_size(group)
    seq, batch, heads, dim = tensor.shape
    blocks = tensor.view(seq, batch, size, heads // size, dim).permute(2, 0, 1, 3, 4)  # head block j -> rank j
    received = _all_to_all_first_dim(blocks, group)  # [N (source rank), s/N, b, H/N, d]
    return received.reshape(size * seq, batch, heads // size, dim)


def _heads_to_sequence(tensor, group):
    size = dist.get_world_size(group)
    full_seq, batch, local_heads, dim = tensor.shape
    blocks = tensor.view(size, full_seq // size, batch, local_heads, dim)  # rows of rank j -> rank j
    received = _all_to_all_first_dim(blocks, group)  # [N (head block), s/N, b, H/N, d]
    return received.permute(1, 2, 0, 3, 4).reshape(full_seq // size, batch, size * local_heads, dim)


class SequenceToHeads(torch.autograd.Function):
    """`[s/N, b, H, d]` (this rank's tokens, all heads) -> `[s, b, H/N, d]` (every rank's tokens in rank order,
    this rank's block of heads)."""

    @staticmethod
    def forward(ctx, tensor, group):
        ctx.group = group
        return _sequence_to_heads(tensor, group)

    @staticmethod
    def backward(ctx, grad):
        return _heads_to_sequence(grad, ctx.group), None


class HeadsToSequence(torch.autograd.Function):
    """The inverse of `SequenceToHeads`."""

    @staticmethod
    def forward(ctx, tensor, group):
        ctx.group = group
        return _heads_to_sequence(tensor, group)

    @staticmethod
    def backward(ctx, grad):
        return _sequence_to_heads(grad, ctx.group), None
