"""Generation under an interleaved (virtual) pipeline, two model chunks on each of two pipeline ranks, equals
generation on one rank from the same weights: greedy tokens, log-probabilities, seeded sampling and scoring, every
rank ending with the same results; each chunk caches only its own layers."""

import pytest
import torch

from megatron.core import parallel_state
from megatron.core.inference.contexts import StaticInferenceContext
from megatron.core.inference.pipeline_decoding import decode_forward
from megatron.core.inference.sampling_params import SamplingParams
from megatron.core.inference.static_generation import generate_static_batch
from megatron.inference.text_generation import GenerationJob, GenerationLimits, run_job
from megatron.inference.virtual_pipeline import VirtualPipelineModel
from tests.unit_tests.models.gpt.gpt_test_utils import seeded_model, tiny_config
from tests.unit_tests.multiprocess_harness import run_on_ranks
from tests.unit_tests.pipeline_parallel.test_gpt_pipeline import _name_in_single_stage_model

PROMPTS = [[3, 14, 15, 9, 2], [6, 5], [35, 8, 9]]
REAL_VOCAB = 60  # of the model's 64 rows
EOD = REAL_VOCAB - 1
NUM_LAYERS = 4
NUM_CHUNKS = 2
LIMITS = GenerationLimits(eod_id=EOD, vocab_size=REAL_VOCAB, max_sequence_length=16, max_batch_size=2)


def _whole_model():
    parallel_state.initialize_model_parallel()
    model = seeded_model(tiny_config(num_layers=NUM_LAYERS, num_query_groups=2), position_embedding_type="rope")
    weights = {name: parameter.detach().clone() for name, parameter in model.named_parameters()}
    return model, weights


def _virtual_pipeline_model(weights):
    """This rank's two chunks of the pipeline-2 x 2-chunk model, holding the one-rank model's weights."""
    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=2,
                                             virtual_pipeline_model_parallel_size=NUM_CHUNKS)
    config = tiny_config(pp=2, num_layers=NUM_LAYERS, num_query_groups=2,
                         virtual_pipeline_model_parallel_size=NUM_CHUNKS)
    chunks = []
    for chunk_index in range(NUM_CHUNKS):
        parallel_state.set_virtual_pipeline_model_parallel_rank(chunk_index)
        chunks.append(seeded_model(config, position_embedding_type="rope",
                                   pre_process=parallel_state.is_pipeline_first_stage(),
                                   post_process=parallel_state.is_pipeline_last_stage()))
    parallel_state.set_virtual_pipeline_model_parallel_rank(None)
    with torch.no_grad():
        for chunk in chunks:
            for name, parameter in chunk.named_parameters():
                parameter.copy_(weights[_name_in_single_stage_model(name, chunk.decoder.layer_offset)])
    return VirtualPipelineModel(chunks)


def _generate(model):
    outputs = {}
    greedy = SamplingParams(top_k=1, num_tokens_to_generate=6, return_log_probs=True)
    results = generate_static_batch(model, PROMPTS, greedy, eod_id=EOD, max_sequence_length=16, max_batch_size=4,
                                    vocab_size=REAL_VOCAB, seed=11)
    outputs["greedy"] = [result.generated_tokens for result in results]
    outputs["log_probs"] = torch.tensor([result.generated_log_probs for result in results])
    sampled = SamplingParams(temperature=1.5, top_k=0, num_tokens_to_generate=6)
    outputs["sampled"] = [result.generated_tokens for result in run_job(
        model, GenerationJob(prompt_tokens=PROMPTS, sampling_params=sampled, seed=11, logprobs=False), LIMITS)]
    scored = run_job(model, GenerationJob(prompt_tokens=PROMPTS, sampling_params=None, seed=0, logprobs=True),
                     LIMITS)
    outputs["scores"] = torch.tensor(sum((result.prompt_log_probs for result in scored), []))
    context = StaticInferenceContext(4, 16)
    with torch.no_grad():
        logits = decode_forward(model.eval(), torch.tensor(PROMPTS[:1]), context)
    outputs["cached_layers"] = sorted(context.key_value_memory_dict)
    outputs["has_logits"] = logits is not None
    return outputs


def _one_rank_then_virtual_pipeline():
    model, weights = _whole_model()
    one_rank = _generate(model)
    parallel_state.destroy_model_parallel()
    virtual = _generate(_virtual_pipeline_model(weights))
    parallel_state.destroy_model_parallel()
    return one_rank, virtual


@pytest.mark.parametrize("world_size", [2])
def test_two_chunks_per_rank_generate_one_ranks_tokens(world_size):
    results = run_on_ranks(world_size, _one_rank_then_virtual_pipeline)
    for one_rank, virtual in results:
        assert virtual["greedy"] == one_rank["greedy"]
        assert virtual["sampled"] == one_rank["sampled"]
        torch.testing.assert_close(virtual["log_probs"], one_rank["log_probs"], atol=1e-6, rtol=0)
        torch.testing.assert_close(virtual["scores"], one_rank["scores"], atol=1e-6, rtol=0)
    one_rank = results[0][0]
    assert one_rank["log_probs"].abs().min() > 0.1  # real log-probabilities, not the zeros of a missing broadcast
    assert one_rank["sampled"] != one_rank["greedy"]
    # Chunk c of rank r is virtual stage 2c + r, one layer each: rank 0 caches layers 1 and 3, rank 1 2 and 4.
    assert [virtual["cached_layers"] for _, virtual in results] == [[1, 3], [2, 4]]
    assert [virtual["has_logits"] for _, virtual in results] == [False, True]


def test_chunk_count_must_match_the_config():
    config = tiny_config(pp=2, num_layers=NUM_LAYERS, virtual_pipeline_model_parallel_size=NUM_CHUNKS)
    chunk = torch.nn.Module()
    chunk.config = config
    with pytest.raises(ValueError, match="--num-virtual-stages-per-pipeline-rank"):
        VirtualPipelineModel([chunk])


def test_one_chunk_alone_is_refused_by_decode_forward():
    chunk = torch.nn.Module()
    chunk.config = tiny_config(pp=2, num_layers=NUM_LAYERS, virtual_pipeline_model_parallel_size=NUM_CHUNKS)
    chunk.pre_process, chunk.post_process = True, False
    with pytest.raises(ValueError, match="VirtualPipelineModel"):
        decode_forward(chunk, torch.tensor(PROMPTS[:1]), StaticInferenceContext(4, 16))
