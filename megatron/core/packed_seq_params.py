"""`PackedSeqParams`: where each sequence starts in a batch of sequences packed back to back (upstream name).

GPTModel and the transformer block, layer and attention run the 'thd' layout (see packed_sequences.py); the
dataclass is the upstream record that tools build and pass around; `qkv_format` may be None (unset, read as
'thd'), as upstream allows.
"""

from dataclasses import dataclass
from typing import Optional

import torch

QKV_FORMATS = ("thd", "sbhd", "bshd")


@dataclass
class PackedSeqParams:
    qkv_format: Optional[str] = "thd"
    cu_seqlens_q: Optional[torch.Tensor] = None
    cu_seqlens_kv: Optional[torch.Tensor] = None
    cu_seqlens_q_padded: Optional[torch.Tensor] = None
    cu_seqlens_kv_padded: Optional[torch.Tensor] = None
    max_seqlen_q: Optional[int] = None
    max_seqlen_kv: Optional[int] = None

    def __post_init__(self):
        if self.qkv_format is not None and self.qkv_format not in QKV_FORMATS:
            raise ValueError(f"qkv_format must be None or one of {QKV_FORMATS}, got {self.qkv_format!r}")
        for name in ("cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded"):
            offsets = getattr(self, name)
            if offsets is not None and (offsets.dim() != 1 or bool((offsets[1:] < offsets[:-1]).any())):
                raise ValueError(f"{name} must be a 1-D non-decreasing tensor of sequence start offsets")
