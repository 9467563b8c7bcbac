"""A GPT over two pipeline ranks with two model chunks each (interleaved 1F1B) equals the same GPT on one stage:
the layers each chunk holds, losses per microbatch and gradients."""

import pytest
import torch

from megatron.core import parallel_state, tensor_parallel
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.pipeline_parallel import get_forward_backward_func
from tests.unit_tests.multiprocess_harness import run_on_ranks
from tests.unit_tests.pipeline_parallel.test_gpt_pipeline import (
    MICRO_BATCH_SIZE,
    SEED,
    SEQ_LENGTH,
    VOCAB_SIZE,
    _all_reduce_shared_embedding_grads,
    _batches,
    _forward_step,
    _name_in_single_stage_model,
)
from megatron.core.transformer.transformer_config import TransformerConfig

NUM_LAYERS = 8
NUM_CHUNKS = 2

# 1-based global layer numbers of each chunk, by hand: chunk c of rank r is virtual stage c * 2 + r, 2 layers each.
EXPECTED_LAYERS = {0: [[1, 2], [5, 6]], 1: [[3, 4], [7, 8]]}


def _config(pipeline_size, num_chunks=None, finalize_model_grads_func=None, group_size=None):
    return TransformerConfig(
        num_layers=NUM_LAYERS,
        hidden_size=16,
        num_attention_heads=2,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        pipeline_model_parallel_size=pipeline_size,
        virtual_pipeline_model_parallel_size=num_chunks,
        microbatch_group_size_per_vp_stage=group_size,
        finalize_model_grads_func=finalize_model_grads_func,
    )


def _run(model_chunks, batches):
    reported = get_forward_backward_func()(
        forward_step_func=_forward_step,
        data_iterator=iter(batches),  # one iterator, shared by the chunks
        model=model_chunks,
        num_microbatches=len(batches),
        seq_length=SEQ_LENGTH,
        micro_batch_size=MICRO_BATCH_SIZE,
    )
    return [(item["lm loss"][0] / item["lm loss"][1]).item() for item in reported]


def _interleaved_against_one_stage(num_microbatches, group_size):
    batches = _batches(num_microbatches)
    parallel_state.initialize_model_parallel()
    tensor_parallel.model_parallel_cuda_manual_seed(SEED)
    whole = GPTModel(_config(1), vocab_size=VOCAB_SIZE, max_sequence_length=SEQ_LENGTH,
                     share_embeddings_and_output_weights=True)
    reference_losses = _run([whole], batches)
    reference_params = {name: p.detach().clone() for name, p in whole.named_parameters()}
    reference_grads = {name: p.grad.clone() for name, p in whole.named_parameters()}
    parallel_state.destroy_model_parallel()

    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=2,
                                             virtual_pipeline_model_parallel_size=NUM_CHUNKS)
    tensor_parallel.model_parallel_cuda_manual_seed(SEED)
    config = _config(2, NUM_CHUNKS, _all_reduce_shared_embedding_grads, group_size)
    chunks, init_errors = [], []
    for chunk_index in range(NUM_CHUNKS):
        parallel_state.set_virtual_pipeline_model_parallel_rank(chunk_index)
        chunks.append(GPTModel(config, vocab_size=VOCAB_SIZE, max_sequence_length=SEQ_LENGTH,
                               pre_process=parallel_state.is_pipeline_first_stage(),
                               post_process=parallel_state.is_pipeline_last_stage(),
                               share_embeddings_and_output_weights=True))
    parallel_state.set_virtual_pipeline_model_parallel_rank(None)
    layers = [[layer.layer_number for layer in chunk.decoder.layers] for chunk in chunks]
    for chunk in chunks:  # initialised as the same layers of the one-stage model
        offset = chunk.decoder.layer_offset
        for name, parameter in chunk.named_parameters():
            init_errors.append((parameter - reference_params[_name_in_single_stage_model(name, offset)]).abs().max())
    losses = _run(chunks, batches)
    grad_errors = {}
    for index, chunk in enumerate(chunks):
        offset = chunk.decoder.layer_offset
        for name, parameter in chunk.named_parameters():
            reference = reference_grads[_name_in_single_stage_model(name, offset)]
            grad_errors[f"chunk{index}.{name}"] = (parameter.grad - reference).abs().max().item()
    parallel_state.destroy_model_parallel()
    return {"losses": losses, "reference_losses": reference_losses, "grad_errors": grad_errors, "layers": layers,
            "init_error": max(error.item() for error in init_errors),
            "first": [chunk.pre_process for chunk in chunks], "last": [chunk.post_process for chunk in chunks]}


@pytest.mark.parametrize("num_microbatches, group_size", [(4, None), (8, None), (6, 3)])
def test_two_ranks_of_two_chunks_equal_one_stage(num_microbatches, group_size):
    first, last = run_on_ranks(2, _interleaved_against_one_stage, num_microbatches, group_size)
    assert first["layers"] == EXPECTED_LAYERS[0] and last["layers"] == EXPECTED_LAYERS[1]
    assert first["first"] == [True, False] and first["last"] == [False, False]
    assert last["first"] == [False, False] and last["last"] == [False, True]
    assert first["init_error"] == 0.0 and last["init_error"] == 0.0
    assert first["losses"] == []
    assert len(last["losses"]) == num_microbatches
    assert last["losses"] == pytest.approx(last["reference_losses"], abs=1e-5, rel=1e-5)
    for result in (first, last):
        worst = max(result["grad_errors"].items(), key=lambda item: item[1])
        assert worst[1] < 1e-5, worst
