"""Pipeline stages: each of PP=2 stages builds only its layers, the tied output weight of the last stage starts
equal to the first stage's embedding, and chaining the stages (activations sent rank to rank, gradients sent
back) reproduces the PP=1 loss and gradients."""

import pytest
import torch
import torch.distributed as dist

from megatron.core import parallel_state
from tests.unit_tests.models.gpt.gpt_test_utils import (
    MICRO_BATCH_SIZE,
    SEQ_LENGTH,
    fixed_batch,
    loss_and_grads,
    seeded_model,
    tiny_config,
)
from tests.unit_tests.multiprocess_harness import run_on_ranks

NUM_LAYERS = 4
HIDDEN_SIZE = 32


def _reference_name(stage_name, layer_offset):
    """The PP=1 name of a stage's parameter (stage-local layer index -> global; tied output -> embedding)."""
    if stage_name == "output_layer.weight":
        return "embedding.word_embeddings.weight"
    if stage_name.startswith("decoder.layers."):
        local_index, rest = stage_name[len("decoder.layers.") :].split(".", 1)
        return f"decoder.layers.{int(local_index) + layer_offset}.{rest}"
    return stage_name


def _pipeline_stages_match_single_stage(position_embedding_type):
    model_kwargs = {"position_embedding_type": position_embedding_type}
    tokens, labels, position_ids = fixed_batch()

    parallel_state.initialize_model_parallel()
    reference = seeded_model(tiny_config(num_layers=NUM_LAYERS), **model_kwargs)
    reference_weights = {name: p.detach().clone() for name, p in reference.named_parameters()}
    reference_loss, reference_grads = loss_and_grads(reference, (tokens, labels, position_ids))
    parallel_state.destroy_model_parallel()

    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=2)
    first = parallel_state.is_pipeline_first_stage()
    last = parallel_state.is_pipeline_last_stage()
    with pytest.raises(ValueError, match="--pipeline-model-parallel-size"):
        seeded_model(tiny_config(num_layers=NUM_LAYERS), pre_process=first, post_process=last, **model_kwargs)
    stage = seeded_model(tiny_config(pp=2, num_layers=NUM_LAYERS), pre_process=first, post_process=last, **model_kwargs)
    offset = stage.decoder.layer_offset
    result = {
        "first": first,
        "last": last,
        "layer_numbers": [layer.layer_number for layer in stage.decoder.layers],
        "names": sorted(_reference_name(name, offset) for name, _ in stage.named_parameters()),
        "num_params": sum(p.numel() for p in stage.parameters()),
        "has_final_norm": stage.decoder.final_layernorm is not None,
    }
    shared = stage.shared_embedding_or_output_weight()
    result["shared_flag"] = bool(getattr(shared, "shared_embedding", False))
    if last:
        # Built zero-filled and summed with stage 0's embedding over the embedding group.
        result["output_weight_vs_embedding"] = (
            (shared.detach() - reference_weights["embedding.word_embeddings.weight"]).abs().max().item()
        )
        with pytest.raises(RuntimeError, match="set_input_tensor"):
            stage(None, None, labels=labels)

    with torch.no_grad():
        for name, param in stage.named_parameters():
            param.copy_(reference_weights[_reference_name(name, offset)])

    activation_shape = (SEQ_LENGTH, MICRO_BATCH_SIZE, HIDDEN_SIZE)
    if first:
        hidden_states = stage(tokens, position_ids)
        result["sent_shape"] = tuple(hidden_states.shape)
        dist.send(hidden_states.detach().contiguous(), dst=parallel_state.get_pipeline_model_parallel_next_rank())
        grad_of_hidden = torch.empty(activation_shape)
        dist.recv(grad_of_hidden, src=parallel_state.get_pipeline_model_parallel_next_rank())
        hidden_states.backward(grad_of_hidden)
    else:
        received = torch.empty(activation_shape)
        dist.recv(received, src=parallel_state.get_pipeline_model_parallel_prev_rank())
        received.requires_grad_(True)
        stage.set_input_tensor(received)
        loss = stage(None, None, labels=labels)
        result["loss_diff"] = (loss.detach() - reference_loss).abs().max().item()
        loss.sum().backward()
        dist.send(received.grad.contiguous(), dst=parallel_state.get_pipeline_model_parallel_prev_rank())

    # What gradient finalisation does for the tied weight: sum both stages' gradients.
    dist.all_reduce(shared.grad, group=parallel_state.get_embedding_group())
    result["grad_diff"] = max(
        (param.grad - reference_grads[_reference_name(name, offset)]).abs().max().item()
        for name, param in stage.named_parameters()
    )
    result["reference_names"] = sorted(reference_weights)
    result["reference_numel"] = {name: w.numel() for name, w in reference_weights.items()}
    return result


@pytest.mark.parametrize("position_embedding_type", ["learned_absolute", "rope"])
@pytest.mark.parametrize("world_size", [2])
def test_pp2_stages_hold_their_layers_and_chain_to_pp1_loss(world_size, position_embedding_type):
    first, last = run_on_ranks(world_size, _pipeline_stages_match_single_stage, position_embedding_type)
    assert (first["first"], first["last"], last["first"], last["last"]) == (True, False, False, True)
    assert first["layer_numbers"] == [1, 2] and last["layer_numbers"] == [3, 4]
    assert not first["has_final_norm"] and last["has_final_norm"]
    assert first["shared_flag"] and last["shared_flag"]

    numel = first["reference_numel"]
    first_expected = [n for n in first["reference_names"]
                      if n.startswith(("embedding.", "decoder.layers.0.", "decoder.layers.1."))]
    last_expected = [
        n for n in first["reference_names"]
        if n.startswith(("decoder.layers.2.", "decoder.layers.3.", "decoder.final_"))
    ] + ["embedding.word_embeddings.weight"]
    assert first["names"] == sorted(first_expected)
    assert last["names"] == sorted(last_expected)
    assert first["num_params"] == sum(numel[n] for n in first_expected)
    assert last["num_params"] == sum(numel[n] for n in last_expected)

    assert first["sent_shape"] == (SEQ_LENGTH, MICRO_BATCH_SIZE, HIDDEN_SIZE)
    assert last["output_weight_vs_embedding"] == 0.0
    assert last["loss_diff"] < 1e-5
    assert first["grad_diff"] < 1e-5 and last["grad_diff"] < 1e-5


def test_upstream_positional_spec_and_post_layer_norm():
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_block import TransformerBlock

    model_parallel_cuda_manual_seed(3)
    config = tiny_config(num_layers=1, hidden_size=16, init_seed=3)
    hidden_states = torch.randn(SEQ_LENGTH, MICRO_BATCH_SIZE, 16, generator=torch.Generator().manual_seed(0))
    # Upstream's TransformerBlock(config, spec, post_layer_norm, pre_process, post_process).
    with_spec = TransformerBlock(config, get_gpt_layer_local_spec())
    without_spec = TransformerBlock(config)
    assert with_spec.pre_process is True and with_spec.final_layernorm is not None
    torch.testing.assert_close(with_spec(hidden_states), without_spec(hidden_states), atol=0, rtol=0)
    unnormalised = TransformerBlock(config, get_gpt_layer_local_spec(), post_layer_norm=False)
    assert unnormalised.final_layernorm is None
    torch.testing.assert_close(unnormalised(hidden_states), without_spec.layers[0](hidden_states)[0], atol=0, rtol=0)
    with pytest.raises(ValueError, match=r"set TransformerConfig\(qk_layernorm=True\)"):
        TransformerBlock(config, get_gpt_layer_local_spec(qk_layernorm=True))


def test_forward_takes_upstream_arguments_in_upstream_order():
    """Upstream: forward(hidden_states, attention_mask, context, context_mask, rotary_pos_emb, ...)."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_block import TransformerBlock

    model_parallel_cuda_manual_seed(3)
    block = TransformerBlock(tiny_config(num_layers=2, hidden_size=16, init_seed=3)).eval()
    hidden_states = torch.randn(SEQ_LENGTH, MICRO_BATCH_SIZE, 16, generator=torch.Generator().manual_seed(0))
    angles = RotaryEmbedding(4)(SEQ_LENGTH)
    with torch.no_grad():
        positional = block(hidden_states, None, None, None, angles)  # upstream's positional order
        expected = block.final_layernorm(
            block.layers[1](block.layers[0](hidden_states, rotary_pos_emb=angles)[0], rotary_pos_emb=angles)[0])
    torch.testing.assert_close(positional, expected, atol=0, rtol=0)
    assert not torch.allclose(block(hidden_states), positional, atol=1e-6, rtol=0)  # the angles were used
    with pytest.raises(ValueError, match=r"TransformerBlock.forward\(context=...\) is not supported: .* "
                                         r"pass context=None"):
        block(hidden_states, None, hidden_states)
