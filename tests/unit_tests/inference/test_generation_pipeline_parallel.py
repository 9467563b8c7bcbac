"""Generation under pipeline parallelism (PP2 on 2 ranks, TP2 x PP2 on 4) equals generation on one rank from the
same weights: greedy tokens, log-probabilities and seeded sampling, every pipeline rank ending with the same
results; each stage caches only its own layers. Scoring (no token generated) and the newline rules of the server
give one rank's results too."""

import pytest
import torch

from megatron.core import parallel_state
from megatron.core.inference.communication import is_sampling_source
from megatron.core.inference.contexts import StaticInferenceContext
from megatron.core.inference.pipeline_decoding import decode_forward
from megatron.core.inference.sampling_params import SamplingParams
from megatron.core.inference.static_generation import generate_static_batch
from megatron.inference.newline_rules import NewlineRules
from megatron.inference.text_generation import GenerationJob, GenerationLimits, run_job
from tests.unit_tests.models.gpt.gpt_test_utils import seeded_model, tiny_config
from tests.unit_tests.multiprocess_harness import run_on_ranks

PROMPTS = [[3, 14, 15, 9, 2], [6, 5], [35, 8, 9]]
REAL_VOCAB = 60  # of the model's 64 rows
EOD = REAL_VOCAB - 1
NUM_LAYERS = 4
LIMITS = GenerationLimits(eod_id=EOD, vocab_size=REAL_VOCAB, max_sequence_length=16, max_batch_size=2)
# Newline 25 stops a sequence; 54 is the colon after which a newline cannot come.
NEWLINE_RULES = NewlineRules(newline_id=25, double_newline_id=None, colon_id=54, stop_on_eol=True,
                             prevent_newline_after_colon=True)


def _model(tp, pp):
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    config = tiny_config(tp=tp, pp=pp, num_layers=NUM_LAYERS, num_query_groups=2)
    return seeded_model(config, position_embedding_type="rope",
                        pre_process=parallel_state.is_pipeline_first_stage(),
                        post_process=parallel_state.is_pipeline_last_stage())


def _generate_at(tp, pp):
    model = _model(tp, pp)
    outputs = {}
    for name, params in (("greedy", SamplingParams(top_k=1, num_tokens_to_generate=6, return_log_probs=True,
                                                   top_n_logprobs=3)),
                         ("sampled", SamplingParams(temperature=1.5, top_k=0, num_tokens_to_generate=6))):
        # Other seeds on the ranks that do not sample: every rank must follow the sampling source's draws.
        seed = 11 if is_sampling_source() else 12 + torch.distributed.get_rank()
        results = generate_static_batch(model, PROMPTS, params, eod_id=EOD, max_sequence_length=16,
                                        max_batch_size=4, vocab_size=REAL_VOCAB, seed=seed)
        outputs[name] = [result.generated_tokens for result in results]
        if params.return_log_probs:
            outputs["log_probs"] = torch.tensor([result.generated_log_probs for result in results])
            outputs["prompt_log_probs"] = [result.prompt_log_probs for result in results]
            outputs["top_n"] = [result.prompt_top_n_logprobs + result.generated_top_n_logprobs for result in results]
    scored = run_job(model, GenerationJob(prompt_tokens=PROMPTS, sampling_params=None, seed=0, logprobs=True,
                                          top_n_logprobs=2), LIMITS)
    outputs["scores"] = [result.prompt_log_probs for result in scored]
    outputs["scored_top_n"] = [result.prompt_top_n_logprobs for result in scored]
    newline_job = GenerationJob(prompt_tokens=PROMPTS, seed=3, logprobs=False, newline_rules=NEWLINE_RULES,
                                sampling_params=SamplingParams(top_k=0, num_tokens_to_generate=8))
    outputs["newline"] = [result.generated_tokens for result in run_job(model, newline_job, LIMITS)]
    context = StaticInferenceContext(4, 16)
    with torch.no_grad():
        logits = decode_forward(model.eval(), torch.tensor(PROMPTS[:1]), context)
    outputs["cached_layers"] = sorted(context.key_value_memory_dict)
    outputs["has_logits"] = logits is not None
    parallel_state.destroy_model_parallel()
    return outputs


def _one_rank_then(tp, pp):
    return _generate_at(1, 1), _generate_at(tp, pp)


def _top_n_table(rows):
    """Every position's top-n ids (a list) and log-probabilities (one tensor) of all rows."""
    positions = [position for row in rows for position in row]
    return [list(position) for position in positions], torch.tensor([list(p.values()) for p in positions])


def _check_equal(one_rank, parallel):
    assert parallel["greedy"] == one_rank["greedy"]
    assert parallel["sampled"] == one_rank["sampled"]
    assert parallel["newline"] == one_rank["newline"]
    torch.testing.assert_close(parallel["log_probs"], one_rank["log_probs"], atol=1e-6, rtol=0)
    for name in ("prompt_log_probs", "scores"):
        torch.testing.assert_close(torch.tensor(sum(parallel[name], [])), torch.tensor(sum(one_rank[name], [])),
                                   atol=1e-6, rtol=0)
    assert one_rank["log_probs"].abs().min() > 0.1  # real log-probabilities, not the zeros of a missing broadcast
    for name in ("top_n", "scored_top_n"):  # the last stage's most likely ids, on every stage
        parallel_ids, parallel_values = _top_n_table(parallel[name])
        one_rank_ids, one_rank_values = _top_n_table(one_rank[name])
        assert parallel_ids == one_rank_ids
        torch.testing.assert_close(parallel_values, one_rank_values, atol=1e-6, rtol=0)
    assert len(one_rank["top_n"][0]) == 10 and all(len(position) == 3 for position in one_rank["top_n"][0])


@pytest.mark.parametrize("world_size", [2])
def test_pp2_generation_equals_one_rank(world_size):
    results = run_on_ranks(world_size, _one_rank_then, 1, 2)
    for one_rank, pp2 in results:
        _check_equal(one_rank, pp2)
    assert results[0][1]["sampled"] != results[0][1]["greedy"]  # sampling at T=1.5 leaves the argmax path
    assert sum(tokens[-2:] == [25, EOD] for tokens in results[0][0]["newline"]) == 2  # two rows stopped at "\n"
    # Each stage caches its own two layers (global numbers); only the last stage has logits.
    assert [pp2["cached_layers"] for _, pp2 in results] == [[1, 2], [3, 4]]
    assert [pp2["has_logits"] for _, pp2 in results] == [False, True]


@pytest.mark.parametrize("world_size", [4])
def test_tp2_pp2_generation_equals_one_rank(world_size):
    results = run_on_ranks(world_size, _one_rank_then, 2, 2)
    for one_rank, parallel in results:
        _check_equal(one_rank, parallel)
