"""The Mamba-2 selective state-space scan (state-space duality), in chunks, in plain torch.

Per head h with state `S` (`[head_dim, state_dim]`), for t = 1..L:

    S_t = exp(dt_t * A_h) * S_{t-1} + dt_t * x_t B_t^T,      y_t = S_t C_t

`ssd_chunked_scan` computes the same `y` without a Python loop over tokens: the sequence is cut into chunks of
`chunk_size`; inside a chunk the outputs are one masked matrix product (the decays between every pair of its
positions), and the chunks exchange only their final states, scanned over the chunks. Everything runs in fp32,
so the result depends on the chunk size only through rounding. Gradients flow through ordinary autograd.
"""

import torch
import torch.nn.functional as F


def segment_sums(values):
    """`out[..., i, j] = values[..., j + 1] + ... + values[..., i]` for j <= i (0 on the diagonal), -inf above it:
    the log-decay from position j to position i. Built from masked cumulative sums, not differences of one
    cumulative sum, which would lose precision over long chunks."""
    length = values.shape[-1]
    expanded = values[..., None].expand(*values.shape, length)  # [..., i, j] = values[i]
    strictly_below = torch.ones(length, length, dtype=torch.bool, device=values.device).tril(-1)
    sums = expanded.masked_fill(~strictly_below, 0).cumsum(dim=-2)
    lower = torch.ones(length, length, dtype=torch.bool, device=values.device).tril(0)
    return sums.masked_fill(~lower, float("-inf"))


def ssd_chunked_scan(x, dt, A, B, C, chunk_size, initial_state=None):
    """y `[b, l, h, p]` and the final state `[b, h, p, n]` of the recurrence above.

    x `[b, l, h, p]`, dt `[b, l, h]` (already positive), A `[h]` (negative), B and C `[b, l, h, n]` (per head;
    expand groups before), initial_state `[b, h, p, n]` or None (zeros). Computed in fp32, returned in x's dtype.
    """
    dtype = x.dtype
    batch, length, heads, head_dim = x.shape
    x, dt, A, B, C = (tensor.float() for tensor in (x, dt, A, B, C))
    pad = (-length) % chunk_size
    if pad:  # zero steps at the end change nothing before them (dt = 0: no decay, no input)
        x, dt, B, C = (F.pad(tensor, (0,) * (2 * (tensor.dim() - 2)) + (0, pad)) for tensor in (x, dt, B, C))
    chunks = x.shape[1] // chunk_size
    state_dim = B.shape[-1]

    def in_chunks(tensor):
        return tensor.reshape(batch, chunks, chunk_size, *tensor.shape[2:])

    x_dt = in_chunks(x * dt[..., None])  # [b, c, l, h, p]
    B, C = in_chunks(B), in_chunks(C)  # [b, c, l, h, n]
    log_decay = in_chunks(dt * A).permute(0, 3, 1, 2)  # [b, h, c, l]
    cumulative = log_decay.cumsum(dim=-1)

    # Within each chunk: y_i = sum_{j <= i} (C_i . B_j) exp(decay j -> i) x_j dt_j.
    within = torch.exp(segment_sums(log_decay))  # [b, h, c, l, l]
    y = torch.einsum("bclhn,bcshn,bhcls,bcshp->bclhp", C, B, within, x_dt)

    # Each chunk's own final state, then the states entering each chunk, scanned over the chunks.
    to_chunk_end = torch.exp(cumulative[..., -1:] - cumulative)  # [b, h, c, l]
    chunk_states = torch.einsum("bclhn,bhcl,bclhp->bchpn", B, to_chunk_end, x_dt)
    if initial_state is None:
        initial_state = torch.zeros(batch, heads, head_dim, state_dim, dtype=torch.float32, device=x.device)
    chunk_states = torch.cat([initial_state.float()[:, None], chunk_states], dim=1)  # [b, c + 1, h, p, n]
    across = torch.exp(segment_sums(F.pad(cumulative[..., -1], (1, 0))))  # [b, h, c + 1, c + 1]
    entering = torch.einsum("bhzc,bchpn->bzhpn", across, chunk_states)
    entering, final_state = entering[:, :-1], entering[:, -1]

    # The state entering a chunk, decayed to each of its positions and read out by C.
    y = y + torch.einsum("bclhn,bchpn,bhcl->bclhp", C, entering, torch.exp(cumulative))
    y = y.reshape(batch, chunks * chunk_size, heads, head_dim)[:, :length]
    return y.to(dtype), final_state
