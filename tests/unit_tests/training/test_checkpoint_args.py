"""The RoPE scaling and interpolation flags among the model flags a checkpoint imposes and compares
(checkpoint_args.py): a load names them when they differ, an older checkpoint without them is not compared, and
--use-checkpoint-args takes them (and the layers multi-token prediction adds)."""

import argparse

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
