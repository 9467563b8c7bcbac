"""get_tensor_shapes (upstream's signature): the activation shape one microbatch sends between stages."""

import types

import pytest

from megatron.core.pipeline_parallel import schedules, tensor_shapes


def test_sequence_split_over_context_and_sequence_parallel_groups(monkeypatch):
    sizes = {"tp": 2, "cp": 4}
    monkeypatch.setattr(tensor_shapes, "_group_size", lambda group: 1 if group is None else sizes[group])
    config = types.SimpleNamespace(hidden_size=32, sequence_parallel=False)
    assert schedules.get_tensor_shapes is tensor_shapes.get_tensor_shapes
    shapes = schedules.get_tensor_shapes(seq_length=64, micro_batch_size=2, decoder_seq_length=64, config=config,
                                         tp_group="tp", cp_group="cp")
    assert shapes == [(16, 2, 32)]
    config.sequence_parallel = True
    assert tensor_shapes.get_tensor_shapes(seq_length=64, micro_batch_size=2, config=config, tp_group="tp",
                                           cp_group="cp") == [(8, 2, 32)]
    with pytest.raises(ValueError, match="divisible by 8"):
        tensor_shapes.get_tensor_shapes(seq_length=20, micro_batch_size=2, config=config, tp_group="tp", cp_group="cp")
    with pytest.raises(ValueError, match="encoder-decoder"):
        tensor_shapes.get_tensor_shapes(seq_length=64, micro_batch_size=2, decoder_seq_length=32, config=config)
