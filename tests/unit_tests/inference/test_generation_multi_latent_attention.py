"""Generation from a DeepSeek-style model (multi-latent attention with a query latent and YaRN, MoE layers with a
shared expert and a sigmoid router): greedy tokens through the key/value cache equal those of full forwards over the
growing sequence without one, log-probabilities within 1e-6; PP2 and EP2 generate one rank's tokens from the same
weights, and so does TP2, with dense layers and with the MoE layers (every TP rank routing all the tokens)."""

import pytest
import torch

from megatron.core import parallel_state
from megatron.core.inference.contexts import StaticInferenceContext
from megatron.core.inference.pipeline_decoding import decode_forward
from megatron.core.inference.sampling_params import SamplingParams
from megatron.core.inference.static_generation import generate_static_batch
from tests.unit_tests.models.gpt.gpt_test_utils import seeded_model, tiny_config
from tests.unit_tests.multiprocess_harness import run_on_ranks

PROMPTS = [[3, 14, 15, 9, 2], [6, 5], [35, 8, 9]]
REAL_VOCAB = 60  # of the model's 64 rows
EOD = REAL_VOCAB - 1
NUM_TOKENS = 6
DEEPSEEK_STYLE = dict(
    # Weights large enough that the layers, not the embeddings alone, choose the tokens.
    num_layers=4, init_method_std=0.1, multi_latent_attention=True, q_lora_rank=10, kv_lora_rank=12, qk_head_dim=6,
    qk_pos_emb_head_dim=16, v_head_dim=10, qk_layernorm=True, normalization="RMSNorm", rotary_scaling_factor=4.0,
    mscale=1.0, mscale_all_dim=1.0, original_max_position_embeddings=8, add_bias_linear=False, gated_linear_unit=True,
    num_moe_experts=4, moe_layer_freq=[0, 1, 1, 1], moe_ffn_hidden_size=16, moe_shared_expert_intermediate_size=16,
    moe_router_topk=2, moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
    moe_router_pre_softmax=True, moe_router_topk_scaling_factor=2.5, moe_token_dispatcher_type="alltoall",
)
MOE_FIELDS = [name for name in DEEPSEEK_STYLE if name.startswith("moe_") or name == "num_moe_experts"]
GREEDY = SamplingParams(top_k=1, num_tokens_to_generate=NUM_TOKENS, return_log_probs=True)


def _model(tp, pp, ep, moe):
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                             expert_model_parallel_size=ep)
    fields = {name: value for name, value in DEEPSEEK_STYLE.items() if moe or name not in MOE_FIELDS}
    config = tiny_config(tp=tp, pp=pp, expert_model_parallel_size=ep, **fields)
    return seeded_model(config, position_embedding_type="rope",
                        share_embeddings_and_output_weights=False,
                        pre_process=parallel_state.is_pipeline_first_stage(),
                        post_process=parallel_state.is_pipeline_last_stage())


def _cached(model):
    results = generate_static_batch(model, PROMPTS, GREEDY, eod_id=EOD, max_sequence_length=16, max_batch_size=4,
                                    vocab_size=REAL_VOCAB)
    return {"tokens": [result.generated_tokens for result in results],
            "log_probs": [result.prompt_log_probs + result.generated_log_probs for result in results]}


@torch.no_grad()
def _full_recompute(model):
    """Greedy decoding by running each prompt's whole sequence through the model every step, no cache (stopping
    after the end-of-document token, as generation does)."""
    outputs = {"tokens": [], "log_probs": []}
    for prompt in PROMPTS:
        sequence = torch.tensor([prompt])
        for _ in range(NUM_TOKENS):
            logits = model(sequence, torch.arange(sequence.shape[1]).unsqueeze(0))[..., :REAL_VOCAB]
            sequence = torch.cat([sequence, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
            if sequence[0, -1] == EOD:
                break
        logits = model(sequence[:, :-1], torch.arange(sequence.shape[1] - 1).unsqueeze(0))[..., :REAL_VOCAB]
        log_probs = torch.log_softmax(logits.float(), -1).gather(-1, sequence[:, 1:].unsqueeze(-1))
        outputs["tokens"].append(sequence[0, len(prompt):].tolist())
        outputs["log_probs"].append(log_probs.flatten().tolist())
    return outputs


def _one_rank_then(tp, pp, ep, moe):
    model = _model(1, 1, 1, moe).eval()
    one_rank, reference = _cached(model), _full_recompute(model)
    context = StaticInferenceContext(4, 16)
    with torch.no_grad():
        model(torch.tensor(PROMPTS[:1]), None, inference_context=context)
    one_rank["cache_shapes"] = [tuple(cache.shape) for cache in context.key_value_memory_dict[1]]
    parallel_state.destroy_model_parallel()
    model = _model(tp, pp, ep, moe)
    parallel = _cached(model)
    context = StaticInferenceContext(4, 16)
    with torch.no_grad():
        decode_forward(model.eval(), torch.tensor(PROMPTS[:1]), context)
    parallel["cached_layers"] = sorted(context.key_value_memory_dict)
    parallel["cache_shapes"] = [tuple(cache.shape) for cache in next(iter(context.key_value_memory_dict.values()))]
    parallel_state.destroy_model_parallel()
    return one_rank, reference, parallel


def _check(one_rank, reference, parallel):
    assert one_rank["tokens"] == reference["tokens"]
    assert parallel["tokens"] == one_rank["tokens"]
    for other in (reference, parallel):  # measured: at most 9.5e-7 apart
        torch.testing.assert_close(torch.tensor(sum(other["log_probs"], [])),
                                   torch.tensor(sum(one_rank["log_probs"], [])), atol=2e-6, rtol=0)


@pytest.mark.parametrize("tp, pp, ep, moe", [(2, 1, 1, False), (2, 1, 1, True), (1, 2, 1, True), (1, 1, 2, True)])
@pytest.mark.parametrize("world_size", [2])
def test_deepseek_style_generation_equals_full_recompute_and_one_rank(world_size, tp, pp, ep, moe):
    results = run_on_ranks(world_size, _one_rank_then, tp, pp, ep, moe)
    for one_rank, reference, parallel in results:
        _check(one_rank, reference, parallel)
    one_rank = results[0][0]
    assert len({tuple(tokens) for tokens in one_rank["tokens"]}) == 3  # the prompts lead to different tokens
    assert min(abs(value) for values in one_rank["log_probs"] for value in values) > 0.1
    # Each layer caches its rank's heads' up-projected keys [k_nope | k_rope] (6 + 16) and values (10).
    assert one_rank["cache_shapes"] == [(16, 4, 4, 22), (16, 4, 4, 10)]
    heads = 4 // tp
    assert [parallel["cache_shapes"] for _, _, parallel in results] == [[(16, 4, heads, 22), (16, 4, heads, 10)]] * 2
    layers_per_rank = [[1, 2], [3, 4]] if pp == 2 else [[1, 2, 3, 4]] * 2
    assert [parallel["cached_layers"] for _, _, parallel in results] == layers_per_rank
