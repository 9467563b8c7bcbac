"""`--no-weight-decay-cond-type apply_wd_to_qk_layernorm` (upstream's Qwen3-Next rule): the query / key norm
weights are weight-decayed although they are 1-D; every other parameter keeps the default rule."""

import pytest
import torch

from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.optimizer import OptimizerConfig, get_param_groups, no_weight_decay_cond_for
from megatron.core.transformer.transformer_config import TransformerConfig

# LayerNorm: weight and bias, both decayed under the rule (upstream matches the module name).
QK_NORMS = {f"decoder.layers.0.self_attention.{norm}_layernorm.{kind}" for norm in "qk" for kind in ("weight", "bias")}
MATRICES = {"decoder.layers.0.self_attention.linear_qkv.weight", "decoder.layers.0.self_attention.linear_proj.weight",
            "decoder.layers.0.mlp.linear_fc1.weight", "decoder.layers.0.mlp.linear_fc2.weight"}
EMBEDDINGS = {"embedding.word_embeddings.weight", "embedding.position_embeddings.weight"}


def _decayed_names(no_weight_decay_cond, skip_embeddings=False):
    config = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, qk_layernorm=True, init_seed=1)
    model = GPTModel(config, vocab_size=64, max_sequence_length=16, share_embeddings_and_output_weights=True)
    groups = get_param_groups([model], OptimizerConfig(lr=1e-3, weight_decay=0.1), no_weight_decay_cond,
                              default_skip_embedding_weight_decay=skip_embeddings)
    name_of = {id(param): name for name, param in model.named_parameters()}
    return {name_of[id(param)] for group in groups if group["wd_mult"] == 1.0 for param in group["params"]}


@pytest.mark.parametrize("skip_embeddings", [False, True])
def test_apply_wd_to_qk_layernorm_decays_the_qk_norms_and_nothing_else_new(skip_embeddings):
    default = _decayed_names(None, skip_embeddings)
    rule = no_weight_decay_cond_for("apply_wd_to_qk_layernorm", skip_embeddings)
    qwen3_next = _decayed_names(rule, skip_embeddings)
    embeddings = set() if skip_embeddings else EMBEDDINGS
    assert default == MATRICES | embeddings
    assert qwen3_next == MATRICES | embeddings | QK_NORMS
    # The other norms and the biases stay undecayed.
    assert rule("decoder.layers.0.input_layernorm.weight", torch.ones(4)) is True
    assert rule("decoder.layers.0.mlp.linear_fc1.bias", torch.ones(4)) is True


def test_no_type_keeps_the_default_and_unknown_types_stop():
    assert no_weight_decay_cond_for(None) is None
    with pytest.raises(ValueError, match="--no-weight-decay-cond-type must be one of"):
        no_weight_decay_cond_for("qwen3_next")


def test_flag_reaches_the_optimizer(monkeypatch):
    from megatron.core import optimizer
    from megatron.training import model_setup
    from megatron.training.arguments import parse_args, validate_args

    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    args = validate_args(parse_args(args=(
        "--num-layers 1 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --micro-batch-size 1 "
        "--train-iters 2 --lr 1e-3 --mock-data --vocab-size 64 --qk-layernorm "
        "--no-weight-decay-cond-type apply_wd_to_qk_layernorm").split()))
    captured = {}
    monkeypatch.setattr(model_setup, "get_model", lambda provider, args: [])
    monkeypatch.setattr(optimizer, "get_megatron_optimizer", lambda config, chunks, **kwargs: captured.update(kwargs))
    monkeypatch.setattr(model_setup, "build_scheduler", lambda optimizer, args: None)
    monkeypatch.setattr(model_setup, "install_schedule_hooks", lambda chunks, optimizer, args: None)
    model_setup.setup_model_and_optimizer(None, args)
    cond = captured["no_weight_decay_cond"]
    assert cond("decoder.layers.0.self_attention.q_layernorm.weight", torch.ones(4)) is False
    assert cond("decoder.final_layernorm.weight", torch.ones(4)) is True
