"""QK-Clip with multi-latent attention: the tracked maxima against the logits of the layer's own queries and keys
(and a forward left bit-identical), the rescaled weights against Kimi K2's rule written here head by head, the
logits recomputed after a clipping step (clipped heads land on the threshold), TP2 against TP1, and Muon training
under each sharded wrapper against Megatron DDP."""

import dataclasses

import pytest
import torch

from megatron.core import parallel_state, tensor_parallel
from megatron.core.optimizer.qk_clip import (
    attention_modules,
    clipping_after_step,
    reduce_max_attention_logits,
    reset_max_attention_logits,
)
from megatron.core.transformer.multi_latent_attention import MLASelfAttention
from tests.unit_tests.models.gpt.gpt_test_utils import fixed_batch, full_params, seeded_model, tiny_config
from tests.unit_tests.multiprocess_harness import run_on_ranks

SHAPE = dict(kv_lora_rank=12, qk_head_dim=6, qk_pos_emb_head_dim=4, v_head_dim=10)
VARIANTS = {
    "query_projection_rope": dict(rope_type="rope"),
    "query_latent_yarn_latent_norms": dict(q_lora_rank=10, qk_layernorm=True, normalization="RMSNorm",
                                           rotary_scaling_factor=4.0, mscale_all_dim=0.8,
                                           original_max_position_embeddings=8),
}


def _mla_gpt(variant, tp=1, threshold=1.0, **overrides):
    config = tiny_config(tp=tp, num_layers=1, multi_latent_attention=True, init_method_std=0.2, qk_clip=True,
                         qk_clip_threshold=threshold, qk_clip_alpha=0.3, **SHAPE, **VARIANTS[variant], **overrides)
    return seeded_model(config, position_embedding_type="rope")


def _query_projection(attention):
    return attention.linear_q_proj if attention.config.q_lora_rank is None else attention.linear_q_up_proj


def _reference_clip(query_weight, kv_weight, max_logits, config):
    """Kimi K2's MLA rule head by head, with gamma_h = tau / S_h when S_h > tau: q_nope rows times gamma^alpha,
    q_rope rows times gamma, k_nope rows times gamma^(1 - alpha), value rows unchanged."""
    dn, dr, dv = config.qk_head_dim, config.qk_pos_emb_head_dim, config.v_head_dim
    tau, alpha = config.qk_clip_threshold, config.qk_clip_alpha
    query_weight, kv_weight = query_weight.clone(), kv_weight.clone()
    for head, logit in enumerate(max_logits.tolist()):
        gamma = tau / logit if logit > tau else 1.0
        query_base, kv_base = head * (dn + dr), head * (dn + dv)
        query_weight[query_base:query_base + dn] *= gamma ** alpha
        query_weight[query_base + dn:query_base + dn + dr] *= gamma
        kv_weight[kv_base:kv_base + dn] *= gamma ** (1 - alpha)
    return query_weight, kv_weight


def _clipping_step(model, lr=0.0):
    """Forward-backward on the fixed batch, then an SGD step (QK-Clip after it) -> the maxima it clipped on."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="sgd", lr=lr, weight_decay=0.0), [model])
    tokens, labels, position_ids = fixed_batch()
    reset_max_attention_logits([model])
    model(tokens, position_ids, labels=labels).sum().backward()
    reduce_max_attention_logits([model], None)
    (attention,) = attention_modules([model])
    maxima = attention.max_attention_logits.clone()
    with clipping_after_step(optimizer, [model]):
        assert optimizer.step()[0]
    return maxima


def _recomputed_maxima(model):
    tokens, labels, position_ids = fixed_batch()
    reset_max_attention_logits([model])
    with torch.no_grad():
        model(tokens, position_ids, labels=labels)
    return attention_modules([model])[0].max_attention_logits


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_maxima_are_those_of_the_layer_logits_and_leave_the_forward_bit_identical(variant):
    model = _mla_gpt(variant)
    (attention,) = attention_modules([model])
    assert isinstance(attention, MLASelfAttention)
    seen = {}
    core_attention = attention.core_attention

    def recording_core_attention(query, key, value, attention_mask):
        seen["query"], seen["key"] = query.detach().double(), key.detach().double()
        return core_attention(query, key, value, attention_mask)

    attention.core_attention = recording_core_attention
    tokens, labels, position_ids = fixed_batch()
    tracked_loss = model(tokens, position_ids, labels=labels)
    query, key = (t.permute(1, 2, 0, 3) for t in (seen["query"], seen["key"]))  # [b, heads, s, d]
    scores = query @ key.transpose(-1, -2) * attention.softmax_scale
    causal = torch.ones(scores.shape[-1], scores.shape[-1], dtype=torch.bool).triu(1)
    expected = scores.masked_fill(causal, float("-inf")).amax(dim=(0, 2, 3))
    torch.testing.assert_close(attention.max_attention_logits.double(), expected, rtol=1e-6, atol=0)

    untracked = seeded_model(dataclasses.replace(model.config, qk_clip=False), position_embedding_type="rope")
    assert not attention_modules([untracked])[0].tracks_max_attention_logits
    assert torch.equal(tracked_loss, untracked(tokens, position_ids, labels=labels))


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_clip_rescales_the_weights_as_the_reference_and_clipped_heads_end_at_the_threshold(variant):
    threshold = 2.0  # between the heads' maxima of both variants (about 1.5 to 3.6)
    model = _mla_gpt(variant, threshold=threshold)
    (attention,) = attention_modules([model])
    query_proj = _query_projection(attention)
    untouched = {name: param.detach().clone() for name, param in attention.named_parameters()
                 if name not in ("linear_q_proj.weight", "linear_q_up_proj.weight", "linear_kv_up_proj.weight")}
    before_q, before_kv = query_proj.weight.detach().clone(), attention.linear_kv_up_proj.weight.detach().clone()

    maxima = _clipping_step(model)  # learning rate 0: only the clip moves the weights
    clipped = maxima > threshold
    assert clipped.any() and not clipped.all(), maxima
    expected_q, expected_kv = _reference_clip(before_q, before_kv, maxima, attention.config)
    torch.testing.assert_close(query_proj.weight.detach(), expected_q, rtol=1e-6, atol=0)
    torch.testing.assert_close(attention.linear_kv_up_proj.weight.detach(), expected_kv, rtol=1e-6, atol=0)
    assert not torch.equal(expected_q, before_q) and not torch.equal(expected_kv, before_kv)
    for name, param in attention.named_parameters():  # k_rope (the down projection), norms, linear_proj
        if name in untouched:
            assert torch.equal(param.detach(), untouched[name]), name

    after = _recomputed_maxima(model)  # one layer: the attention's input is unchanged
    torch.testing.assert_close(after[clipped], torch.full_like(after[clipped], threshold), rtol=1e-5, atol=0)
    assert torch.equal(after[~clipped], maxima[~clipped])


def _tp1_then_tp2_clipping_steps(variant, threshold):
    """(full parameters, maxima) after an SGD step with QK-Clip at TP1, then at TP2, and the TP1 step's full
    parameters without the clip."""
    results = []
    for tp, clip in ((1, False), (1, True), (2, True)):
        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
        tensor_parallel.model_parallel_cuda_manual_seed(1234)
        model = _mla_gpt(variant, tp=tp, threshold=threshold if clip else 1e9)
        maxima = _clipping_step(model, lr=0.5)
        if tp > 1:
            pieces = [torch.empty_like(maxima) for _ in range(tp)]
            torch.distributed.all_gather(pieces, maxima, group=parallel_state.get_tensor_model_parallel_group())
            maxima = torch.cat(pieces)
        results.append((full_params(model), maxima))
    parallel_state.destroy_model_parallel()
    return results


@pytest.mark.parametrize("world_size", [2])
def test_tp2_clips_as_tp1(world_size):
    threshold = 2.0  # between the heads' maxima of both variants (about 1.5 to 3.6)
    for (unclipped, _), (reference, reference_maxima), (parallel, maxima) in run_on_ranks(
            world_size, _tp1_then_tp2_clipping_steps, "query_latent_yarn_latent_norms", threshold):
        assert (reference_maxima > threshold).any() and (reference_maxima <= threshold).any(), reference_maxima
        torch.testing.assert_close(maxima, reference_maxima, rtol=1e-6, atol=0)
        query_name = next(name for name in reference if name.endswith("linear_q_up_proj.weight"))
        assert (unclipped[query_name] - reference[query_name]).abs().max() > 1e-3
        for name, value in reference.items():
            torch.testing.assert_close(parallel[name], value, rtol=0, atol=1e-5, msg=name)


def test_qk_clip_flags_with_multi_latent_attention_reach_the_config():
    from tests.unit_tests.training.test_qk_clip_flags import _validated

    config = _validated("--multi-latent-attention --qk-layernorm --qk-clip --qk-clip-threshold 20 "
                        "--log-max-attention-logit")
    assert (config.multi_latent_attention, config.qk_layernorm, config.qk_clip, config.qk_clip_threshold,
            config.log_max_attention_logit) == (True, True, True, 20.0, True)


def test_sharded_wrappers_clip_mla_as_ddp_on_two_ranks():
    """Muon with QK-Clip on an MLA GPT (query latent, latent norms) under the distributed optimizer,
    Megatron-FSDP ZeRO-3 and FSDP2 against Megatron DDP: the same losses and per-step maxima."""
    from tests.unit_tests.optimizer.test_qk_clip import TOLERANCE, _muon_run_with_qk_clip

    threshold, mla = 0.017, dict(SHAPE, q_lora_rank=10, qk_layernorm=True)  # first step's maxima: 0.013 to 0.020
    reference_losses, reference_maxima = run_on_ranks(2, _muon_run_with_qk_clip, "ddp", True, threshold, mla=mla)[0]
    assert (reference_maxima[0] > threshold).any() and (reference_maxima[0] <= threshold).any(), reference_maxima
    # The logits are small here, so the clip shows in the next step's maxima more than in the loss.
    _, unclipped_maxima = run_on_ranks(2, _muon_run_with_qk_clip, "ddp", False, threshold, mla=mla)[0]
    assert (unclipped_maxima[1] - reference_maxima[1]).abs().max() > 100 * TOLERANCE
    for wrapper in ("distopt", "mfsdp_zero3", "fsdp2"):
        for losses, maxima in run_on_ranks(2, _muon_run_with_qk_clip, wrapper, True, threshold, mla=mla):
            torch.testing.assert_close(torch.tensor(losses), torch.tensor(reference_losses), atol=TOLERANCE, rtol=0,
                                       msg=wrapper)
            torch.testing.assert_close(maxima, reference_maxima, atol=TOLERANCE, rtol=0, msg=wrapper)
