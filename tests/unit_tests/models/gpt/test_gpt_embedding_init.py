"""`embedding_init_method_std` (`--embedding-init-method-std`): the word and learned position embeddings draw from
normal(0, that std), the other weights keep normal(0, init_method_std), an untied output layer included, and a
tied output layer's copy on a last pipeline stage draws the embedding's values.

Sampling bounds: the std s of n draws from N(0, sigma^2) has a standard error of about sigma / sqrt(2 n), the mean
one of sigma / sqrt(n); every check allows 6 standard errors (for the 1000 x 64 word embedding: |s / sigma - 1|
< 6 / sqrt(128000) = 0.017).
"""

import math

import torch

from megatron.core.models.common.embeddings.language_model_embedding import word_embedding_init_seed
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.transformer.transformer_config import TransformerConfig

VOCAB, HIDDEN, MAX_POSITIONS = 1000, 64, 512
INIT_STD, EMBEDDING_STD = 0.02, 1.0
SEED = 1234
STANDARD_ERRORS = 6


def _config(**overrides):
    fields = dict(num_layers=1, hidden_size=HIDDEN, num_attention_heads=4, init_method_std=INIT_STD, init_seed=SEED)
    fields.update(overrides)
    return TransformerConfig(**fields)


def _model(config, **kwargs):
    kwargs.setdefault("share_embeddings_and_output_weights", True)
    return GPTModel(config, vocab_size=VOCAB, max_sequence_length=MAX_POSITIONS, **kwargs)


def assert_normal_sample(weight, std, name):
    """`weight`'s values look like draws of N(0, std^2), within STANDARD_ERRORS standard errors."""
    values = weight.detach().double().flatten()
    n = values.numel()
    assert abs(values.std().item() / std - 1) < STANDARD_ERRORS / math.sqrt(2 * n), (name, values.std().item())
    assert abs(values.mean().item()) < STANDARD_ERRORS * std / math.sqrt(n), (name, values.mean().item())


def test_embeddings_draw_the_requested_std_and_the_other_weights_keep_init_method_std():
    model = _model(_config(embedding_init_method_std=EMBEDDING_STD), share_embeddings_and_output_weights=False)
    embeddings = {"embedding.word_embeddings.weight", "embedding.position_embeddings.weight"}
    output_projections = {"self_attention.linear_proj.weight", "mlp.linear_fc2.weight"}
    checked = set()
    for name, param in model.named_parameters():
        if param.dim() < 2:
            continue  # norms and biases have their own constant init
        if name in embeddings:
            std = EMBEDDING_STD
        elif name.split("decoder.layers.0.")[-1] in output_projections:
            std = INIT_STD / math.sqrt(2 * model.config.num_layers)  # scaled_init_method_normal
        else:
            std = INIT_STD
        assert_normal_sample(param, std, name)
        checked.add(name)
    assert embeddings | {"output_layer.weight", "decoder.layers.0.mlp.linear_fc1.weight"} <= checked
    # The draw itself: the word embedding's own seed, normal(0, EMBEDDING_STD) over the whole table.
    generator = torch.Generator().manual_seed(word_embedding_init_seed(SEED))
    expected = torch.empty(VOCAB, HIDDEN).normal_(0.0, EMBEDDING_STD, generator=generator)
    assert torch.equal(model.embedding.word_embeddings.weight.detach(), expected)


def test_unset_embeddings_initialise_like_the_other_weights():
    model = _model(_config(), share_embeddings_and_output_weights=False)
    assert_normal_sample(model.embedding.word_embeddings.weight, INIT_STD, "word")
    assert_normal_sample(model.embedding.position_embeddings.weight, INIT_STD, "position")


def test_a_tied_output_layer_is_the_embedding_on_every_stage():
    config = _config(embedding_init_method_std=EMBEDDING_STD)
    single_stage = _model(config, share_embeddings_and_output_weights=True)
    assert single_stage.output_layer.weight is None
    embedding = single_stage.shared_embedding_or_output_weight()
    assert_normal_sample(embedding, EMBEDDING_STD, "tied")
    # A last stage's own copy starts zeroed (the first stage's weight is summed into it over the embedding group);
    # redrawn, as meta-device materialisation does, it draws the embedding's values with the embedding's init.
    last_stage = _model(config, share_embeddings_and_output_weights=True, pre_process=False)
    assert not last_stage.output_layer.weight.any()
    last_stage.output_layer.reset_parameters()
    assert torch.equal(last_stage.output_layer.weight, embedding)
