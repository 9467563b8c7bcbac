"""Decoding through the key/value cache (GPTModel.forward with an inference context) gives the logits of a full
forward over the whole sequence without a cache: multi-head, grouped-query and multi-latent attention, rotary
(partial, interleaved, YaRN) and learned absolute position embeddings, prefill then chunks and single positions."""

import pytest
import torch

from megatron.core import parallel_state
from megatron.core.inference.contexts import StaticInferenceContext
from tests.unit_tests.models.gpt.gpt_test_utils import VOCAB_SIZE, seeded_model, tiny_config
from tests.unit_tests.multiprocess_harness import run_on_ranks

TOLERANCE = 1e-5
BATCH, SEQ = 3, 11

VARIANTS = {
    "learned_absolute_mha": ({}, {}),
    "gqa_rope_qknorm_partial": (
        {"num_query_groups": 2, "gated_linear_unit": True, "normalization": "RMSNorm", "ffn_hidden_size": 48,
         "qk_layernorm": True},
        {"position_embedding_type": "rope", "rotary_percent": 0.5},
    ),
    "mqa_rope_interleaved": (
        {"num_query_groups": 1, "rotary_interleaved": True},
        {"position_embedding_type": "rope", "share_embeddings_and_output_weights": False},
    ),
    "gqa_yarn": (
        {"num_query_groups": 2, "yarn_rotary_scaling_factor": 4.0, "yarn_original_max_position_embeddings": 8,
         "yarn_correction_range_round_to_int": False},
        {"position_embedding_type": "yarn"},
    ),
}
MLA_SHAPE = {"multi_latent_attention": True, "kv_lora_rank": 12, "qk_head_dim": 6, "qk_pos_emb_head_dim": 16,
             "v_head_dim": 10}
VARIANTS.update({
    "mla_rope": ({**MLA_SHAPE, "rope_type": "rope"}, {"position_embedding_type": "rope"}),
    # A query latent, the latents' norms, YaRN with mscale, and a sliding window on the first layer.
    "mla_query_latent_yarn_window": (
        {**MLA_SHAPE, "q_lora_rank": 10, "qk_layernorm": True, "normalization": "RMSNorm",
         "rotary_scaling_factor": 4.0, "mscale": 1.0, "mscale_all_dim": 0.8, "original_max_position_embeddings": 8,
         "window_size": (3, 0), "window_attn_skip_freq": 2},
        {"position_embedding_type": "rope"},
    ),
})
# (start, end) of each forward: prefill, a chunk past the cache (a causal mask with an offset), single positions.
STEPS = [(0, 4), (4, 7), (7, 8), (8, 9), (9, 10), (10, 11)]


def _decoded_vs_full(config_overrides, model_kwargs):
    parallel_state.initialize_model_parallel()
    model = seeded_model(tiny_config(**config_overrides), **model_kwargs).eval()
    tokens = torch.randint(0, VOCAB_SIZE, (BATCH, SEQ), generator=torch.Generator().manual_seed(3))
    position_ids = torch.arange(SEQ).expand(BATCH, SEQ)
    with torch.no_grad():
        full = model(tokens, position_ids)
        # A cache with more rows and positions than used; the old keyword name for one of the steps.
        context = StaticInferenceContext(max_batch_size=BATCH + 1, max_sequence_length=SEQ + 5)
        pieces = []
        for start, end in STEPS:
            keyword = "inference_params" if start == 8 else "inference_context"
            pieces.append(model(tokens[:, start:end], None, **{keyword: context}))
            context.increment_sequence_len_offset(end - start)
        # Explicit absolute position ids give the same as the ones derived from the offset.
        context.reset()
        prefill_with_ids = model(tokens[:, :4], position_ids[:, :4], inference_context=context)
    decoded = torch.cat(pieces, dim=1)
    return {
        "shape": tuple(decoded.shape),
        "max_diff": (decoded - full).abs().max().item(),
        "ids_diff": (prefill_with_ids - full[:, :4]).abs().max().item(),
        "cached_layers": sorted(context.key_value_memory_dict),
        "cache_shapes": [tuple(cache.shape) for cache in context.key_value_memory_dict[1]],
        "logit_scale": full.abs().max().item(),
    }


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("world_size", [1])
def test_cached_decoding_equals_full_forward(world_size, variant):
    config_overrides, model_kwargs = VARIANTS[variant]
    (result,) = run_on_ranks(world_size, _decoded_vs_full, config_overrides, model_kwargs)
    assert result["shape"] == (BATCH, SEQ, VOCAB_SIZE)
    assert result["logit_scale"] > 0.1, "logits too small for the comparison to mean anything"
    assert result["max_diff"] < TOLERANCE, result
    assert result["ids_diff"] < TOLERANCE, result
    assert result["cached_layers"] == [1, 2]
    rows = (SEQ + 5, BATCH + 1)
    if config_overrides.get("multi_latent_attention"):
        # Every head's up-projected key [k_nope | k_rope] and value.
        assert result["cache_shapes"] == [(*rows, 4, 6 + 16), (*rows, 4, 10)]
    else:
        groups = config_overrides.get("num_query_groups", 4)
        assert result["cache_shapes"] == [(*rows, groups, 32 // 4)] * 2


def _refusals():
    parallel_state.initialize_model_parallel()
    model = seeded_model(tiny_config()).eval()
    tokens = torch.zeros(1, 2, dtype=torch.long)
    errors = {}
    cases = {
        "labels": dict(labels=tokens, inference_context=StaticInferenceContext(1, 4)),
        "two_contexts": dict(inference_context=StaticInferenceContext(1, 4),
                             inference_params=StaticInferenceContext(1, 4)),
        "mask": dict(attention_mask=torch.ones(1, 1, 2, 2, dtype=torch.bool),
                     inference_context=StaticInferenceContext(1, 4)),
    }
    past_positions = StaticInferenceContext(1, 40)
    past_positions.increment_sequence_len_offset(15)  # learned table: 16 rows, positions 15 and 16 asked
    cases["past_learned_positions"] = dict(inference_context=past_positions)
    with torch.no_grad():
        for name, kwargs in cases.items():
            try:
                model(tokens, None, **kwargs)
            except ValueError as error:
                errors[name] = str(error)
    return errors


@pytest.mark.parametrize("world_size", [1])
def test_decoding_refuses_what_it_cannot_do(world_size):
    (errors,) = run_on_ranks(world_size, _refusals)
    assert "returns logits" in errors["labels"]
    assert "inference_params" in errors["two_contexts"]
    assert "attention_mask=None" in errors["mask"]
    assert "--max-position-embeddings" in errors["past_learned_positions"]
