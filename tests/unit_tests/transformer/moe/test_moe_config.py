"""MoE config fields and flags: `--moe-layer-freq` patterns, defaults filled, single and listed load-balancing
settings, the new router flags reaching the config, and bad input (also `--moe-token-dispatcher-type flex`)
stopped with messages that name the flags."""

import pytest

from megatron.core.transformer.moe.moe_config import (
    aux_loss_terms,
    layer_pattern_from_freq,
    moe_layer_pattern,
    parse_moe_layer_freq,
)
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.training.arguments import parse_args, validate_args

SHAPE = dict(num_layers=4, hidden_size=32, num_attention_heads=4)


def moe_config(**overrides):
    fields = dict(SHAPE, num_moe_experts=4, moe_router_topk=2)
    fields.update(overrides)
    return TransformerConfig(**fields)


def test_layer_freq_patterns():
    assert parse_moe_layer_freq("([0]*3+[1]*5)") == [0, 0, 0, 1, 1, 1, 1, 1]
    assert parse_moe_layer_freq("[1,0]*2") == [1, 0, 1, 0]
    assert parse_moe_layer_freq("3") == 3
    assert layer_pattern_from_freq(2, 5) == [True, False, True, False, True]
    assert moe_layer_pattern(moe_config(moe_layer_freq="([0]*3+[1]*1)")) == [False, False, False, True]
    assert moe_layer_pattern(TransformerConfig(**SHAPE)) == [False] * 4
    with pytest.raises(ValueError, match="--moe-layer-freq"):
        parse_moe_layer_freq("__import__('os')")


def test_top1_routing_takes_the_softmax_before_the_choice_or_scores_that_need_none():
    """As upstream: top-1 softmax routing needs --moe-router-pre-softmax (a softmax over one chosen logit is 1
    and gives the router no gradient); sigmoid and sinkhorn routing need nothing."""
    assert moe_config(moe_router_topk=1, moe_router_pre_softmax=True).moe_router_topk == 1
    assert moe_config(moe_router_topk=1, moe_router_score_function="sigmoid").moe_router_topk == 1
    assert moe_config(moe_router_topk=1, moe_router_load_balancing_type="sinkhorn").moe_router_topk == 1


def test_expert_tensor_parallel_size_may_differ_from_tensor_parallel_size():
    config = moe_config(tensor_model_parallel_size=2, sequence_parallel=True, expert_tensor_parallel_size=1,
                        moe_ffn_hidden_size=33)
    assert (config.tensor_model_parallel_size, config.expert_tensor_parallel_size) == (2, 1)
    assert moe_config(expert_tensor_parallel_size=2).expert_tensor_parallel_size == 2


def test_tensor_parallel_without_sequence_parallel_is_a_valid_config_and_training_flags_ask_for_it(monkeypatch):
    """The config takes MoE at TP2 without --sequence-parallel (generation runs it; the MoE layer refuses to
    train so); pretrain_gpt's flags refuse it for training, and take it from a generation program's parser."""
    config = moe_config(tensor_model_parallel_size=2)
    assert (config.tensor_model_parallel_size, config.sequence_parallel) == (2, False)
    with pytest.raises(ValueError, match="--tensor-model-parallel-size 2 need --sequence-parallel for training"):
        _validated("--num-experts 4 --tensor-model-parallel-size 2", monkeypatch)
    assert _validated("--num-experts 4 --tensor-model-parallel-size 2 --sequence-parallel", monkeypatch).num_experts
    monkeypatch.setenv("WORLD_SIZE", "2")
    generation = parse_args(args=f"{ARGS} --num-experts 4 --tensor-model-parallel-size 2".split())
    generation.generation_program = True  # what megatron.inference.launch.declare_generation_program sets
    assert not validate_args(generation).sequence_parallel


def test_defaults_filled():
    config = moe_config(ffn_hidden_size=48)
    assert config.moe_ffn_hidden_size == 48
    assert config.expert_tensor_parallel_size == 1
    assert config.num_local_experts == 4
    assert moe_config(moe_expert_capacity_factor=-1.0).moe_expert_capacity_factor is None  # negative: dropless


@pytest.mark.parametrize("overrides, flags", [
    (dict(num_moe_experts=3, expert_model_parallel_size=2), ["--num-experts", "--expert-model-parallel-size"]),
    (dict(moe_router_topk=5), ["--moe-router-topk", "--num-experts"]),
    (dict(moe_router_num_groups=3, moe_router_group_topk=1), ["--moe-router-num-groups", "--num-experts"]),
    (dict(moe_router_num_groups=2, moe_router_group_topk=3),
     ["--moe-router-group-topk", "--moe-router-num-groups"]),
    (dict(moe_router_num_groups=2), ["--moe-router-num-groups", "--moe-router-group-topk"]),
    (dict(moe_pad_expert_input_to_capacity=True),
     ["--moe-pad-expert-input-to-capacity", "--moe-expert-capacity-factor"]),
    (dict(moe_expert_capacity_factor=1.0, moe_router_load_balancing_type="sinkhorn"),
     ["--moe-expert-capacity-factor", "--moe-router-load-balancing-type"]),
    (dict(moe_shared_expert_intermediate_size=32, moe_shared_expert_overlap=True),
     ["--moe-shared-expert-overlap", "--moe-token-dispatcher-type alltoall"]),
    (dict(moe_router_enable_expert_bias=True), ["--moe-router-enable-expert-bias", "--moe-router-score-function"]),
    (dict(moe_router_load_balancing_type="sinkhorn", moe_aux_loss_coeff=0.1), ["sinkhorn", "--moe-aux-loss-coeff"]),
    # Sinkhorn routing reads none of these: refused instead of silently ignored.
    (dict(moe_router_load_balancing_type="sinkhorn", moe_router_score_function="sigmoid",
          moe_router_enable_expert_bias=True),
     ["--moe-router-load-balancing-type sinkhorn ignores --moe-router-enable-expert-bias, "
      "--moe-router-score-function sigmoid (", "drop them"]),
    (dict(moe_router_load_balancing_type="sinkhorn", moe_router_num_groups=2, moe_router_group_topk=1),
     ["sinkhorn ignores --moe-router-num-groups / --moe-router-group-topk"]),
    (dict(moe_router_load_balancing_type="sinkhorn", moe_router_topk_scaling_factor=2.0),
     ["sinkhorn ignores --moe-router-topk-scaling-factor"]),
    (dict(expert_tensor_parallel_size=0), ["--expert-tensor-parallel-size", "positive integer"]),
    (dict(expert_tensor_parallel_size=2, moe_ffn_hidden_size=33),
     ["--moe-ffn-hidden-size (33)", "--expert-tensor-parallel-size (2)"]),
    (dict(expert_tensor_parallel_size=2, fp8="hybrid"),
     ["--fp8-format", "--expert-tensor-parallel-size (2)", "--tensor-model-parallel-size (1)"]),
    (dict(moe_layer_freq=[1, 0]), ["--moe-layer-freq", "--num-layers"]),
    (dict(moe_router_dtype="bf16"), ["--moe-router-dtype"]),
    (dict(fp8="hybrid", transformer_impl="transformer_engine"),
     ["--fp8-format", "--num-experts", "--transformer-impl local"]),
    (dict(num_moe_experts=None, moe_router_topk=4), ["--moe-router-topk", "--num-experts"]),
    (dict(num_moe_experts=None, expert_model_parallel_size=2), ["--expert-model-parallel-size", "--num-experts"]),
    (dict(moe_router_enable_expert_bias=True, moe_router_score_function="softmax"),
     ["--moe-router-enable-expert-bias", "sigmoid or sqrtsoftplus"]),
    (dict(moe_router_load_balancing_type=("seq_aux_loss", "global_aux_loss"), moe_aux_loss_coeff=0.1),
     ["--moe-aux-loss-coeff", "--moe-router-load-balancing-type", "got 1", "for 2"]),
    (dict(moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=[0.1, 0.2]),
     ["--moe-aux-loss-coeff", "--moe-router-load-balancing-type"]),
    (dict(moe_router_load_balancing_type=["sinkhorn", "aux_loss"], moe_aux_loss_coeff=[0.0, 0.1]),
     ["--moe-router-load-balancing-type sinkhorn", "cannot be combined"]),
    (dict(moe_router_load_balancing_type=["aux_loss", "none"], moe_aux_loss_coeff=[0.1, 0.0]),
     ["--moe-router-load-balancing-type none", "cannot be combined"]),
    (dict(moe_router_load_balancing_type=["aux_loss", "aux_loss"], moe_aux_loss_coeff=[0.1, 0.2]),
     ["--moe-router-load-balancing-type", "twice"]),
    (dict(moe_router_load_balancing_type=["aux_loss", "switch"], moe_aux_loss_coeff=[0.1, 0.2]),
     ["--moe-router-load-balancing-type", "switch", "global_aux_loss"]),
    (dict(moe_router_load_balancing_type=["aux_loss", "seq_aux_loss"], moe_aux_loss_coeff=[0.1, -0.2]),
     ["--moe-aux-loss-coeff", ">= 0"]),
    (dict(moe_shared_expert_gate=True), ["--moe-shared-expert-gate", "--moe-shared-expert-intermediate-size"]),
    (dict(num_moe_experts=None, moe_shared_expert_gate=True), ["--moe-shared-expert-gate", "--num-experts"]),
    (dict(moe_token_dispatcher_type="flex"),
     ["--moe-token-dispatcher-type flex", "DeepEP", "HybridEP", "CUDA", "alltoall", "allgather"]),
    (dict(moe_router_topk=1), ["--moe-router-topk 1", "--moe-router-pre-softmax"]),
    (dict(moe_router_topk=1, moe_router_load_balancing_type=["aux_loss"], moe_aux_loss_coeff=[0.1]),
     ["--moe-router-topk 1", "--moe-router-pre-softmax"]),
])
def test_bad_config_names_the_flags(overrides, flags):
    with pytest.raises(ValueError) as error:
        moe_config(**overrides)
    for flag in flags:
        assert flag in str(error.value)


@pytest.mark.parametrize("extra, message", [
    ("--moe-router-num-groups 4",
     "--moe-router-num-groups (4) without --moe-router-group-topk: group-limited routing needs both; add "
     "--moe-router-group-topk g (the 1 <= g <= 4 groups each token may use), or drop --moe-router-num-groups to "
     "route over all experts"),
    ("--moe-router-group-topk 2",
     "--moe-router-group-topk (2) without --moe-router-num-groups: group-limited routing needs both; add "
     "--moe-router-num-groups G (a divisor of --num-experts (8) that splits the experts into G groups), or drop "
     "--moe-router-group-topk"),
])
def test_group_limited_routing_flag_alone_says_what_to_add_or_drop(extra, message, monkeypatch):
    with pytest.raises(ValueError) as error:
        _validated(f"--num-experts 8 {extra}", monkeypatch, world_size=1)
    assert str(error.value) == message


ARGS = ("--num-layers 4 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --micro-batch-size 1 "
        "--global-batch-size 2 --train-iters 2 --lr 1e-3 --mock-data --vocab-size 128")


def _validated(extra, monkeypatch, world_size=2):
    monkeypatch.setenv("WORLD_SIZE", str(world_size))
    monkeypatch.setenv("RANK", "0")
    return validate_args(parse_args(args=f"{ARGS} {extra}".split()))


def test_flags_reach_the_config(monkeypatch):
    from megatron.training.model_config import core_transformer_config_from_args

    args = _validated("--num-experts 4 --expert-model-parallel-size 2 --moe-router-topk 1 --moe-layer-freq "
                      "([1]*2+[0]*2) --moe-router-score-function sigmoid --moe-router-enable-expert-bias "
                      "--moe-token-dispatcher-type alltoall --moe-grouped-gemm --moe-router-dtype fp64", monkeypatch)
    config = core_transformer_config_from_args(args)
    assert (config.num_moe_experts, config.expert_model_parallel_size, config.moe_router_topk) == (4, 2, 1)
    assert config.moe_layer_freq == (1, 1, 0, 0) and config.moe_router_enable_expert_bias
    assert (config.moe_token_dispatcher_type, config.moe_grouped_gemm, config.moe_router_dtype) == \
        ("alltoall", True, "fp64")


def test_upstream_recipe_flags_validate(monkeypatch):
    """Flag combinations of upstream recipes: DeepSeek-V3's router (--moe-router-pre-softmax beside sigmoid
    scores, no effect), --num-experts 0 (no MoE), and --moe-router-padding-for-quantization (the newer name of
    --moe-router-padding-for-fp8)."""
    from megatron.training.model_config import core_transformer_config_from_args

    args = _validated("--num-experts 4 --moe-router-topk 2 --moe-router-pre-softmax --moe-router-score-function "
                      "sigmoid --moe-router-enable-expert-bias --moe-router-num-groups 2 --moe-router-group-topk 1 "
                      "--moe-router-topk-scaling-factor 2.5 --moe-router-load-balancing-type seq_aux_loss "
                      "--moe-aux-loss-coeff 1e-4 --moe-router-dtype fp32", monkeypatch)
    config = core_transformer_config_from_args(args)
    assert config.moe_router_pre_softmax and config.moe_router_score_function == "sigmoid"
    no_moe = _validated("--num-experts 0", monkeypatch)
    assert no_moe.num_experts is None and core_transformer_config_from_args(no_moe).num_moe_experts is None
    padded = _validated("--num-experts 4 --moe-router-padding-for-quantization --fp8-format e4m3", monkeypatch)
    assert core_transformer_config_from_args(padded).moe_router_padding_for_fp8
    # Newer upstream flags: performance switches parse; upcycling needs its checkpoints, granular upcycling is refused.
    overlapped = _validated("--num-experts 4 --moe-token-dispatcher-type alltoall --overlap-moe-expert-parallel-comm "
                            "--moe-flex-dispatcher-backend hybridep --moe-hybridep-num-sms 8", monkeypatch)
    assert overlapped.overlap_moe_expert_parallel_comm and overlapped.moe_token_dispatcher_type == "alltoall"
    with pytest.raises(ValueError, match="--moe-use-upcycling needs --load, --save"):
        _validated("--num-experts 4 --moe-use-upcycling", monkeypatch)
    with pytest.raises(ValueError, match="--moe-upcycling-granularity 2: granular upcycling .* is not built"):
        _validated("--num-experts 4 --moe-upcycling-granularity 2", monkeypatch)


def test_load_balancing_settings_single_or_listed():
    """A single type and coefficient stay a str and a float (also given as one-element lists); several become
    tuples paired element by element."""
    single = moe_config(moe_router_load_balancing_type=["seq_aux_loss"], moe_aux_loss_coeff=[0.01])
    assert (single.moe_router_load_balancing_type, single.moe_aux_loss_coeff) == ("seq_aux_loss", 0.01)
    default = moe_config()
    assert (default.moe_router_load_balancing_type, default.moe_aux_loss_coeff) == ("aux_loss", 0.0)
    listed = moe_config(moe_router_load_balancing_type=["seq_aux_loss", "global_aux_loss"],
                        moe_aux_loss_coeff=[0.01, 0.001])
    assert listed.moe_router_load_balancing_type == ("seq_aux_loss", "global_aux_loss")
    assert listed.moe_aux_loss_coeff == (0.01, 0.001)
    assert aux_loss_terms(listed.moe_router_load_balancing_type, listed.moe_aux_loss_coeff) == [
        ("seq_aux_loss", 0.01), ("global_aux_loss", 0.001)]
    assert aux_loss_terms(("aux_loss", "global_aux_loss"), (0.0, 0.5)) == [("global_aux_loss", 0.5)]
    assert aux_loss_terms("none", 0.3) == [] and aux_loss_terms("aux_loss", 0.0) == []
    sqrtsoftplus = moe_config(moe_router_score_function="sqrtsoftplus", moe_router_enable_expert_bias=True,
                              moe_router_num_groups=2, moe_router_group_topk=1)
    assert sqrtsoftplus.moe_router_score_function == "sqrtsoftplus"


def test_new_router_flags_reach_the_config(monkeypatch):
    from megatron.training.model_config import core_transformer_config_from_args

    args = _validated("--num-experts 4 --moe-router-score-function sqrtsoftplus --moe-router-enable-expert-bias "
                      "--moe-router-load-balancing-type seq_aux_loss global_aux_loss --moe-aux-loss-coeff 0.01 0.001 "
                      "--moe-shared-expert-intermediate-size 32 --moe-shared-expert-gate", monkeypatch)
    assert args.moe_router_load_balancing_type == ["seq_aux_loss", "global_aux_loss"]
    assert args.moe_aux_loss_coeff == [0.01, 0.001]
    config = core_transformer_config_from_args(args)
    assert config.moe_router_score_function == "sqrtsoftplus" and config.moe_router_enable_expert_bias
    assert config.moe_router_load_balancing_type == ("seq_aux_loss", "global_aux_loss")
    assert config.moe_aux_loss_coeff == (0.01, 0.001)
    assert config.moe_shared_expert_gate and config.moe_shared_expert_intermediate_size == 32


def test_single_load_balancing_flags_stay_scalars(monkeypatch):
    """One value per flag gives the args (and so the checkpoints' saved args) a str and a float, as before the
    flags took lists; unset, the defaults."""
    args = _validated("--num-experts 4 --moe-router-load-balancing-type seq_aux_loss --moe-aux-loss-coeff 0.01",
                      monkeypatch)
    assert (args.moe_router_load_balancing_type, args.moe_aux_loss_coeff) == ("seq_aux_loss", 0.01)
    args = _validated("--num-experts 4", monkeypatch)
    assert (args.moe_router_load_balancing_type, args.moe_aux_loss_coeff) == ("aux_loss", 0.0)


def test_unknown_load_balancing_type_stops_the_parser(capsys):
    with pytest.raises(SystemExit):
        parse_args(args=f"{ARGS} --num-experts 4 --moe-router-load-balancing-type aux_loss switch".split())
    assert "--moe-router-load-balancing-type" in capsys.readouterr().err


@pytest.mark.parametrize("extra, flags", [
    ("--num-experts 4 --moe-router-load-balancing-type aux_loss global_aux_loss --moe-aux-loss-coeff 0.1",
     ["--moe-aux-loss-coeff", "--moe-router-load-balancing-type"]),
    ("--num-experts 4 --moe-router-load-balancing-type sinkhorn aux_loss --moe-aux-loss-coeff 0 0.1",
     ["--moe-router-load-balancing-type sinkhorn", "cannot be combined"]),
    ("--num-experts 4 --moe-shared-expert-gate",
     ["--moe-shared-expert-gate", "--moe-shared-expert-intermediate-size"]),
    ("--num-experts 4 --moe-token-dispatcher-type flex",
     ["--moe-token-dispatcher-type flex", "DeepEP", "alltoall"]),
    ("--num-experts 3 --expert-model-parallel-size 2", ["--num-experts", "--expert-model-parallel-size"]),
    ("--num-experts 4 --moe-router-topk 8", ["--moe-router-topk"]),
    ("--num-experts 4 --moe-router-num-groups 3 --moe-router-group-topk 1", ["--moe-router-num-groups"]),
    ("--moe-router-topk 1", ["--moe-router-topk", "--num-experts"]),
    ("--num-experts 4 --expert-model-parallel-size 4", ["--expert-model-parallel-size"]),
    ("--num-experts 4 --tensor-model-parallel-size 2",
     ["--num-experts 4", "--tensor-model-parallel-size 2", "need --sequence-parallel for training"]),
])
def test_bad_flags_name_the_flags(extra, flags, monkeypatch):
    with pytest.raises(ValueError) as error:
        _validated(extra, monkeypatch)
    for flag in flags:
        assert flag in str(error.value)


def test_upstream_config_fields_of_fused_kernels_and_renamed_padding():
    """TransformerConfig takes upstream's MoE fields: the kernel switches (no effect here), the newer name of the
    FP8 padding (setting both names), and DeepEP refused by name."""
    config = moe_config(moe_permute_fusion=True, moe_router_fusion=True, moe_use_legacy_grouped_gemm=True,
                        moe_deepep_num_sms=24)
    assert (config.moe_permute_fusion, config.moe_router_fusion, config.moe_deepep_num_sms) == (True, True, 24)
    padded = moe_config(moe_router_padding_for_quantization=True, fp8="e4m3", transformer_impl="local")
    assert padded.moe_router_padding_for_fp8 and padded.moe_router_padding_for_quantization
    assert moe_config(moe_router_padding_for_fp8=True, fp8="e4m3",
                      transformer_impl="local").moe_router_padding_for_quantization
    with pytest.raises(ValueError, match="--fp8-format"):
        moe_config(moe_router_padding_for_quantization=True)
    with pytest.raises(ValueError, match="--moe-router-padding-for-quantization needs --num-experts"):
        TransformerConfig(**SHAPE, moe_router_padding_for_quantization=True)
    with pytest.raises(ValueError, match="--moe-enable-deepep"):
        moe_config(moe_enable_deepep=True)


def test_upstream_topk_limited_devices_field_names_its_replacement():
    with pytest.raises(ValueError, match=r"moe_router_topk_limited_devices \(--moe-router-topk-limited-devices\) "
                                         r"was replaced .*: set moe_router_num_groups=2 .* moe_router_group_topk=1"):
        moe_config(moe_router_topk_limited_devices=1, expert_model_parallel_size=2)
    with pytest.raises(ValueError, match="at expert_model_parallel_size 1 it limits nothing: drop it"):
        moe_config(moe_router_topk_limited_devices=2)
    assert moe_config().moe_router_topk_limited_devices is None
