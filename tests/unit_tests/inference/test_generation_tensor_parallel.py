"""Generation under tensor parallelism (2 ranks) equals generation at TP=1 from the same weights: greedy tokens,
log-probabilities and seeded sampling, with every TP rank continuing with TP rank 0's tokens. A model with MoE
layers generates at TP=2 (without sequence parallelism: every TP rank routes all the tokens) and at TP=2 x EP=2
(4 ranks) what it generates at TP=1, with either token dispatcher."""

import pytest
import torch

from megatron.core import parallel_state
from megatron.core.inference.sampling_params import SamplingParams
from megatron.core.inference.static_generation import generate_static_batch
from tests.unit_tests.models.gpt.gpt_test_utils import seeded_model, tiny_config
from tests.unit_tests.multiprocess_harness import run_on_ranks

PROMPTS = [[3, 14, 15, 9, 2], [6, 5], [35, 8, 9]]
# Vocabulary padded from 60 real tokens to the model's 64 (as --make-vocab-size-divisible-by pads it).
REAL_VOCAB = 60
# Weights large enough that the layers, not the tied embeddings alone (which repeat the last token), choose the
# tokens.
MOE = dict(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=16, init_method_std=0.2)


def _generate_at(tp, ep=1, **config_fields):
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=ep)
    if ep > 1:
        config_fields["expert_model_parallel_size"] = ep
    # parallel_output=True (upstream's default, pretrain_gpt's model): generation asks for the gathered logits.
    model = seeded_model(tiny_config(tp=tp, num_query_groups=2, **config_fields), position_embedding_type="rope",
                         parallel_output=True)
    outputs = {}
    for name, params in (("greedy", SamplingParams(top_k=1, num_tokens_to_generate=6, return_log_probs=True)),
                         ("sampled", SamplingParams(temperature=1.5, top_k=0, num_tokens_to_generate=6))):
        # A different seed on each TP rank: the group must still follow TP rank 0's draws.
        seed = 11 + parallel_state.get_tensor_model_parallel_rank()
        results = generate_static_batch(model, PROMPTS, params, eod_id=REAL_VOCAB - 1, max_sequence_length=16,
                                        max_batch_size=4, vocab_size=REAL_VOCAB, seed=seed)
        outputs[name] = [result.generated_tokens for result in results]
        if params.return_log_probs:
            outputs["log_probs"] = torch.tensor([result.generated_log_probs for result in results])
    parallel_state.destroy_model_parallel()
    return outputs


def _tp1_then_tp2():
    return _generate_at(1), _generate_at(2)


def _check_equal(tp1, parallel):
    assert parallel["greedy"] == tp1["greedy"]
    assert parallel["sampled"] == tp1["sampled"]
    torch.testing.assert_close(parallel["log_probs"], tp1["log_probs"], atol=1e-5, rtol=0)


@pytest.mark.parametrize("world_size", [2])
def test_tp2_generation_equals_tp1(world_size):
    results = run_on_ranks(world_size, _tp1_then_tp2)
    for tp1, tp2 in results:
        _check_equal(tp1, tp2)
        assert all(token < REAL_VOCAB for tokens in tp1["sampled"] for token in tokens)
    assert results[0][1]["sampled"] == results[1][1]["sampled"]  # both TP ranks hold the same tokens
    assert results[0][1]["sampled"] != results[0][1]["greedy"]  # sampling at T=1.5 leaves the argmax path


def _moe_at_tp1_then(tp, ep):
    """(TP1's outputs, {dispatcher: the outputs at tp x ep}) of the MoE model."""
    tp1 = _generate_at(1, **MOE)
    return tp1, {dispatcher: _generate_at(tp, ep, moe_token_dispatcher_type=dispatcher, **MOE)
                 for dispatcher in ("allgather", "alltoall")}


@pytest.mark.parametrize("world_size, tp, ep", [(2, 2, 1), (4, 2, 2)])
def test_moe_generation_at_tp2_and_tp2_ep2_equals_tp1(world_size, tp, ep):
    results = run_on_ranks(world_size, _moe_at_tp1_then, tp, ep)
    for tp1, parallel in results:
        assert any(len(set(tokens)) > 1 for tokens in tp1["greedy"])  # not the last token repeated
        for outputs in parallel.values():
            _check_equal(tp1, outputs)
    # Every rank (both TP ranks, and both expert-parallel ones at EP2) holds the same samples.
    assert all(parallel["alltoall"]["sampled"] == results[0][1]["alltoall"]["sampled"] for _, parallel in results)
