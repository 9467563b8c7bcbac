"""The RoPE scaling and interpolation flags among the model flags a checkpoint imposes and compares
(checkpoint_args.py): a load names them when they differ, an older checkpoint without them is not compared, and
--use-checkpoint-args takes them (and the layers multi-token prediction adds). Of the MoE flags, the layout is
compared, the routing choices are not."""

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


def test_norm_epsilon_is_compared_on_load():
    llama3 = argparse.Namespace(normalization="RMSNorm", norm_epsilon=1e-6)
    assert architecture_differences(llama3, argparse.Namespace(normalization="RMSNorm", norm_epsilon=1e-6)) == []
    assert architecture_differences(llama3, argparse.Namespace(normalization="RMSNorm", norm_epsilon=1e-5)) == [
        "--norm-epsilon: 1e-06 in the checkpoint, 1e-05 in this run"]
    assert architecture_differences(argparse.Namespace(normalization="RMSNorm"), llama3) == []  # not recorded
