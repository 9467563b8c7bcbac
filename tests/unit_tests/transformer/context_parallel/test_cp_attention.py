"""Context-parallel attention against full attention on the gathered sequence: every comm type at CP2 and CP4
(a2a+p2p at CP4 = 2 x 2 on parallel_state's hierarchical groups), forward and backward, with RoPE at global
positions, grouped-query attention, and causal or explicit masks."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.core import parallel_state
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding, apply_rotary_pos_emb
from megatron.core.transformer.context_parallel import context_parallel_attention, local_rows
from megatron.core.transformer.context_parallel.ring_attention import attended_pairs
from megatron.core.transformer.context_parallel.sequence_split import get_batch_on_this_cp_rank, local_token_indices
from tests.unit_tests.multiprocess_harness import run_on_ranks

SEQ, BATCH, HEADS, GROUPS, HEAD_DIM = 16, 2, 4, 2, 8


def _inputs(seed=0):
    generator = torch.Generator().manual_seed(seed)
    query = torch.randn(SEQ, BATCH, HEADS, HEAD_DIM, generator=generator)
    key = torch.randn(SEQ, BATCH, GROUPS, HEAD_DIM, generator=generator)
    value = torch.randn(SEQ, BATCH, GROUPS, HEAD_DIM, generator=generator)
    grad_out = torch.randn(SEQ, BATCH, HEADS * HEAD_DIM, generator=generator)
    padding = torch.rand(BATCH, 1, 1, SEQ, generator=generator) < 0.3
    causal = torch.ones(SEQ, SEQ, dtype=torch.bool).triu(1)
    mask = (causal | padding) & ~torch.eye(SEQ, dtype=torch.bool)  # every query sees at least itself
    return query, key, value, grad_out, mask


def _attention(query, key, value, mask, rotary, attend):
    query, key = apply_rotary_pos_emb(query, rotary), apply_rotary_pos_emb(key, rotary)
    return attend(query, key, value, mask)


def _full_attention(query, key, value, mask):
    q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
    kwargs = {"is_causal": True} if mask is None else {"attn_mask": ~mask}
    out = F.scaled_dot_product_attention(q, k, v, enable_gqa=True, **kwargs)
    return out.permute(2, 0, 1, 3).reshape(query.shape[0], query.shape[1], -1)


def _cp_group(comm_type, hierarchical_sizes=None):
    """The group argument of a comm type: the world, or for a2a+p2p parallel_state's (inner, outer) groups of a
    hierarchical layout of the world (default 2 x world/2; initialised here, destroyed by the caller)."""
    if comm_type != "a2a+p2p":
        return dist.group.WORLD
    sizes = hierarchical_sizes or [2, dist.get_world_size() // 2]
    parallel_state.initialize_model_parallel(context_parallel_size=dist.get_world_size(),
                                             hierarchical_context_parallel_sizes=sizes)
    return parallel_state.get_hierarchical_context_parallel_groups()


def _cp_attention_matches_full(comm_type, with_mask, hierarchical_sizes=None):
    try:
        return _cp_attention_errors(comm_type, with_mask, _cp_group(comm_type, hierarchical_sizes))
    finally:
        parallel_state.destroy_model_parallel()


def _cp_attention_errors(comm_type, with_mask, group):
    cp_size, cp_rank = dist.get_world_size(), dist.get_rank()
    query, key, value, grad_out, mask = _inputs()
    mask = mask if with_mask else None
    angles = RotaryEmbedding(HEAD_DIM).full_angles(SEQ)  # every position: the call would give this rank's share

    leaves = [t.clone().requires_grad_() for t in (query, key, value)]
    reference = _attention(*leaves, mask, angles, _full_attention)
    reference.backward(grad_out)

    local_leaves = [local_rows(t, 0, cp_size, cp_rank).clone().requires_grad_() for t in (query, key, value)]
    local_angles = local_rows(angles, 0, cp_size, cp_rank)
    attend = lambda q, k, v, m: context_parallel_attention(q, k, v, m, comm_type=comm_type, group=group)
    out = _attention(*local_leaves, mask, local_angles, attend)
    out.backward(local_rows(grad_out, 0, cp_size, cp_rank))

    errors = {"out": (out - local_rows(reference, 0, cp_size, cp_rank)).abs().max().item()}
    for name, full, local in zip(("dq", "dk", "dv"), leaves, local_leaves):
        errors[name] = (local.grad - local_rows(full.grad, 0, cp_size, cp_rank)).abs().max().item()
    return errors


# a2a splits the query groups over CP ranks: with GROUPS query groups it runs where CP divides them (CP4 a2a is
# tested on a multi-head model below).
CP_LAYOUTS = [(world_size, comm_type) for world_size in (2, 4) for comm_type in ("p2p", "allgather", "a2a")
              if comm_type != "a2a" or GROUPS % world_size == 0] + [(4, "a2a+p2p")]


@pytest.mark.parametrize("world_size, comm_type", CP_LAYOUTS)
@pytest.mark.parametrize("with_mask", [False, True], ids=["causal", "explicit_mask"])
def test_cp_attention_forward_and_backward_equal_full_attention(world_size, comm_type, with_mask):
    for rank, errors in enumerate(run_on_ranks(world_size, _cp_attention_matches_full, comm_type, with_mask)):
        assert max(errors.values()) < 1e-5, (rank, errors)


@pytest.mark.parametrize("world_size", [2])
@pytest.mark.parametrize("hierarchical_sizes", [[2, 1], [1, 2]], ids=["ring_of_one", "all_to_all_of_one"])
def test_hierarchical_cp_with_a_level_of_size_one(world_size, hierarchical_sizes):
    """a2a+p2p at CP2 with one level of --hierarchical-context-parallel-sizes of size 1: that level passes its
    tensors on unchanged (a ring of one rank keeps its K/V and their gradients)."""
    results = run_on_ranks(world_size, _cp_attention_matches_full, "a2a+p2p", False, hierarchical_sizes)
    for rank, errors in enumerate(results):
        assert max(errors.values()) < 1e-5, (rank, errors)


def _a2a_mha_cp4(with_mask):
    global GROUPS
    GROUPS = HEADS  # multi-head attention: 4 heads and 4 groups split over 4 ranks
    try:
        return _cp_attention_matches_full("a2a", with_mask)
    finally:
        GROUPS = 2


@pytest.mark.parametrize("world_size", [4])
def test_a2a_at_cp4_with_one_head_per_rank(world_size):
    for rank, errors in enumerate(run_on_ranks(world_size, _a2a_mha_cp4, False)):
        assert max(errors.values()) < 1e-5, (rank, errors)


def _a2a_refuses_indivisible_heads():
    query = torch.zeros(4, 1, 2, 8)
    try:
        context_parallel_attention(query, query, query, None, comm_type="a2a", group=dist.group.WORLD)
    except ValueError as error:
        return str(error)
    return None


@pytest.mark.parametrize("world_size", [4])
def test_a2a_names_the_flags_when_heads_do_not_divide(world_size):
    message = run_on_ranks(world_size, _a2a_refuses_indivisible_heads)[0]
    assert message is not None and "--cp-comm-type a2a" in message and "--num-attention-heads" in message


def _odd_local_sequence_messages():
    """Each rank holds 3 tokens (6 in all at CP2): no two equal load-balanced chunks."""
    query = torch.randn(3, 1, 2, 8)
    messages = {}
    for comm_type in ("p2p", "allgather", "a2a", "a2a+p2p"):
        try:
            context_parallel_attention(query, query, query, None, comm_type=comm_type, group=_cp_group(comm_type))
            messages[comm_type] = None
        except ValueError as error:
            messages[comm_type] = str(error)
        finally:
            parallel_state.destroy_model_parallel()
    return messages


def _row_sliced_mask_messages():
    """Upstream's get_batch_on_this_cp_rank hands each rank its query rows of the mask, [b, 1, s/N, s]."""
    query, key, value, _, mask = _inputs()
    q, k, v = (local_rows(t, 0, 2, dist.get_rank()) for t in (query, key, value))
    rows = local_rows(mask, 2, 2, dist.get_rank())
    messages = {}
    for comm_type in ("p2p", "allgather", "a2a"):
        try:
            context_parallel_attention(q, k, v, rows, comm_type=comm_type, group=dist.group.WORLD)
            messages[comm_type] = None
        except ValueError as error:
            messages[comm_type] = str(error)
    return messages


@pytest.mark.parametrize("world_size", [2])
def test_row_sliced_mask_is_refused_with_what_to_pass(world_size):
    expected = (f"context parallelism takes the attention mask of the whole sequence, [b or 1, 1, {SEQ}, {SEQ}], got "
                f"({BATCH}, 1, {SEQ // 2}, {SEQ}): pass the mask unsplit (get_batch_on_this_cp_rank keeps it whole; "
                "upstream's version cuts its query rows, which this attention reads itself)")
    for messages in run_on_ranks(world_size, _row_sliced_mask_messages):
        assert messages == dict.fromkeys(("p2p", "allgather", "a2a"), expected)


@pytest.mark.parametrize("world_size", [2])
def test_odd_local_sequence_is_refused_by_every_comm_type(world_size):
    expected = ("sequence length 6 must be divisible by 2 x --context-parallel-size (4): each rank holds two of "
                "2 x CP equal chunks (change --seq-length)")
    for messages in run_on_ranks(world_size, _odd_local_sequence_messages):
        assert messages == dict.fromkeys(("p2p", "allgather", "a2a", "a2a+p2p"), expected)


def _dropout_is_reproducible(comm_type):
    from megatron.core import tensor_parallel

    query, key, value, _, _ = _inputs()
    q, k, v = (local_rows(t, 0, 2, dist.get_rank()) for t in (query, key, value))
    outs = []
    for _ in range(2):
        tensor_parallel.model_parallel_cuda_manual_seed(5)
        outs.append(context_parallel_attention(q, k, v, None, comm_type=comm_type, group=dist.group.WORLD,
                                               dropout_p=0.5))
    plain = context_parallel_attention(q, k, v, None, comm_type=comm_type, group=dist.group.WORLD)
    return (outs[0] - outs[1]).abs().max().item(), (outs[0] - plain).abs().max().item()


@pytest.mark.parametrize("world_size", [2])
@pytest.mark.parametrize("comm_type", ["p2p", "allgather"])
def test_dropout_masks_follow_the_rng_tracker(world_size, comm_type):
    """The comm types that draw their own keep masks (from a seed of the tracker's stream, so that the backward
    regenerates them): the same seed gives the same output, and dropout changes it."""
    for same_seed_diff, dropout_effect in run_on_ranks(world_size, _dropout_is_reproducible, comm_type):
        assert same_seed_diff == 0.0 and dropout_effect > 0.1


def test_load_balanced_split_and_batch_slicing():
    assert local_token_indices(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert local_token_indices(8, 2, 1).tolist() == [2, 3, 4, 5]
    tokens = torch.arange(16).view(2, 8)
    batch = get_batch_on_this_cp_rank({"tokens": tokens, "attention_mask": None}, cp_size=2, cp_rank=1)
    assert batch["tokens"].tolist() == [[2, 3, 4, 5], [10, 11, 12, 13]] and batch["attention_mask"] is None
    dataset_id = torch.tensor([1, 0], dtype=torch.int16)
    batch = get_batch_on_this_cp_rank({"tokens": tokens, "dataset_id": dataset_id}, cp_size=2, cp_rank=1)
    assert batch["dataset_id"] is dataset_id and batch["tokens"].tolist() == [[2, 3, 4, 5], [10, 11, 12, 13]]
    with pytest.raises(ValueError, match="--context-parallel-size"):
        local_token_indices(6, 2, 0)


@pytest.mark.parametrize("cp_size", [2, 4, 8])
def test_causal_ring_work_is_balanced_across_ranks(cp_size):
    """Every rank attends the same number of (query chunk, key chunk) pairs: 2N chunk-pair units (a diagonal pair is
    half a unit)."""
    work = []
    for rank in range(cp_size):
        pairs = attended_pairs(cp_size, rank)
        work.append(sum(0.5 if query == key else 1.0 for _, query, key in pairs))
    assert work == [2.0 * cp_size] * cp_size


def _saved_bytes_of_attention(comm_type):
    """Bytes of the distinct storages autograd saves for backward inside one CP attention call."""
    query, key, value, _, _ = _inputs()
    leaves = [local_rows(t, 0, dist.get_world_size(), dist.get_rank()).clone().requires_grad_()
              for t in (query, key, value)]
    leaf_storages = {t.untyped_storage().data_ptr() for t in leaves}
    storages = {}

    def pack(tensor):
        pointer = tensor.untyped_storage().data_ptr()
        if pointer not in leaf_storages:
            storages[pointer] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        context_parallel_attention(*leaves, None, comm_type=comm_type, group=dist.group.WORLD)
    return sum(storages.values())


@pytest.mark.parametrize("world_size", [2])
def test_allgather_keeps_only_local_key_value_for_backward(world_size):
    """allgather gathers K/V again in its backward: besides its inputs (local Q, K, V) and its output it keeps only
    this rank's queries re-laid out for the block kernels and their log-sum-exp, 1/N of the sequence, exactly what
    the ring keeps; keeping the gathered K/V would add 2 * s * b * G * d * 4 bytes (4096 here)."""
    local = SEQ // world_size
    expected = 4 * (local * BATCH * HEADS * HEAD_DIM + local * BATCH * HEADS)  # queries [b, g, m, s/N, d], lse
    for saved in run_on_ranks(world_size, _saved_bytes_of_attention, "allgather"):
        assert saved == expected, (saved, expected)
    assert run_on_ranks(world_size, _saved_bytes_of_attention, "p2p") == [expected] * world_size


def _fp64_errors(comm_type):
    """fp64 inputs, with and without attention sinks: the largest difference of this rank's output and Q/K/V
    gradients from full attention computed in fp64."""
    from megatron.core.transformer.attention_variants import attention_with_sinks

    query, key, value, grad_out, mask = (t.double() if t.is_floating_point() else t for t in _inputs(seed=5))
    sinks = torch.linspace(-1.0, 1.0, HEADS, dtype=torch.float64)
    cp_size, cp_rank = dist.get_world_size(), dist.get_rank()
    errors = []
    try:
        group = _cp_group(comm_type)
        for with_sinks in (False, True):
            full = [t.clone().requires_grad_() for t in (query, key, value)]
            if with_sinks:
                q, k, v = (t.permute(1, 2, 0, 3) for t in full)
                expected = attention_with_sinks(q, k.repeat_interleave(HEADS // GROUPS, 1),
                                                v.repeat_interleave(HEADS // GROUPS, 1), mask, sinks)
                expected = expected.permute(2, 0, 1, 3).reshape(SEQ, BATCH, -1)
            else:
                expected = _full_attention(*full, mask)
            expected.backward(grad_out)
            local = [local_rows(t, 0, cp_size, cp_rank).clone().requires_grad_() for t in (query, key, value)]
            out = context_parallel_attention(*local, mask, comm_type=comm_type, group=group,
                                             sinks=sinks if with_sinks else None)
            out.backward(local_rows(grad_out, 0, cp_size, cp_rank))
            pairs = [(out, expected)] + [(mine.grad, whole.grad) for mine, whole in zip(local, full)]
            errors.append(max((mine - local_rows(whole, 0, cp_size, cp_rank)).abs().max().item()
                              for mine, whole in pairs))
    finally:
        parallel_state.destroy_model_parallel()
    return errors


@pytest.mark.parametrize("world_size", [2])
def test_fp64_inputs_are_attended_in_fp64(world_size):
    """A float64 check (as gradcheck-style tests use) keeps float64 accuracy: the merge does not drop to fp32."""
    for comm_type in ("p2p", "allgather", "a2a", "a2a+p2p"):
        for rank, errors in enumerate(run_on_ranks(world_size, _fp64_errors, comm_type)):
            assert max(errors) < 1e-12, (comm_type, rank, errors)
