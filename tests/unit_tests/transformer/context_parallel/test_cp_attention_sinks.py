"""Attention sinks under context parallelism: every comm type at CP2 (a2a+p2p with either level of size one)
returns the rows' log-sum-exp over the whole sequence and rescales by the sink; forward, backward and the sinks'
gradient equal the full-sequence sink attention of `attention_variants`, causal or with a sliding window, and the
returned lse equals the log-sum-exp of the full logits."""

import math

import pytest
import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.transformer.attention_variants import attention_with_sinks, sink_rescaled, windowed_mask
from megatron.core.transformer.context_parallel import context_parallel_attention, local_rows
from megatron.core.transformer.context_parallel.a2a_attention import a2a_attention
from megatron.core.transformer.context_parallel.allgather_attention import allgather_attention
from megatron.core.transformer.context_parallel.ring_attention import ring_attention
from tests.unit_tests.multiprocess_harness import run_on_ranks

SEQ, BATCH, HEADS, GROUPS, HEAD_DIM = 16, 2, 4, 2, 8


def _inputs():
    generator = torch.Generator().manual_seed(0)
    query = torch.randn(SEQ, BATCH, HEADS, HEAD_DIM, generator=generator)
    key = torch.randn(SEQ, BATCH, GROUPS, HEAD_DIM, generator=generator)
    value = torch.randn(SEQ, BATCH, GROUPS, HEAD_DIM, generator=generator)
    sinks = torch.randn(HEADS, generator=generator)
    grad_out = torch.randn(SEQ, BATCH, HEADS * HEAD_DIM, generator=generator)
    return query, key, value, sinks, grad_out


def _group(comm_type, hierarchical_sizes):
    if comm_type != "a2a+p2p":
        return dist.group.WORLD
    parallel_state.initialize_model_parallel(context_parallel_size=dist.get_world_size(),
                                             hierarchical_context_parallel_sizes=hierarchical_sizes)
    return parallel_state.get_hierarchical_context_parallel_groups()


def _cp_sinks_errors(comm_type, window, hierarchical_sizes=None):
    try:
        group = _group(comm_type, hierarchical_sizes)
        cp_size, cp_rank = dist.get_world_size(), dist.get_rank()
        query, key, value, sinks, grad_out = _inputs()
        mask = None if window is None else windowed_mask(None, window, SEQ, query.device)
        blocked = torch.ones(SEQ, SEQ, dtype=torch.bool).triu(1) if mask is None else mask

        leaves = [t.clone().requires_grad_() for t in (query, key, value, sinks)]
        q, k, v = (t.permute(1, 2, 0, 3) for t in leaves[:3])
        reference = attention_with_sinks(q, k, v, blocked, leaves[3])
        reference = reference.permute(2, 0, 1, 3).reshape(SEQ, BATCH, -1)
        reference.backward(grad_out)

        local = [local_rows(t, 0, cp_size, cp_rank).clone().requires_grad_() for t in (query, key, value)]
        local_sinks = sinks.clone().requires_grad_()
        out = context_parallel_attention(*local, mask, comm_type=comm_type, group=group, sinks=local_sinks)
        out.backward(local_rows(grad_out, 0, cp_size, cp_rank))
        sinks_grad = local_sinks.grad.clone()
        dist.all_reduce(sinks_grad)  # each rank's share covers its own rows

        errors = {"out": (out - local_rows(reference, 0, cp_size, cp_rank)).abs().max().item(),
                  "dsinks": (sinks_grad - leaves[3].grad).abs().max().item()}
        for name, full, part in zip(("dq", "dk", "dv"), leaves, local):
            errors[name] = (part.grad - local_rows(full.grad, 0, cp_size, cp_rank)).abs().max().item()
        effect = (reference - attention_with_sinks(q, k, v, blocked, torch.full((HEADS,), -math.inf))
                  .permute(2, 0, 1, 3).reshape(SEQ, BATCH, -1)).abs().max().item()
        return errors, leaves[3].grad.abs().min().item(), effect
    finally:
        parallel_state.destroy_model_parallel()


CASES = [("p2p", None), ("allgather", None), ("a2a", None), ("a2a+p2p", [2, 1]), ("a2a+p2p", [1, 2])]


@pytest.mark.parametrize("world_size", [2])
@pytest.mark.parametrize("comm_type, hierarchical_sizes", CASES, ids=["p2p", "allgather", "a2a", "a2a+p2p_2x1",
                                                                      "a2a+p2p_1x2"])
@pytest.mark.parametrize("window", [None, (3, 0)], ids=["causal", "window"])
def test_cp_sinks_equal_full_sink_attention(world_size, comm_type, hierarchical_sizes, window):
    for rank, (errors, smallest_sink_grad, effect) in enumerate(
            run_on_ranks(world_size, _cp_sinks_errors, comm_type, window, hierarchical_sizes)):
        assert max(errors.values()) < 1e-5, (rank, errors)
        assert smallest_sink_grad > 1e-4 and effect > 1e-2  # the sinks matter, so the check can fail


def _lse_of_every_comm_type(window):
    cp_size, cp_rank = dist.get_world_size(), dist.get_rank()
    query, key, value, _, _ = _inputs()
    mask = None if window is None else windowed_mask(None, window, SEQ, query.device)
    scale = 1.0 / math.sqrt(HEAD_DIM)
    full_key = key.repeat_interleave(HEADS // GROUPS, dim=2)
    logits = torch.einsum("qbhd,kbhd->bhqk", query, full_key) * scale
    blocked = torch.ones(SEQ, SEQ, dtype=torch.bool).triu(1) if mask is None else mask
    expected = local_rows(torch.logsumexp(logits.masked_fill(blocked, -math.inf), dim=-1).permute(2, 0, 1),
                          0, cp_size, cp_rank)
    q, k, v = (local_rows(t, 0, cp_size, cp_rank) for t in (query, key, value))
    errors = {}
    for name, attend in (("p2p", ring_attention), ("allgather", allgather_attention), ("a2a", a2a_attention)):
        _, lse = attend(q, k, v, dist.group.WORLD, mask, scale, 0.0, with_lse=True)
        errors[name] = (lse - expected).abs().max().item()
    return errors


@pytest.mark.parametrize("world_size", [2])
def test_comm_types_return_the_whole_sequence_log_sum_exp(world_size):
    for window in (None, (3, 0)):
        for rank, errors in enumerate(run_on_ranks(world_size, _lse_of_every_comm_type, window)):
            assert max(errors.values()) < 1e-5, (rank, window, errors)


def test_sink_rescale_equals_the_sink_softmax():
    """sigmoid(lse - s) applied to plain attention is attention with the sink, and rows that see no key give 0."""
    generator = torch.Generator().manual_seed(1)
    query, key, value = (torch.randn(1, HEADS, 6, HEAD_DIM, generator=generator, dtype=torch.float64)
                         for _ in range(3))
    sinks = torch.randn(HEADS, generator=generator, dtype=torch.float64)
    blocked = torch.ones(6, 6, dtype=torch.bool).triu(1)
    blocked[0, 0] = True  # the first query sees nothing
    logits = (query @ key.transpose(-1, -2) / math.sqrt(HEAD_DIM)).masked_fill(blocked, -math.inf)
    lse = torch.logsumexp(logits, dim=-1)
    plain = torch.softmax(logits, dim=-1).nan_to_num(0.0) @ value
    rescaled = sink_rescaled(plain.transpose(1, 2), lse.transpose(1, 2), sinks).transpose(1, 2)
    torch.testing.assert_close(rescaled, attention_with_sinks(query, key, value, blocked, sinks),
                               atol=1e-12, rtol=1e-12)
    assert torch.equal(rescaled[:, :, 0], torch.zeros_like(rescaled[:, :, 0]))


def _dropout_with_sinks_is_reproducible(comm_type):
    from megatron.core import tensor_parallel

    query, key, value, sinks, _ = _inputs()
    q, k, v = (local_rows(t, 0, 2, dist.get_rank()) for t in (query, key, value))
    outs = []
    for _ in range(2):
        tensor_parallel.model_parallel_cuda_manual_seed(5)
        outs.append(context_parallel_attention(q, k, v, None, comm_type=comm_type, group=dist.group.WORLD,
                                               dropout_p=0.5, sinks=sinks))
    plain = context_parallel_attention(q, k, v, None, comm_type=comm_type, group=dist.group.WORLD, sinks=sinks)
    return (outs[0] - outs[1]).abs().max().item(), (outs[0] - plain).abs().max().item()


@pytest.mark.parametrize("world_size", [2])
@pytest.mark.parametrize("comm_type", ["p2p", "allgather", "a2a"])
def test_dropout_with_sinks_follows_the_rng_tracker(world_size, comm_type):
    """With sinks every comm type draws its keep masks from a seed of the tracker's stream (a2a too, which then
    runs the block kernel): the same seed gives the same output, and dropout changes it."""
    for same_seed_diff, dropout_effect in run_on_ranks(world_size, _dropout_with_sinks_is_reproducible, comm_type):
        assert same_seed_diff == 0.0 and dropout_effect > 0.1
