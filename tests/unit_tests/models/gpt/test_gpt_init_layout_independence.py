"""Initial weights do not depend on the pipeline split or on construction order.

Two pipeline stages, each built on its own rank with no weight copying, hold exactly the weights of the same
modules of a one-stage model, and chaining them gives the one-stage loss. The generator the stages are built
under is seeded differently per stage (as the training driver seeds it for dropout); the weights follow only the
base seed. A model built on the meta device and reset module by module in any order equals the eager model.
"""

import random

import pytest
import torch
import torch.distributed as dist

from megatron.core import parallel_state, tensor_parallel
from megatron.core.models.gpt.gpt_model import GPTModel
from tests.unit_tests.models.gpt.gpt_test_utils import (
    MAX_SEQUENCE_LENGTH,
    MICRO_BATCH_SIZE,
    SEED,
    SEQ_LENGTH,
    VOCAB_SIZE,
    fixed_batch,
    tiny_config,
)
from tests.unit_tests.multiprocess_harness import run_on_ranks

NUM_LAYERS = 4
HIDDEN_SIZE = 32
PIPELINE_SEED_OFFSET = 100  # what the training driver adds per pipeline rank before building the model


def _single_stage_name(stage_name, layer_offset, tied):
    """The one-stage model's name of a stage's parameter (local layer index -> global; tied output -> embedding)."""
    if stage_name == "output_layer.weight" and tied:
        return "embedding.word_embeddings.weight"
    if stage_name.startswith("decoder.layers."):
        local_index, rest = stage_name[len("decoder.layers.") :].split(".", 1)
        return f"decoder.layers.{int(local_index) + layer_offset}.{rest}"
    return stage_name


def _build(config, generator_seed, **kwargs):
    tensor_parallel.model_parallel_cuda_manual_seed(generator_seed)
    kwargs.setdefault("share_embeddings_and_output_weights", True)
    return GPTModel(config, vocab_size=VOCAB_SIZE, max_sequence_length=MAX_SEQUENCE_LENGTH, **kwargs)


def _chained_loss(stage, tokens, labels, position_ids):
    """The per-token loss on the last stage (None on the first): activations sent from stage 0 to stage 1."""
    activation_shape = (SEQ_LENGTH, MICRO_BATCH_SIZE, HIDDEN_SIZE)
    with torch.no_grad():
        if parallel_state.is_pipeline_first_stage():
            hidden_states = stage(tokens, position_ids)
            dist.send(hidden_states.contiguous(), dst=parallel_state.get_pipeline_model_parallel_next_rank())
            return None
        received = torch.empty(activation_shape)
        dist.recv(received, src=parallel_state.get_pipeline_model_parallel_prev_rank())
        stage.set_input_tensor(received)
        return stage(None, None, labels=labels)


def _pp2_stages_against_one_stage(init_seed_from_config, tied, position_embedding_type):
    model_kwargs = {"share_embeddings_and_output_weights": tied, "position_embedding_type": position_embedding_type}
    overrides = {"num_layers": NUM_LAYERS, "init_seed": SEED if init_seed_from_config else None}
    tokens, labels, position_ids = fixed_batch()

    parallel_state.initialize_model_parallel()
    reference = _build(tiny_config(**overrides), SEED, **model_kwargs)
    reference_params = {name: p.detach().clone() for name, p in reference.named_parameters()}
    with torch.no_grad():
        reference_loss = reference(tokens, position_ids, labels=labels)
    parallel_state.destroy_model_parallel()

    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=2)
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    # With the base seed in the config the generator state at construction must not matter.
    generator_seed = SEED + PIPELINE_SEED_OFFSET * pp_rank if init_seed_from_config else SEED
    stage = _build(
        tiny_config(pp=2, **overrides),
        generator_seed,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        **model_kwargs,
    )
    offset = stage.decoder.layer_offset
    mismatched = sorted(
        name
        for name, param in stage.named_parameters()
        if not torch.equal(param.detach(), reference_params[_single_stage_name(name, offset, tied)])
    )
    loss = _chained_loss(stage, tokens, labels, position_ids)
    result = {"mismatched": mismatched, "num_params": len(list(stage.parameters()))}
    if loss is not None:
        result["loss"] = loss
        result["reference_loss"] = reference_loss
    return result


@pytest.mark.parametrize(
    "init_seed_from_config, tied, position_embedding_type",
    [(True, True, "learned_absolute"), (False, True, "rope"), (True, False, "learned_absolute")],
    ids=["config_seed-tied", "generator_seed-tied-rope", "config_seed-untied"],
)
@pytest.mark.parametrize("world_size", [2])
def test_pp2_stages_built_alone_equal_one_stage_model(world_size, init_seed_from_config, tied, position_embedding_type):
    first, last = run_on_ranks(
        world_size, _pp2_stages_against_one_stage, init_seed_from_config, tied, position_embedding_type
    )
    for result in (first, last):
        assert result["num_params"] > 0
        assert result["mismatched"] == []
    assert "loss" not in first
    assert last["loss"].shape == (MICRO_BATCH_SIZE, SEQ_LENGTH)
    assert last["reference_loss"].mean().item() > 1.0  # a real loss, not a degenerate one
    relative = ((last["loss"] - last["reference_loss"]).abs() / last["reference_loss"].abs()).max().item()
    assert relative <= 1e-6, relative


def _weights(model):
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def _meta_reset_in_shuffled_order_equals_eager(tied):
    parallel_state.initialize_model_parallel()
    config = tiny_config(num_layers=3)
    eager = _build(config, SEED, share_embeddings_and_output_weights=tied)
    deferred = _build(tiny_config(num_layers=3, init_model_with_meta_device=True), SEED,
                      share_embeddings_and_output_weights=tied)
    all_meta = all(p.is_meta for p in deferred.parameters())
    deferred.to_empty(device="cpu")
    owners = [m for m in deferred.modules() if any(True for _ in m.parameters(recurse=False))]
    random.Random(5).shuffle(owners)
    tensor_parallel.model_parallel_cuda_manual_seed(999)  # a generator state unrelated to the one the eager model was built under
    for module in owners:
        module.reset_parameters()
    eager_weights, deferred_weights = _weights(eager), _weights(deferred)
    unequal_leaf_resets = sorted(n for n, w in deferred_weights.items() if not torch.equal(w, eager_weights[n]))

    # Layer- and embedding-level resets redraw the construction values whatever ran before them.
    with torch.no_grad():
        for param in eager.parameters():
            param.add_(1.0)
    torch.manual_seed(7)
    for layer in reversed(eager.decoder.layers):
        layer.reset_parameters()
    eager.embedding.reset_parameters()
    if eager.output_layer.weight is not None:
        eager.output_layer.reset_parameters()
    layer_and_embedding_resets = _weights(eager)
    unequal_module_resets = sorted(
        n
        for n, w in layer_and_embedding_resets.items()
        if "layernorm" not in n and not torch.equal(w, eager_weights[n])
    )
    return all_meta, unequal_leaf_resets, unequal_module_resets


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("world_size", [1])
def test_meta_device_reset_in_any_order_reproduces_eager_init(world_size, tied):
    ((all_meta, unequal_leaf_resets, unequal_module_resets),) = run_on_ranks(
        world_size, _meta_reset_in_shuffled_order_equals_eager, tied
    )
    assert all_meta
    assert unequal_leaf_resets == []
    assert unequal_module_resets == []


def _distinct_modules_draw_distinct_weights():
    parallel_state.initialize_model_parallel()
    model = _build(tiny_config(num_layers=2, init_seed=SEED), 0, share_embeddings_and_output_weights=False)
    other_seed = _build(tiny_config(num_layers=2, init_seed=SEED + 1), 0, share_embeddings_and_output_weights=False)
    layers = model.decoder.layers
    return {
        "layers_differ": not torch.equal(layers[0].mlp.linear_fc1.weight, layers[1].mlp.linear_fc1.weight),
        "output_differs_from_embedding": not torch.equal(
            model.output_layer.weight, model.embedding.word_embeddings.weight
        ),
        "seed_changes_weights": not torch.equal(
            model.decoder.layers[0].self_attention.linear_qkv.weight,
            other_seed.decoder.layers[0].self_attention.linear_qkv.weight,
        ),
        "std": model.decoder.layers[0].mlp.linear_fc1.weight.std().item(),
    }


@pytest.mark.parametrize("world_size", [1])
def test_each_module_draws_its_own_weights_from_the_base_seed(world_size):
    (result,) = run_on_ranks(world_size, _distinct_modules_draw_distinct_weights)
    assert result["layers_differ"]
    assert result["output_differs_from_embedding"]
    assert result["seed_changes_weights"]
    assert result["std"] == pytest.approx(0.02, rel=0.1)  # init_method_std: still normal(0, 0.02)
