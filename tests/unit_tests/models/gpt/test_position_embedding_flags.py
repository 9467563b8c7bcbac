"""`--position-embedding-type` as upstream scripts spell it: none builds a model without any position information,
the upstream values this build does not offer stop with what to use instead, and the rotary flags warn where no
rotary embedding reads them."""

import warnings

import pytest

from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.training.arguments import parse_args, validate_args
from megatron.training.model_config import core_transformer_config_from_args

BASE = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 8 --micro-batch-size 2 "
        "--train-iters 2 --lr 1e-3 --mock-data --vocab-size 64 --hidden-dropout 0 --attention-dropout 0")


@pytest.fixture(autouse=True)
def single_process_env(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")


def validated(extra):
    return validate_args(parse_args(args=f"{BASE} {extra}".split()))


def _model_of(args):
    return GPTModel(core_transformer_config_from_args(args), vocab_size=64,
                    max_sequence_length=args.max_position_embeddings,
                    position_embedding_type=args.position_embedding_type, share_embeddings_and_output_weights=True)


@pytest.mark.parametrize("extra", ["--position-embedding-type none",
                                   "--position-embedding-type none --no-position-embedding"])
def test_none_builds_a_model_without_position_information(extra):
    args = validated(extra)
    assert args.position_embedding_type == "none"
    model = _model_of(args)
    assert model.rotary_pos_emb is None
    assert not [name for name in model.state_dict() if "position_embeddings" in name]
    learned = _model_of(validated(""))
    assert [name for name in learned.state_dict() if "position_embeddings" in name] == [
        "embedding.position_embeddings.weight"]


@pytest.mark.parametrize("value", ["mrope", "relative"])
def test_upstream_values_without_a_gpt_model_stop_with_what_to_use(value):
    with pytest.raises(ValueError, match=rf"^--position-embedding-type {value} is not offered: .*use "
                                         r"--position-embedding-type rope"):
        validated(f"--position-embedding-type {value}")


@pytest.mark.parametrize("flag", ["--rotary-base 500000", "--rotary-percent 0.5"])
@pytest.mark.parametrize("position_embedding_type", ["learned_absolute", "none"])
def test_rotary_flags_without_rotary_embeddings_warn(flag, position_embedding_type):
    with pytest.warns(UserWarning, match=rf"^{flag.split()[0]} .* has no effect with --position-embedding-type "
                                         rf"{position_embedding_type}"):
        validated(f"--position-embedding-type {position_embedding_type} {flag}")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert validated(f"--position-embedding-type rope {flag}").position_embedding_type == "rope"


@pytest.mark.parametrize("position_embedding_type", ["rope", "yarn"])
def test_non_positive_rotary_base_stops_at_the_flags(position_embedding_type):
    with pytest.raises(ValueError, match=r"^--rotary-base must be positive, got 0 "):
        validated(f"--position-embedding-type {position_embedding_type} --rotary-base 0")


def test_learned_positions_shorter_than_the_sequence_say_what_to_do():
    with pytest.raises(ValueError, match=r"^--seq-length \(8\) must not exceed --max-position-embeddings \(4\) .*: "
                                         r"raise --max-position-embeddings, shorten --seq-length, or use "
                                         r"--position-embedding-type rope$"):
        validated("--max-position-embeddings 4")
    assert validated("--max-position-embeddings 4 --position-embedding-type rope").max_position_embeddings == 4


@pytest.mark.parametrize("position_embedding_type", ["rope", "yarn"])
@pytest.mark.parametrize("shape, rotated", [("--kv-channels 6 --rotary-percent 0.5", 3), ("--kv-channels 3", 3),
                                            ("--rotary-percent 0.1", 0)])
def test_an_odd_rotary_width_stops_at_the_flags(position_embedding_type, shape, rotated):
    with pytest.raises(ValueError, match=rf"^--kv-channels \(\d+\) x --rotary-percent \([\d.]+\) gives {rotated} "
                                         r"rotated channels per head, but RoPE rotates channel pairs: .*change "
                                         r"--rotary-percent or --kv-channels"):
        validated(f"--position-embedding-type {position_embedding_type} {shape}")
    args = validated(f"--position-embedding-type {position_embedding_type} --kv-channels 6 --rotary-percent 0.34")
    model = GPTModel(core_transformer_config_from_args(args), vocab_size=64, max_sequence_length=8,
                     position_embedding_type=position_embedding_type, rotary_percent=args.rotary_percent)
    assert model.rotary_pos_emb.rot_dim == 2
