"""A packed row's attention run one sequence at a time computes what the block-diagonal mask computes over the whole
row, for the real tokens' outputs and every gradient, and is used only where nothing else needs the mask."""

import pytest
import torch
import torch.nn.functional as F

from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.packed_sequences import packed_rows
from megatron.core.transformer import packed_attention
from megatron.core.transformer.packed_attention import attend_per_run, attention_runs
from tests.unit_tests.models.gpt.gpt_test_utils import seeded_model, tiny_config
from tests.unit_tests.models.gpt.test_gpt_packed_sequences import _packed, _packed_batch, _sequences
from tests.unit_tests.test_utilities import Utils


def _padded_rows():
    """Sequences of 3, 2 and 4 tokens at rows 0, 4 and 8 of a row of 14 (padding at 3, 6-7 and 12-13)."""
    params = PackedSeqParams(cu_seqlens_q=torch.tensor([0, 3, 5, 9]), cu_seqlens_q_padded=torch.tensor([0, 4, 8, 12]))
    return packed_rows("SelfAttention", params, 14, 1, "cpu")


def test_runs_cover_the_sequences_and_the_padding_in_row_order():
    rows = _padded_rows()
    assert rows.runs == [(0, 3), (3, 1), (4, 2), (6, 2), (8, 4), (12, 2)]
    assert attention_runs(rows, None, plain_attention=True) == rows.runs
    assert attention_runs(rows, None, plain_attention=False) is None  # a window, sinks, ...: the masked call
    assert attention_runs(rows, torch.zeros(1, 1, 14, 14, dtype=torch.bool), plain_attention=True) is None


def test_attention_per_run_equals_the_masked_call_on_the_real_rows():
    rows = _padded_rows()
    generator = torch.Generator().manual_seed(0)
    query, key, value = (torch.randn(14, 1, 2, 8, generator=generator, requires_grad=True) for _ in range(3))

    def core_attention(q, k, v, mask):  # [s, b, heads, d] -> [s, b, heads * d], causal without a mask
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))
        kwargs = {"is_causal": True} if mask is None else {"attn_mask": ~mask}
        out = F.scaled_dot_product_attention(q, k, v, **kwargs)
        return out.permute(2, 0, 1, 3).reshape(out.shape[2], out.shape[0], -1)

    real = [0, 1, 2, 4, 5, 8, 9, 10, 11]
    weights = torch.randn(14, 1, 16, generator=generator)[real]
    per_run = attend_per_run(core_attention, query, key, value, None, rows.runs)
    (per_run[real] * weights).sum().backward()
    per_run_grads = [t.grad.clone() for t in (query, key, value)]
    for t in (query, key, value):
        t.grad = None
    masked = core_attention(query, key, value, rows.mask)
    (masked[real] * weights).sum().backward()
    torch.testing.assert_close(per_run[real], masked[real], rtol=0, atol=1e-6)
    for got, expected in zip(per_run_grads, (query.grad, key.grad, value.grad)):
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="the runs replace the packed mask"):
        attend_per_run(core_attention, query, key, value, rows.mask, rows.runs)


@pytest.mark.parametrize("config", [dict(num_query_groups=2), dict(
    multi_latent_attention=True, kv_lora_rank=12, qk_head_dim=6, qk_pos_emb_head_dim=16, v_head_dim=10)],
    ids=["grouped query attention", "multi-latent attention"])
def test_a_model_trains_alike_by_runs_and_by_mask(config, monkeypatch):
    Utils.initialize_model_parallel()
    try:
        model = seeded_model(tiny_config(**config), position_embedding_type="rope" if len(config) == 1 else "none")
        batch = _packed_batch(_sequences(), padded=True, trailing=2)
        calls = []
        run_by_run = packed_attention.attend_per_run
        monkeypatch.setattr(packed_attention, "attend_per_run", lambda *args, **kwargs: calls.append(1) or
                            run_by_run(*args, **kwargs))
        by_runs = _packed(model, batch)
        assert len(calls) == 2  # each layer's attention ran per sequence
        monkeypatch.setattr(packed_attention, "MAX_RUNS", 0)  # every row through the masked call
        by_mask = _packed(model, batch)
        assert len(calls) == 2
        torch.testing.assert_close(by_runs[0], by_mask[0], rtol=0, atol=2e-6)
        for name, grad in by_runs[1].items():
            torch.testing.assert_close(grad, by_mask[1][name], rtol=1e-5, atol=4e-6, msg=name)
    finally:
        Utils.destroy_model_parallel()
