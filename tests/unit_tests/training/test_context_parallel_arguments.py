"""Context-parallel flags: accepted values, derived sizes, and the rules' messages naming the flags."""

import pytest

from megatron.training.model_config import core_transformer_config_from_args
from tests.unit_tests.training.test_arguments import validated


def test_cp_flags_and_derived_data_parallel_size(monkeypatch):
    args = validated("--context-parallel-size 2 --cp-comm-type all_gather", 4, monkeypatch)
    assert (args.context_parallel_size, args.data_parallel_size, args.cp_comm_type) == (2, 2, "allgather")
    assert validated("--context-parallel-size 2", 2, monkeypatch).cp_comm_type == "p2p"
    args = validated("--context-parallel-size 2 --cp-comm-type a2a a2a", 2, monkeypatch)
    assert args.cp_comm_type == "a2a"
    args.padded_vocab_size = 128
    assert core_transformer_config_from_args(args).cp_comm_type == "a2a"


def test_hierarchical_comm_type_at_one_context_parallel_rank_takes_sizes_one_one(monkeypatch):
    args = validated("--cp-comm-type a2a+p2p --hierarchical-context-parallel-sizes 1 1", 1, monkeypatch)
    assert (args.cp_comm_type, args.hierarchical_context_parallel_sizes) == ("a2a+p2p", [1, 1])


def test_per_layer_and_hierarchical_comm_types_reach_the_config(monkeypatch):
    args = validated("--context-parallel-size 4 --cp-comm-type a2a+p2p all_gather "
                     "--hierarchical-context-parallel-sizes 2 2", 4, monkeypatch)
    assert (args.cp_comm_type, args.hierarchical_context_parallel_sizes) == (["a2a+p2p", "allgather"], [2, 2])
    args.padded_vocab_size = 128
    config = core_transformer_config_from_args(args)
    assert (config.cp_comm_type, config.hierarchical_context_parallel_sizes) == (("a2a+p2p", "allgather"), (2, 2))


def test_hierarchical_sizes_without_a2a_p2p_are_accepted_as_upstream(monkeypatch):
    args = validated("--context-parallel-size 4 --hierarchical-context-parallel-sizes 2 2", 4, monkeypatch)
    assert (args.cp_comm_type, args.hierarchical_context_parallel_sizes) == ("p2p", [2, 2])
    args.padded_vocab_size = 128
    assert core_transformer_config_from_args(args).hierarchical_context_parallel_sizes == (2, 2)


@pytest.mark.parametrize("seq_length, tp, world_size", [(36, 2, 4), (12, 2, 4), (24, 4, 8)])
def test_sequence_parallel_under_cp_needs_only_each_ranks_tokens_to_divide_by_tp(monkeypatch, seq_length, tp,
                                                                                 world_size):
    """As upstream: sequence parallelism splits a context-parallel rank's two chunks together, so a chunk need
    not divide by the tensor-parallel size (36 / (2 x 2) = 9 tokens a chunk, 18 a rank, 9 a TP rank)."""
    args = validated(f"--context-parallel-size 2 --tensor-model-parallel-size {tp} --sequence-parallel "
                     f"--seq-length {seq_length} --max-position-embeddings {seq_length}", world_size, monkeypatch)
    assert (args.seq_length, args.context_parallel_size, args.tensor_model_parallel_size) == (seq_length, 2, tp)
    assert args.sequence_parallel


@pytest.mark.parametrize(
    "extra, world_size, message",
    [
        ("--context-parallel-size 2 --seq-length 30 --max-position-embeddings 32", 2,
         r"--seq-length \(30\) must be divisible by 2 x --context-parallel-size \(2\) = 4"),
        ("--context-parallel-size 2 --tensor-model-parallel-size 4 --sequence-parallel --seq-length 36 "
         "--max-position-embeddings 36", 8,
         r"^--seq-length \(36\) / --context-parallel-size \(2\) = 18 tokens per context-parallel rank must be "
         r"divisible by --tensor-model-parallel-size \(4\) with --sequence-parallel"),
        ("--context-parallel-size 4 --cp-comm-type a2a --group-query-attention --num-query-groups 2", 4,
         r"--cp-comm-type a2a .*--num-attention-heads \(4\) and --num-query-groups \(2\)"),
        ("--context-parallel-size 2 --cp-comm-type ring", 2, r"--cp-comm-type must be one of"),
        ("--context-parallel-size 2 --cp-comm-type p2p a2a p2p", 2,
         r"--cp-comm-type takes one value for every layer or one per layer \(--num-layers 2\), got 3 values"),
        ("--context-parallel-size 2 --hierarchical-context-parallel-sizes 2 2", 2,
         r"--hierarchical-context-parallel-sizes \[2, 2\]: the product must equal --context-parallel-size \(2\)"),
        ("--context-parallel-size 4 --cp-comm-type a2a+p2p", 4, r"a2a\+p2p needs --hierarchical-context-parallel-sizes"),
        ("--cp-comm-type a2a+p2p", 1,
         r"^--cp-comm-type a2a\+p2p needs --hierarchical-context-parallel-sizes INNER OUTER .* at "
         r"--context-parallel-size 1 that is --hierarchical-context-parallel-sizes 1 1, or use --cp-comm-type p2p"),
        ("--cp-comm-type p2p a2a+p2p", 1, r"^--cp-comm-type a2a\+p2p needs --hierarchical-context-parallel-sizes"),
        ("--context-parallel-size 4 --cp-comm-type a2a+p2p --hierarchical-context-parallel-sizes 2 4", 4,
         r"product must equal --context-parallel-size \(4\)"),
        ("--context-parallel-size 4 --cp-comm-type a2a+p2p --hierarchical-context-parallel-sizes 4 1 "
         "--group-query-attention --num-query-groups 2", 4,
         r"--cp-comm-type a2a\+p2p splits .* the inner --hierarchical-context-parallel-sizes \(4\)"),
        ("--context-parallel-size 3", 4, r"world size \(4\) must be divisible by .*--context-parallel-size \(3\)"),
    ],
)
def test_cp_rules_name_the_flags(monkeypatch, extra, world_size, message):
    with pytest.raises(ValueError, match=message):
        validated(extra, world_size, monkeypatch)
