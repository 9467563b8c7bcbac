"""--cross-entropy-loss-fusion, --cross-entropy-fusion-impl and --apply-query-key-layer-scaling: parsed, checked
with upstream's rules, and passed to the model's TransformerConfig."""

import pytest

from megatron.training.arguments import parse_args, validate_args
from megatron.training.model_config import core_transformer_config_from_args

BASE = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --micro-batch-size 2 "
        "--train-iters 10 --lr 1e-3 --mock-data --vocab-size 128")


def validated(extra):
    return validate_args(parse_args(args=(BASE + " " + extra).split()))


@pytest.fixture(autouse=True)
def single_process_env(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")


def test_flags_reach_the_transformer_config():
    config = core_transformer_config_from_args(validated(""))
    assert not config.cross_entropy_loss_fusion and not config.apply_query_key_layer_scaling
    args = validated("--cross-entropy-loss-fusion --cross-entropy-fusion-impl native --apply-query-key-layer-scaling")
    config = core_transformer_config_from_args(args)
    assert config.cross_entropy_loss_fusion and config.apply_query_key_layer_scaling


@pytest.mark.parametrize("extra, message", [
    ("--cross-entropy-loss-fusion --cross-entropy-fusion-impl te", "--cross-entropy-fusion-impl te needs Transformer"),
    ("--apply-query-key-layer-scaling --fp16 --context-parallel-size 2",
     "--apply-query-key-layer-scaling with --fp16 is not supported with --context-parallel-size > 1"),
])
def test_rules(extra, message):
    with pytest.raises(ValueError) as error:
        validated(extra)
    assert message in str(error.value)
