"""Comm types per layer and hierarchical context parallelism: the rules (pure), the hierarchical rank layout, and a
GPT at CP4 (a2a+p2p over 2 x 2, alone and in a per-layer list with every other comm type) against the same GPT
without context parallelism: loss and every parameter gradient to 1e-5."""

import pytest
import torch
import torch.distributed as dist

from megatron.core import parallel_state, tensor_parallel
from megatron.core.rank_layout import generate_rank_groups, hierarchical_context_parallel_groups
from megatron.core.transformer.context_parallel import (
    comm_type_of_layer,
    local_rows,
    normalize_cp_comm_types,
    validate_hierarchical_sizes,
)
from megatron.core.transformer.transformer_config import TransformerConfig
from tests.unit_tests.multiprocess_harness import run_on_ranks

SEQ, BATCH, VOCAB = 32, 2, 64


def test_per_layer_comm_types_resolve_by_global_layer_number():
    assert normalize_cp_comm_types(["all_gather"], 4) == "allgather"
    assert normalize_cp_comm_types(["a2a", "a2a"], 2) == "a2a"
    per_layer = normalize_cp_comm_types(["p2p", "a2a+p2p", "all_gather"], 3)
    assert per_layer == ("p2p", "a2a+p2p", "allgather")
    assert [comm_type_of_layer(per_layer, n) for n in (1, 2, 3)] == ["p2p", "a2a+p2p", "allgather"]
    assert comm_type_of_layer("a2a", 7) == "a2a"
    with pytest.raises(ValueError, match=r"--cp-comm-type takes one value for every layer or one per layer "
                                         r"\(--num-layers 4\), got 2 values"):
        normalize_cp_comm_types(["p2p", "a2a"], 4)



def test_none_is_p2p_as_upstream_default():
    """Upstream TransformerConfig's cp_comm_type defaults to None, which its attention runs as p2p."""
    assert normalize_cp_comm_types(None, 4) == "p2p"
    assert normalize_cp_comm_types(["a2a", None], 2) == ("a2a", "p2p")
    config = TransformerConfig(num_layers=2, hidden_size=16, num_attention_heads=4, context_parallel_size=2,
                               cp_comm_type=None)
    assert config.cp_comm_type == "p2p"

@pytest.mark.parametrize(
    "sizes, cp, comm_type, message",
    [
        (None, 4, "a2a+p2p", r"--cp-comm-type a2a\+p2p needs --hierarchical-context-parallel-sizes"),
        (None, 1, "a2a+p2p", r"--cp-comm-type a2a\+p2p needs --hierarchical-context-parallel-sizes"),
        ([2, 1], 4, "p2p", r"--hierarchical-context-parallel-sizes \[2, 1\]: the product must equal"),
        ([2, 0, 2], 4, "a2a", r"--hierarchical-context-parallel-sizes takes positive integers"),
        ([2, 1], 4, "a2a+p2p", r"the product must equal --context-parallel-size \(4\)"),
        ([2, 2, 1], 4, "a2a+p2p", r"takes two positive integers"),
    ],
)
def test_hierarchical_sizes_rules_name_the_flags(sizes, cp, comm_type, message):
    with pytest.raises(ValueError, match=message):
        validate_hierarchical_sizes(sizes, cp, comm_type)


def test_hierarchical_sizes_are_accepted_without_a2a_p2p_as_upstream():
    """Upstream builds the hierarchical groups whatever the comm type; only a2a+p2p needs exactly two sizes."""
    assert validate_hierarchical_sizes([2, 2], 4, "p2p") == (2, 2)
    assert validate_hierarchical_sizes([2, 1, 2], 4, ("a2a", "allgather")) == (2, 1, 2)
    assert validate_hierarchical_sizes([1, 4], 4, ("p2p", "a2a+p2p")) == (1, 4)


def test_hierarchical_groups_split_each_cp_group_inner_first():
    """TP2 x CP4 on 8 ranks: the CP groups are [0, 2, 4, 6] and [1, 3, 5, 7]; inner (all-to-all) groups are pairs of
    consecutive CP ranks, outer (ring) groups every second CP rank."""
    groups = hierarchical_context_parallel_groups(generate_rank_groups(8, tp=2, cp=4)["cp"], [2, 2])
    assert groups["hierarchical-cp-0"] == [[0, 2], [4, 6], [1, 3], [5, 7]]
    assert groups["hierarchical-cp-1"] == [[0, 4], [2, 6], [1, 5], [3, 7]]


def _gpt(cp_size, comm_type, hierarchical_sizes, num_layers):
    from megatron.core.models.gpt.gpt_model import GPTModel

    config = TransformerConfig(num_layers=num_layers, hidden_size=32, num_attention_heads=4, hidden_dropout=0.0,
                               attention_dropout=0.0, init_seed=1234, context_parallel_size=cp_size,
                               cp_comm_type=comm_type, hierarchical_context_parallel_sizes=hierarchical_sizes)
    return GPTModel(config, vocab_size=VOCAB, max_sequence_length=SEQ, position_embedding_type="rope",
                    share_embeddings_and_output_weights=True)


def _loss_and_grads(model, tokens, positions, labels, total_tokens, group):
    losses = model(tokens, positions, labels=labels)
    (losses.sum() / total_tokens).backward()
    loss = losses.detach().sum() / total_tokens
    grads = {name: param.grad.clone() for name, param in model.named_parameters()}
    if group is not None:  # each CP rank holds the gradient of its tokens' share of the loss
        dist.all_reduce(loss, group=group)
        for grad in grads.values():
            dist.all_reduce(grad, group=group)
    return loss.item(), grads


def _gpt_at_cp4_equals_cp1():
    cp_size, cp_rank = dist.get_world_size(), dist.get_rank()
    parallel_state.initialize_model_parallel(context_parallel_size=cp_size, hierarchical_context_parallel_sizes=[2, 2])
    try:
        tensor_parallel.model_parallel_cuda_manual_seed(1234)
        inner, outer = parallel_state.get_hierarchical_context_parallel_groups()
        layout = (dist.get_process_group_ranks(inner), dist.get_process_group_ranks(outer))
        stream = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(0))
        tokens, labels = stream[:, :-1], stream[:, 1:]
        positions = torch.arange(SEQ).expand(BATCH, -1)
        local = [local_rows(t, 1, cp_size, cp_rank) for t in (tokens, positions, labels)]
        errors = {}
        for name, comm_type, num_layers in (("a2a+p2p", "a2a+p2p", 2),
                                            ("per-layer", ["a2a+p2p", "p2p", "allgather", "a2a"], 4)):
            reference = _gpt(1, "p2p", None, num_layers)
            model = _gpt(cp_size, comm_type, [2, 2], num_layers)
            model.load_state_dict(reference.state_dict())
            loss_ref, grads_ref = _loss_and_grads(reference, tokens, positions, labels, BATCH * SEQ, None)
            loss, grads = _loss_and_grads(model, *local, BATCH * SEQ, parallel_state.get_context_parallel_group())
            grad_error = max(((grads[k] - g).abs().max() / g.abs().max().clamp_min(1e-12)).item()
                             for k, g in grads_ref.items())
            errors[name] = (abs(loss - loss_ref) / loss_ref, grad_error, loss_ref)
        return layout, errors
    finally:
        parallel_state.destroy_model_parallel()


@pytest.mark.parametrize("world_size", [4])
def test_gpt_at_hierarchical_cp4_equals_cp1(world_size):
    results = run_on_ranks(world_size, _gpt_at_cp4_equals_cp1)
    assert [layout for layout, _ in results] == [([0, 1], [0, 2]), ([0, 1], [1, 3]), ([2, 3], [0, 2]),
                                                 ([2, 3], [1, 3])]
    for rank, (_, errors) in enumerate(results):
        for name, (loss_error, grad_error, loss) in errors.items():
            assert loss > 3.0 and loss_error < 1e-5 and grad_error < 1e-5, (rank, name, errors)
