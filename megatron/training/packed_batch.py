"""A micro-batch of packed sequences: the `PackedSeqParams` that a batch's `cu_seqlens` describe.

A dataset may return samples that each hold several sequences back to back (one packed row of `--seq-length`
tokens) together with their offsets, under upstream's batch keys:
- `cu_seqlens`: the sequences' cumulative lengths `[0, l_0, l_0 + l_1, ...]`;
- `cu_seqlens_padded` (optional): where each sequence starts when they are padded (see
  megatron/core/packed_sequences.py);
- `max_seqlen` (optional): the longest sequence's length (computed from the offsets when absent).
Samples with different numbers of sequences collate when their offsets are padded at the end with -1 (a fixed
length per dataset); the -1 entries are dropped here. A packed sample is a whole micro-batch, so these batches need
`--micro-batch-size 1`.
"""

import torch

from megatron.core.packed_seq_params import PackedSeqParams

PACKED_BATCH_KEYS = ("cu_seqlens", "cu_seqlens_padded", "max_seqlen")


def _offsets(batch, key, device):
    offsets = batch.get(key)
    if offsets is None:
        return None
    offsets = torch.as_tensor(offsets)
    if offsets.dim() == 2:
        if offsets.shape[0] != 1:
            raise ValueError(f"the batch's {key} has {offsets.shape[0]} rows: a packed sample is a whole micro-batch, "
                             "so packed datasets need --micro-batch-size 1")
        offsets = offsets[0]
    if offsets.dim() != 1:
        raise ValueError(f"the batch's {key} must be 1-D offsets [0, l_0, l_0 + l_1, ...] (or [1, n] after "
                         f"collation), got shape {tuple(offsets.shape)}")
    kept = offsets[offsets >= 0]  # the -1 padding that lets samples with fewer sequences collate
    if kept.numel() != offsets.numel() and bool((offsets[kept.numel():] >= 0).any()):
        raise ValueError(f"the batch's {key} has -1 entries before its last offset; pad offsets with -1 at the end "
                         "only")
    return kept.to(device=device, dtype=torch.int32)


def packed_seq_params_from_batch(batch: dict, device) -> "PackedSeqParams | None":
    """The `PackedSeqParams` ('thd') of a micro-batch with `cu_seqlens`, on `device`; None without them."""
    offsets = _offsets(batch, "cu_seqlens", device)
    if offsets is None:
        if any(batch.get(key) is not None for key in PACKED_BATCH_KEYS):
            raise ValueError("the batch has cu_seqlens_padded or max_seqlen but no cu_seqlens: give the sequences' "
                             "offsets as cu_seqlens")
        return None
    padded = _offsets(batch, "cu_seqlens_padded", device)
    if batch.get("max_seqlen") is not None:
        longest = int(torch.as_tensor(batch["max_seqlen"]).max())
    else:
        longest = int((offsets[1:] - offsets[:-1]).max()) if offsets.numel() > 1 else 0
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=offsets, cu_seqlens_kv=offsets, cu_seqlens_q_padded=padded,
                           cu_seqlens_kv_padded=padded, max_seqlen_q=longest, max_seqlen_kv=longest)
