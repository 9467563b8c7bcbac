"""Hybrid (Mamba) model flags: the layer pattern they resolve to, upstream's --spec for the hybrid stack, and the
configuration the model is built from."""

import pytest

from megatron.training.model_config import core_transformer_config_from_args
from tests.unit_tests.training.argument_checks import validated

SHAPE = "--mamba-head-dim 16 --mamba-num-groups 2 --mamba-state-dim 8"


def test_a_gpt_model_has_no_pattern():
    args = validated()
    assert args.is_hybrid_model is False and args.hybrid_layer_pattern is None
    assert core_transformer_config_from_args(args).hybrid_layer_pattern is None


@pytest.mark.parametrize("extra, pattern", [
    ("--hybrid-override-pattern M*", "M*"),
    ("--is-hybrid-model", "MM"),
    ("--hybrid-attention-ratio 0.5", "M*"),
    ("--num-layers 8 --hybrid-attention-ratio 0.25 --hybrid-mlp-ratio 0.25", "M*M-M*M-"),
    ("--is-hybrid-model --spec megatron.core.models.mamba.mamba_layer_specs mamba_stack_spec", "MM"),
])
def test_the_flags_resolve_the_layer_pattern(extra, pattern):
    args = validated(f"{SHAPE} {extra}")
    assert args.is_hybrid_model and args.hybrid_layer_pattern == pattern and args.spec is None
    config = core_transformer_config_from_args(args)
    assert config.hybrid_layer_pattern == pattern
    assert (config.mamba_head_dim, config.mamba_num_groups, config.mamba_state_dim, config.mamba_heads) == (16, 2, 8, 8)


@pytest.mark.parametrize("extra, message", [
    ("--hybrid-override-pattern M*M", r"--hybrid-override-pattern 'M\*M' must give one of M, \*, -, E .* for each of "
                                      r"the --num-layers 2 layers"),
    ("--hybrid-attention-ratio 1.5", r"--hybrid-attention-ratio must be in \[0, 1\], got 1.5"),
    ("--hybrid-attention-ratio 0.6 --hybrid-mlp-ratio 0.6", r"exceed 1"),
    ("--spec megatron.core.models.mamba.mamba_layer_specs mamba_stack_spec",
     r"builds a hybrid model: launch pretrain_mamba.py"),
    ("--is-hybrid-model --mamba-num-groups 3", r"Mamba heads must divide into --mamba-num-groups 3"),
])
def test_bad_hybrid_flags_stop_naming_them(extra, message):
    with pytest.raises(ValueError, match=message):
        validated(f"--mamba-head-dim 16 {extra}")


def test_override_pattern_wins_over_ratios_that_disagree():
    with pytest.warns(UserWarning, match=r"--hybrid-attention-ratio 0.5 and --hybrid-mlp-ratio 0.0 disagree"):
        args = validated(f"{SHAPE} --hybrid-override-pattern MM --hybrid-attention-ratio 0.5")
    assert args.hybrid_layer_pattern == "MM"


def test_the_flop_estimate_counts_each_layer_by_its_kind():
    from megatron.training.training_log import training_flops_per_iteration

    args = validated(f"{SHAPE} --num-layers 3 --hybrid-override-pattern M*- --ffn-hidden-size 96")
    args.padded_vocab_size = 128
    hidden, seq, heads, inner, groups, state = 64, 32, 8, 128, 2, 8  # 8 Mamba heads of 16 channels
    mamba = 2 * hidden * (2 * inner + 2 * groups * state + heads) + 7 * inner * state + 2 * inner * hidden
    attention = 2 * hidden * 3 * hidden + 2 * hidden * hidden + 2 * seq * hidden  # QKV, projection, scores
    mlp = 2 * 2 * hidden * 96  # fc1 and fc2 (no gate)
    logits = 2 * hidden * 128
    assert training_flops_per_iteration(args, 4) == 3 * (mamba + attention + mlp + logits) * seq * 4


def test_use_checkpoint_args_restores_the_hybrid_model():
    from megatron.training.arguments import parse_args, validate_args
    from megatron.training.checkpoint_args import apply_checkpoint_args
    from tests.unit_tests.training.argument_checks import BASE

    saved = validated(f"{SHAPE} --hybrid-override-pattern M*")
    args = parse_args(args=BASE.split())  # a generation launch that names no hybrid flag
    apply_checkpoint_args(args, saved)
    args = validate_args(args)
    assert args.is_hybrid_model and args.hybrid_layer_pattern == "M*"
    config = core_transformer_config_from_args(args)
    assert (config.hybrid_layer_pattern, config.mamba_head_dim, config.mamba_state_dim) == ("M*", 16, 8)


def test_moe_layers_are_the_patterns_e_layers():
    args = validated(f"{SHAPE} --num-layers 4 --hybrid-override-pattern M*E- --num-experts 4")
    assert args.moe_layer_freq == [0, 0, 1, 0]
    config = core_transformer_config_from_args(args)
    assert config.moe_layer_freq == (0, 0, 1, 0) and config.num_moe_experts == 4
    for extra, message in (
            ("--hybrid-override-pattern ME", r"the 'E' layers of --hybrid-override-pattern 'ME' are Mixture-of-Experts "
                                             r"layers: give --num-experts"),
            ("--hybrid-override-pattern M- --num-experts 4",
             r"the pattern 'M-' has none: add them or drop --num-experts"),
            ("--hybrid-override-pattern ME --num-experts 4 --moe-layer-freq 1 --moe-layer-freq ([1]*2)",
             r"--moe-layer-freq \[1, 1\] disagrees with the 'E' layers")):
        with pytest.raises(ValueError, match=message):
            validated(f"{SHAPE} {extra}")


def test_the_step_clamp():
    config = core_transformer_config_from_args(validated(f"{SHAPE} --is-hybrid-model --mamba-dt-limit 0.001 inf"))
    assert config.mamba_dt_limit == (0.001, float("inf"))
    assert core_transformer_config_from_args(validated(f"{SHAPE} --is-hybrid-model")).mamba_dt_limit == (
        0.0, float("inf"))
    with pytest.raises(ValueError, match=r"--mamba-dt-limit 0.5 0.1: give 0 <= LOW < HIGH"):
        core_transformer_config_from_args(validated(f"{SHAPE} --is-hybrid-model --mamba-dt-limit 0.5 0.1"))


def test_an_upstream_hybrid_launch_line_validates():
    """The flags of upstream's Mamba example (ratios, GQA, --spec of the hybrid stack, sequence parallelism and the
    distributed optimizer), shrunk; pretrain_mamba.py sets --is-hybrid-model."""
    flags = ("--is-hybrid-model --tensor-model-parallel-size 2 --sequence-parallel --pipeline-model-parallel-size 1 "
             "--use-distributed-optimizer --overlap-param-gather --overlap-grad-reduce "
             "--untie-embeddings-and-output-weights --init-method-std 0.02 --position-embedding-type none "
             "--num-layers 12 --hidden-size 64 --num-attention-heads 4 --group-query-attention --num-query-groups 2 "
             "--hybrid-attention-ratio 0.08 --hybrid-mlp-ratio 0.5 --seq-length 32 --max-position-embeddings 32 "
             "--train-samples 64 --lr-warmup-samples 8 --lr-decay-samples 56 --micro-batch-size 2 "
             "--global-batch-size 8 --lr 2.5e-4 --min-lr 2.5e-5 --lr-decay-style cosine --weight-decay 0.1 "
             "--clip-grad 1.0 --attention-dropout 0.0 --hidden-dropout 0.0 --disable-bias-linear "
             "--normalization RMSNorm --adam-beta1 0.9 --adam-beta2 0.95 --use-mcore-models "
             "--spec megatron.core.models.mamba.mamba_layer_specs mamba_stack_spec "
             "--no-create-attention-mask-in-dataloader --mamba-head-dim 16 --mamba-num-groups 2")
    from tests.unit_tests.training.argument_checks import validated as validated_on

    args = validated_on(flags, world_size=2, base="--mock-data --vocab-size 128 --distributed-backend gloo")
    # 12 layers: round(0.96) = 1 attention layer among the 6 Mamba and attention layers, each followed by an MLP.
    assert args.hybrid_layer_pattern == "M-M-M-*-M-M-" and args.spec is None
    assert core_transformer_config_from_args(args).hybrid_layer_pattern == args.hybrid_layer_pattern


def test_loading_under_other_hybrid_flags_names_them():
    from megatron.training.checkpoint_args import architecture_differences

    saved = validated(f"{SHAPE} --hybrid-override-pattern M* --mamba-dt-limit 0.001 inf")
    assert architecture_differences(saved, validated(f"{SHAPE} --hybrid-override-pattern M* "
                                                     "--mamba-dt-limit 0.001 inf")) == []
    assert architecture_differences(saved, validated(f"{SHAPE} --hybrid-override-pattern *M")) == [
        "--hybrid-override-pattern: M* in the checkpoint, *M in this run",
        "--mamba-dt-limit: (0.001, inf) in the checkpoint, (0.0, inf) in this run"]
    assert architecture_differences(saved, validated()) == ["--hybrid-override-pattern: M* in the checkpoint, none in "
                                                            "this run"]
