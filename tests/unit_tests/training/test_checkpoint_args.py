"""The RoPE scaling and interpolation flags among the model flags a checkpoint imposes and compares
(checkpoint_args.py): a load names them when they differ, an older checkpoint without them is not compared, and
--use-checkpoint-args takes them (and the layers multi-token prediction adds). Of the MoE flags, the layout is
compared, the routing choices are not. --use-checkpoint-args also takes the padded vocabulary, as upstream."""

import argparse

import pytest

from megatron.training.checkpoint_args import apply_checkpoint_args, architecture_differences


def _rope_args(**flags):
    return argparse.Namespace(position_embedding_type="rope", rotary_base=500000, **flags)


def test_rope_scaling_flags_are_compared_on_load():
    llama31 = _rope_args(use_rope_scaling=True, rope_scaling_factor=8.0)
    assert architecture_differences(llama31, _rope_args(use_rope_scaling=True, rope_scaling_factor=8.0)) == []
    assert architecture_differences(llama31, _rope_args(use_rope_scaling=False, rope_scaling_factor=8.0)) == [
        "--use-rope-scaling: set in the checkpoint, not set in this run"]
    assert architecture_differences(llama31, _rope_args(use_rope_scaling=True, rope_scaling_factor=32.0)) == [
        "--rope-scaling-factor: 8.0 in the checkpoint, 32.0 in this run"]
    # the factor means nothing without the switch; a checkpoint older than the flags is not compared
    unscaled = _rope_args(use_rope_scaling=False, rope_scaling_factor=8.0)
    assert architecture_differences(unscaled, _rope_args(use_rope_scaling=False, rope_scaling_factor=32.0)) == []
    assert architecture_differences(_rope_args(), llama31) == []


def test_use_checkpoint_args_takes_the_rope_scaling_flags():
    args = _rope_args(use_rope_scaling=False, rope_scaling_factor=8.0)
    changed = apply_checkpoint_args(args, _rope_args(use_rope_scaling=True, rope_scaling_factor=32.0))
    assert (args.use_rope_scaling, args.rope_scaling_factor) == (True, 32.0)
    assert changed == ["--use-rope-scaling True (command line: False)",
                       "--rope-scaling-factor 32.0 (command line: 8.0)"]


def test_rope_position_interpolation_is_compared_on_load():
    interpolated = _rope_args(rotary_seq_len_interpolation_factor=4.0)
    assert architecture_differences(interpolated, _rope_args(rotary_seq_len_interpolation_factor=4.0)) == []
    # unset divides the positions by nothing: the same as a factor of 1, and a difference from 4
    assert architecture_differences(interpolated, _rope_args(rotary_seq_len_interpolation_factor=None)) == [
        "--rotary-seq-len-interpolation-factor: 4.0 in the checkpoint, 1.0 in this run"]
    assert architecture_differences(_rope_args(rotary_seq_len_interpolation_factor=None),
                                    _rope_args(rotary_seq_len_interpolation_factor=1.0)) == []
    assert architecture_differences(_rope_args(), interpolated) == []  # a checkpoint older than the flag


def test_use_checkpoint_args_takes_position_interpolation_and_the_layers_it_adds():
    args = _rope_args(rotary_seq_len_interpolation_factor=None, mtp_num_layers=None, moe_apply_probs_on_input=False)
    changed = apply_checkpoint_args(args, _rope_args(rotary_seq_len_interpolation_factor=2.0, mtp_num_layers=1,
                                                     moe_apply_probs_on_input=True))
    assert (args.rotary_seq_len_interpolation_factor, args.mtp_num_layers, args.moe_apply_probs_on_input) == (
        2.0, 1, True)
    assert changed == ["--moe-apply-probs-on-input True (command line: False)"]  # unset values are not reported


def test_use_checkpoint_args_takes_the_key_value_heads_only_with_group_query_attention():
    # Validation stores one key/value head per attention head in args when --group-query-attention is off: that
    # derived value must not come back as a --num-query-groups the user never gave (validation warns about it).
    command_line = dict(num_attention_heads=8, num_query_groups=1, group_query_attention=False)
    args = argparse.Namespace(**command_line)
    changed = apply_checkpoint_args(args, argparse.Namespace(num_attention_heads=4, num_query_groups=4,
                                                             group_query_attention=False))
    assert (args.num_attention_heads, args.num_query_groups, args.group_query_attention) == (4, 1, False)
    assert changed == ["--num-attention-heads 4 (command line: 8)"]
    args = argparse.Namespace(**command_line)
    changed = apply_checkpoint_args(args, argparse.Namespace(num_attention_heads=4, num_query_groups=2,
                                                             group_query_attention=True))
    assert (args.num_attention_heads, args.num_query_groups, args.group_query_attention) == (4, 2, True)
    assert changed == ["--num-attention-heads 4 (command line: 8)", "--num-query-groups 2 (command line: 1)",
                       "--group-query-attention True (command line: False)"]


def _moe_args(**flags):
    moe = dict(num_layers=4, ffn_hidden_size=128, num_experts=8, moe_ffn_hidden_size=None, moe_layer_freq=1,
               moe_shared_expert_intermediate_size=None, moe_shared_expert_gate=False, moe_router_topk=2,
               moe_router_score_function="softmax", moe_router_pre_softmax=False, moe_expert_capacity_factor=None,
               moe_aux_loss_coeff=0.0, moe_router_enable_expert_bias=False)
    return argparse.Namespace(**{**moe, **flags})


def test_moe_layout_flags_are_compared_on_load_and_routing_choices_are_not():
    from megatron.core.dist_checkpointing.serialization import CheckpointError
    from megatron.training.checkpoint_args import check_same_architecture

    moe = _moe_args()
    assert architecture_differences(moe, _moe_args(num_experts=4)) == [
        "--num-experts: 8 in the checkpoint, 4 in this run"]
    assert architecture_differences(_moe_args(num_experts=None), moe) == [
        "--num-experts: 0 in the checkpoint, 8 in this run"]
    # the expert width defaults to --ffn-hidden-size; the layer frequency is compared layer by layer
    assert architecture_differences(moe, _moe_args(moe_ffn_hidden_size=128)) == []
    assert architecture_differences(moe, _moe_args(moe_ffn_hidden_size=64)) == [
        "--moe-ffn-hidden-size: 128 in the checkpoint, 64 in this run"]
    assert architecture_differences(_moe_args(moe_layer_freq=2), _moe_args(moe_layer_freq=[1, 0, 1, 0])) == []
    assert architecture_differences(_moe_args(moe_layer_freq=2), moe) == [
        "--moe-layer-freq: [1,0,1,0] in the checkpoint, [1,1,1,1] in this run"]
    shared = _moe_args(moe_shared_expert_intermediate_size=256, moe_shared_expert_gate=True)
    assert architecture_differences(shared, moe) == [
        "--moe-shared-expert-intermediate-size: 256 in the checkpoint, 0 in this run"]
    assert architecture_differences(shared, _moe_args(moe_shared_expert_intermediate_size=256)) == [
        "--moe-shared-expert-gate: set in the checkpoint, not set in this run"]
    routed_otherwise = _moe_args(moe_router_topk=4, moe_router_score_function="sigmoid", moe_router_pre_softmax=True,
                                 moe_expert_capacity_factor=1.5, moe_aux_loss_coeff=0.01,
                                 moe_router_enable_expert_bias=True)
    assert architecture_differences(moe, routed_otherwise) == []
    # dense models on both sides, and a checkpoint older than the flags, compare nothing of MoE
    dense = _moe_args(num_experts=None, moe_layer_freq=2, moe_ffn_hidden_size=64)
    assert architecture_differences(dense, _moe_args(num_experts=None)) == []
    assert architecture_differences(argparse.Namespace(num_layers=4, ffn_hidden_size=128), moe) == []
    with pytest.raises(CheckpointError, match=r"launch with the checkpoint's --num-experts 8, --moe-layer-freq "
                                              r"\[1,1,1,1\], --moe-shared-expert-intermediate-size 256"):
        check_same_architecture("ckpt", _moe_args(moe_shared_expert_intermediate_size=256),
                                _moe_args(num_experts=2, moe_layer_freq=2))
    with pytest.raises(CheckpointError, match=r"launch with the checkpoint's no --num-experts \(dense MLPs\) \("):
        check_same_architecture("ckpt", _moe_args(num_experts=None), moe)


def test_latent_moe_width_is_compared_on_load_and_taken_with_the_checkpoint_args():
    from megatron.core.dist_checkpointing.serialization import CheckpointError
    from megatron.training.checkpoint_args import check_same_architecture

    latent = _moe_args(moe_latent_size=32)
    assert architecture_differences(latent, _moe_args(moe_latent_size=32)) == []
    assert architecture_differences(latent, _moe_args(moe_latent_size=None)) == [
        "--moe-latent-size: 32 in the checkpoint, 0 in this run"]
    assert architecture_differences(_moe_args(moe_latent_size=None), _moe_args(moe_latent_size=16)) == [
        "--moe-latent-size: 0 in the checkpoint, 16 in this run"]
    assert architecture_differences(_moe_args(), latent) == []  # saved before the flag existed
    with pytest.raises(CheckpointError, match=r"launch with the checkpoint's no --moe-latent-size \(experts at the "
                                              r"hidden width\)"):
        check_same_architecture("ckpt", _moe_args(moe_latent_size=None), latent)
    args = _moe_args(moe_latent_size=None)
    apply_checkpoint_args(args, latent)
    assert args.moe_latent_size == 32
    args = _moe_args(moe_latent_size=16)
    assert apply_checkpoint_args(args, latent) == ["--moe-latent-size 32 (command line: 16)"]
    assert args.moe_latent_size == 32


def test_norm_epsilon_is_compared_on_load():
    llama3 = argparse.Namespace(normalization="RMSNorm", norm_epsilon=1e-6)
    assert architecture_differences(llama3, argparse.Namespace(normalization="RMSNorm", norm_epsilon=1e-6)) == []
    assert architecture_differences(llama3, argparse.Namespace(normalization="RMSNorm", norm_epsilon=1e-5)) == [
        "--norm-epsilon: 1e-06 in the checkpoint, 1e-05 in this run"]
    assert architecture_differences(argparse.Namespace(normalization="RMSNorm"), llama3) == []  # not recorded


def test_padding_divisor_that_gives_exactly_the_rows():
    from megatron.training.tokenizer import exact_padding_divisor, pad_vocab_size

    # the byte-level tokenizer's 257 tokens in 320 rows: 64 at TP 1, 32 x 2, 16 x 4; at TP 8 only 8 x 8 = 64 rows
    assert [exact_padding_divisor(257, 320, tp) for tp in (1, 2, 4, 8)] == [64, 32, 16, 8]
    assert exact_padding_divisor(40, 50, 2) == 25 and exact_padding_divisor(40, 50, 4) is None  # 4 D never 50
    assert exact_padding_divisor(151665, 151936) == 1187  # Qwen2's tokenizer in its 151936 = 128 x 1187 rows
    assert exact_padding_divisor(320, 320, 1, preferred=64) == 64 and exact_padding_divisor(257, 320, 1, 128) == 64
    for tokens, rows, tp in ((257, 320, 2), (40, 50, 1), (151665, 151936, 1), (100, 128, 4)):
        divisor = exact_padding_divisor(tokens, rows, tp)
        assert pad_vocab_size(tokens, divisor, tp) == rows
        assert all(pad_vocab_size(tokens, smaller, tp) != rows for smaller in range(1, divisor))


def _imported_args(rows):
    """The arguments an import from a Hugging Face directory without a tokenizer records: no tokenizer, the
    embedding's rows."""
    return argparse.Namespace(hidden_size=32, num_attention_heads=4, padded_vocab_size=rows)


def test_tokenizer_padded_to_the_rows_of_a_checkpoint_imported_without_one_is_accepted():
    from megatron.core.dist_checkpointing.serialization import CheckpointError
    from megatron.training.checkpoint_args import check_same_architecture

    saved = _imported_args(320)  # its vocabulary recorded as its 320 rows
    run = argparse.Namespace(hidden_size=32, num_attention_heads=4, tokenizer_type="ByteLevelTokenizer",
                             make_vocab_size_divisible_by=64, tensor_model_parallel_size=1, padded_vocab_size=320)
    check_same_architecture("imported", saved, run, 320, 257)
    assert architecture_differences(saved, run, 320, 257) == []
    # padded to other rows (the default 128: 384), it is refused, with the divisor that fits
    run.make_vocab_size_divisible_by, run.padded_vocab_size = 128, 384
    with pytest.raises(CheckpointError) as error:
        check_same_architecture("imported", saved, run, 320, 257)
    message = str(error.value)
    assert "320 in the checkpoint, 257 in this run" in message
    assert "for this run's 257 tokens --make-vocab-size-divisible-by 64, which pads them to exactly 320 at TP 1" \
        in message
    assert "this run pads its 257 tokens to 384 rows (--make-vocab-size-divisible-by 128 x TP 1)" in message
    run.tensor_model_parallel_size, run.padded_vocab_size = 4, 512
    with pytest.raises(CheckpointError, match="no --make-vocab-size-divisible-by pads 40 tokens to exactly 50 rows "
                                              "at TP 4"):
        check_same_architecture("imported", _imported_args(50), run, 50, 40)


def test_a_trained_checkpoint_of_another_vocabulary_is_refused_whatever_the_padding():
    from megatron.core.dist_checkpointing.serialization import CheckpointError
    from megatron.training.checkpoint_args import check_same_architecture

    # NullTokenizer --vocab-size 120 against 100: both pad to 128 rows, and the tokens differ
    saved = argparse.Namespace(hidden_size=32, tokenizer_type="NullTokenizer", vocab_size=120, padded_vocab_size=128)
    run = argparse.Namespace(hidden_size=32, tokenizer_type="NullTokenizer", vocab_size=100, padded_vocab_size=128)
    with pytest.raises(CheckpointError, match="--vocab-size 120 \\(121 tokens"):
        check_same_architecture("trained", saved, run, 121, 101)
    # a tokenizer that fills the rows exactly is a tokenizer the checkpoint knows: still compared
    saved = argparse.Namespace(hidden_size=32, tokenizer_type="NullTokenizer", vocab_size=127, padded_vocab_size=128)
    with pytest.raises(CheckpointError, match="128 in the checkpoint, 101 in this run"):
        check_same_architecture("trained", saved, run, 128, 101)
    # an import that knows its tokenizer's size (below the rows) is compared too
    with pytest.raises(CheckpointError, match="257 in the checkpoint, 101 in this run"):
        check_same_architecture("imported", _imported_args(320), run, 257, 101)


def _run_args(**flags):
    command_line = dict(tensor_model_parallel_size=2, make_vocab_size_divisible_by=128, use_checkpoint_args=True)
    return argparse.Namespace(**{**command_line, **flags})


def test_use_checkpoint_args_takes_the_padded_vocabulary_at_any_tp_size():
    """As upstream's load_args_from_checkpoint: the checkpoint's rows, not --make-vocab-size-divisible-by x TP of
    this run (121 tokens: 128 rows saved at TP 1, which TP 2 would pad to 256)."""
    from megatron.training.tokenizer.tokenizer import padded_vocab_size

    run = _run_args()
    apply_checkpoint_args(run, argparse.Namespace(make_vocab_size_divisible_by=128, padded_vocab_size=128))
    assert padded_vocab_size(run, 121) == 128
    # without --use-checkpoint-args (or from a checkpoint that records no rows) the run pads as its flags say
    assert padded_vocab_size(_run_args(use_checkpoint_args=False, padded_vocab_size=128), 121) == 256
    unrecorded = _run_args()
    apply_checkpoint_args(unrecorded, argparse.Namespace(make_vocab_size_divisible_by=128))
    assert padded_vocab_size(unrecorded, 121) == 256
    with pytest.raises(ValueError, match="the checkpoint's word embedding has 129 rows \\(its padded vocabulary\\), "
                                         "which do not split over --tensor-model-parallel-size 2"):
        padded_vocab_size(_run_args(padded_vocab_size=129), 121)
    with pytest.raises(ValueError, match="has 128 rows, fewer than the 200 tokens of this run's tokenizer"):
        padded_vocab_size(_run_args(padded_vocab_size=128), 200)


def test_padding_is_explained_by_the_divisor_or_by_the_checkpoint():
    from megatron.training.checkpoint_args import padding_origin

    assert padding_origin(256, 121, 128, 2) == "--make-vocab-size-divisible-by 128 x TP 2"
    assert padding_origin(128, 121, 128, 2) == ("at TP 2, the rows of the checkpoint it resumed with "
                                                "--use-checkpoint-args")


def test_gated_mlp_clamp_and_offset_are_compared_and_taken_from_the_checkpoint():
    """gpt-oss's clamped gated MLP computes another function: a resume without the flags is refused, naming them,
    and --use-checkpoint-args takes them."""
    saved = argparse.Namespace(activation_func_clamp_value=7.0, glu_linear_offset=1.0)
    plain = argparse.Namespace(activation_func_clamp_value=None, glu_linear_offset=0.0)
    assert architecture_differences(saved, plain) == [
        "--activation-func-clamp-value: 7.0 in the checkpoint, 0 in this run",
        "--glu-linear-offset: 1.0 in the checkpoint, 0.0 in this run"]
    assert architecture_differences(saved, argparse.Namespace(**vars(saved))) == []
    assert architecture_differences(argparse.Namespace(), plain) == []  # saved before the flags existed
    changed = apply_checkpoint_args(plain, saved)
    assert (plain.activation_func_clamp_value, plain.glu_linear_offset) == (7.0, 1.0)
    assert changed == ["--glu-linear-offset 1.0 (command line: 0.0)"]  # the clamp was not given: nothing overridden


def test_quick_geglu_is_compared_and_taken_from_the_checkpoint():
    """--quick-geglu (gpt-oss's gated MLP) computes another function over the same fc1 and fc2 shapes as a
    --ffn-hidden-size swiglu model: a resume without it is refused naming it, and --use-checkpoint-args takes it."""
    from megatron.core.dist_checkpointing.serialization import CheckpointError
    from megatron.training.checkpoint_args import check_same_architecture

    saved = argparse.Namespace(quick_geglu=True, swiglu=False)
    plain = argparse.Namespace(quick_geglu=False, swiglu=False)
    assert architecture_differences(saved, plain) == ["--quick-geglu: set in the checkpoint, not set in this run"]
    assert architecture_differences(plain, saved) == ["--quick-geglu: not set in the checkpoint, set in this run"]
    assert architecture_differences(saved, argparse.Namespace(**vars(saved))) == []
    assert architecture_differences(argparse.Namespace(swiglu=False), plain) == []  # saved before the flag existed
    with pytest.raises(CheckpointError, match="--quick-geglu: set in the checkpoint, not set in this run.*"
                                              "launch with the checkpoint's --quick-geglu"):
        check_same_architecture("CKPT", saved, plain)
    assert apply_checkpoint_args(plain, saved) == ["--quick-geglu True (command line: False)"]
    assert plain.quick_geglu is True


def test_use_checkpoint_args_takes_the_dropout_rates_and_query_key_layer_scaling():
    """As upstream's load_args_from_checkpoint (force=True): a run resumed with --use-checkpoint-args trains with
    the checkpoint's dropout, so a run saved with --hidden-dropout 0 does not resume under the default 0.1."""
    command_line = dict(hidden_size=32, hidden_dropout=0.1, attention_dropout=0.1,
                        apply_query_key_layer_scaling=False)
    args = argparse.Namespace(**command_line)
    changed = apply_checkpoint_args(args, argparse.Namespace(hidden_size=32, hidden_dropout=0.0, attention_dropout=0.05,
                                                             apply_query_key_layer_scaling=True))
    assert (args.hidden_dropout, args.attention_dropout, args.apply_query_key_layer_scaling) == (0.0, 0.05, True)
    assert changed == ["--attention-dropout 0.05 (command line: 0.1)", "--hidden-dropout 0.0 (command line: 0.1)",
                       "--apply-query-key-layer-scaling True (command line: False)"]
    # a checkpoint older than the flags leaves the command line's values
    args = argparse.Namespace(**command_line)
    assert apply_checkpoint_args(args, argparse.Namespace(hidden_size=32)) == []
    assert (args.hidden_dropout, args.attention_dropout) == (0.1, 0.1)


def test_no_use_tokenizer_model_from_checkpoint_args_keeps_the_command_lines_tokenizer_model(monkeypatch):
    """Upstream's --no-use-tokenizer-model-from-checkpoint-args: the saved --tokenizer-model path is not taken."""
    from megatron.training.arguments import parse_args

    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    assert parse_args(args=[]).use_tokenizer_model_from_checkpoint_args is True
    assert parse_args(args=["--no-use-tokenizer-model-from-checkpoint-args"]).use_tokenizer_model_from_checkpoint_args \
        is False
    saved = argparse.Namespace(tokenizer_type="HuggingFaceTokenizer", tokenizer_model="/elsewhere/tokenizer")
    args = argparse.Namespace(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=None)
    apply_checkpoint_args(args, saved)
    assert args.tokenizer_model == "/elsewhere/tokenizer"
    args = argparse.Namespace(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=None)
    assert apply_checkpoint_args(args, saved, with_tokenizer_model=False) == []
    assert args.tokenizer_model is None


def test_another_layer_count_is_named_with_the_flag_and_the_way_to_load():
    """A checkpoint of another --num-layers (or --mtp-num-layers) is not refused up front (it may load partly under
    --dist-ckpt-strictness), but when its tensors do not match, the error names the flags and both values."""
    from megatron.core.dist_checkpointing.strictness import CheckpointKeyError, KeyMismatch, apply_strictness
    from megatron.training.checkpoint_args import layer_count_hint
    from megatron.training.checkpointing import _check_layout_matches

    saved = argparse.Namespace(num_layers=2, mtp_num_layers=None)
    hint = layer_count_hint(saved, argparse.Namespace(num_layers=3, mtp_num_layers=1))
    assert hint == ("The checkpoint was saved with --num-layers 2, --mtp-num-layers 0, this run has --num-layers 3, "
                    "--mtp-num-layers 1: launch with the checkpoint's (--num-layers 2, --mtp-num-layers 0; "
                    "--use-checkpoint-args takes them)")
    assert layer_count_hint(saved, argparse.Namespace(num_layers=2, mtp_num_layers=0)) is None
    assert layer_count_hint(None, argparse.Namespace(num_layers=3)) is None
    with pytest.raises(CheckpointKeyError, match=r"\(1 tensor\(s\) the model needs are not in the checkpoint: "
                       r"model.decoder.layers.2.w\). The checkpoint was saved with --num-layers 2"):
        apply_strictness("assume_ok_unexpected", KeyMismatch(["model.decoder.layers.2.w"], []), "ckpt", hint=hint)
    current = argparse.Namespace(num_layers=3, tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                                 padded_vocab_size=None, virtual_stage_layer_counts=(3,))
    saved = argparse.Namespace(num_layers=2, tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                               padded_vocab_size=None, virtual_stage_layer_counts=(2,))
    with pytest.raises(ValueError, match=r"^f holds another number of layers than this run builds. The checkpoint "
                       r"was saved with --num-layers 2, this run has --num-layers 3"):
        _check_layout_matches(saved, current, "f")


def test_use_checkpoint_args_takes_the_routers_load_balancing_type():
    """Sinkhorn routing picks experts otherwise than top-k: a model trained with it is rebuilt with it (top-1
    sinkhorn would otherwise fail validation, needing --moe-router-pre-softmax, and top-2 route differently)."""
    args = _moe_args(moe_router_load_balancing_type="aux_loss")
    changed = apply_checkpoint_args(args, _moe_args(moe_router_load_balancing_type="sinkhorn", moe_router_topk=1))
    assert (args.moe_router_load_balancing_type, args.moe_router_topk) == ("sinkhorn", 1)
    assert "--moe-router-load-balancing-type sinkhorn (command line: aux_loss)" in changed
