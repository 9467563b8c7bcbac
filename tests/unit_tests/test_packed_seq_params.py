"""`PackedSeqParams` takes the values upstream code builds it with."""

import pytest
import torch

from megatron.core.packed_seq_params import PackedSeqParams


def test_qkv_format_may_be_left_unset_as_upstream():
    offsets = torch.tensor([0, 3, 8], dtype=torch.int32)
    params = PackedSeqParams(qkv_format=None, cu_seqlens_q=offsets, cu_seqlens_kv=offsets, max_seqlen_q=5,
                             max_seqlen_kv=5)
    assert params.qkv_format is None and params.cu_seqlens_kv.tolist() == [0, 3, 8]
    with pytest.raises(ValueError, match=r"qkv_format must be None or one of \('thd', 'sbhd', 'bshd'\), got 'tbd'"):
        PackedSeqParams(qkv_format="tbd")
