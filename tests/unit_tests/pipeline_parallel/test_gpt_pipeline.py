"""A GPT split over two pipeline stages equals the same GPT on one stage: losses per microbatch and gradients."""

import re

import pytest
import torch
import torch.distributed as dist

from megatron.core import parallel_state, tensor_parallel
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.transformer.transformer_config import TransformerConfig
from tests.unit_tests.multiprocess_harness import run_on_ranks

VOCAB_SIZE = 32
SEQ_LENGTH = 8
MICRO_BATCH_SIZE = 2
NUM_LAYERS = 4
SEED = 4321


def _config(pipeline_size, finalize_model_grads_func=None):
    return TransformerConfig(
        num_layers=NUM_LAYERS,
        hidden_size=16,
        num_attention_heads=2,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        pipeline_model_parallel_size=pipeline_size,
        finalize_model_grads_func=finalize_model_grads_func,
    )


def _batches(num_microbatches):
    generator = torch.Generator().manual_seed(11)
    batches = []
    for _ in range(num_microbatches):
        stream = torch.randint(0, VOCAB_SIZE, (MICRO_BATCH_SIZE, SEQ_LENGTH + 1), generator=generator)
        loss_mask = (torch.rand(MICRO_BATCH_SIZE, SEQ_LENGTH, generator=generator) > 0.3).float()
        loss_mask[0, 0] = 1.0
        batches.append(
            {
                "tokens": stream[:, :-1].contiguous(),
                "labels": stream[:, 1:].contiguous(),
                "loss_mask": loss_mask,
                "position_ids": torch.arange(SEQ_LENGTH).expand(MICRO_BATCH_SIZE, SEQ_LENGTH).contiguous(),
            }
        )
    return batches


def _forward_step(data_iterator, model):
    batch = next(data_iterator)
    output = model(batch["tokens"], batch["position_ids"], labels=batch["labels"])

    def loss_func(per_token_loss):
        loss_sum = (per_token_loss * batch["loss_mask"]).sum()
        num_tokens = batch["loss_mask"].sum()
        return loss_sum, num_tokens, {"lm loss": torch.stack([loss_sum.detach(), num_tokens])}

    return output, loss_func


def _run(model, batches):
    reported = get_forward_backward_func()(
        forward_step_func=_forward_step,
        data_iterator=iter(batches),
        model=[model],
        num_microbatches=len(batches),
        seq_length=SEQ_LENGTH,
        micro_batch_size=MICRO_BATCH_SIZE,
    )
    return [(item["lm loss"][0] / item["lm loss"][1]).item() for item in reported]


def _all_reduce_shared_embedding_grads(model_chunks, num_tokens):
    for chunk in model_chunks:
        for parameter in chunk.parameters():
            if getattr(parameter, "shared_embedding", False):
                dist.all_reduce(parameter.grad, group=parallel_state.get_embedding_group())


def _name_in_single_stage_model(name, layer_offset):
    """The parameter's name in the one-stage model (global layer numbers, tied output = word embedding)."""
    if name == "output_layer.weight":
        return "embedding.word_embeddings.weight"
    def shift_layer_number(match):
        return f"decoder.layers.{int(match.group(1)) + layer_offset}."

    return re.sub(r"decoder\.layers\.(\d+)\.", shift_layer_number, name)


def _gpt_two_stages_against_one(num_microbatches):
    batches = _batches(num_microbatches)
    parallel_state.initialize_model_parallel()
    tensor_parallel.model_parallel_cuda_manual_seed(SEED)
    whole = GPTModel(_config(1), vocab_size=VOCAB_SIZE, max_sequence_length=SEQ_LENGTH,
                     share_embeddings_and_output_weights=True)
    reference_losses = _run(whole, batches)
    reference_params = {name: p.detach().clone() for name, p in whole.named_parameters()}
    reference_grads = {name: p.grad.clone() for name, p in whole.named_parameters()}
    parallel_state.destroy_model_parallel()

    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=2)
    tensor_parallel.model_parallel_cuda_manual_seed(SEED)
    stage = GPTModel(
        _config(2, _all_reduce_shared_embedding_grads),
        vocab_size=VOCAB_SIZE,
        max_sequence_length=SEQ_LENGTH,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=True,
    )
    layer_offset = stage.decoder.layer_offset
    with torch.no_grad():
        for name, parameter in stage.named_parameters():
            parameter.copy_(reference_params[_name_in_single_stage_model(name, layer_offset)])
    losses = _run(stage, batches)
    grad_errors = {
        name: (parameter.grad - reference_grads[_name_in_single_stage_model(name, layer_offset)]).abs().max().item()
        for name, parameter in stage.named_parameters()
    }
    return {"losses": losses, "reference_losses": reference_losses, "grad_errors": grad_errors}


@pytest.mark.parametrize("world_size", [2])
def test_gpt_pipeline_of_two_stages_equals_one_stage(world_size):
    first, last = run_on_ranks(world_size, _gpt_two_stages_against_one, 4)
    assert first["losses"] == []
    assert len(last["losses"]) == 4
    assert last["losses"] == pytest.approx(last["reference_losses"], abs=1e-5, rel=1e-5)
    assert "embedding.word_embeddings.weight" in first["grad_errors"]
    assert "output_layer.weight" in last["grad_errors"]  # the last stage's copy of the tied embedding
    for result in (first, last):
        worst = max(result["grad_errors"].items(), key=lambda item: item[1])
        assert worst[1] < 1e-5, worst
