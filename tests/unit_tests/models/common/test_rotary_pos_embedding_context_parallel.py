"""RoPE under context parallelism, as upstream: a `RotaryEmbedding` (and YaRN's) called for the whole sequence
returns this rank's two load-balanced chunks of the angles over its `cp_group` (default: parallel_state's), so a
user-built module's output feeds a CP2 `TransformerBlock` directly and gives the CP1 output rows."""

import copy

import pytest
import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import YarnRotaryEmbedding, rotary_angles
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
from megatron.core.transformer.context_parallel import local_rows
from megatron.core.transformer.transformer_block import TransformerBlock
from tests.unit_tests.models.gpt.gpt_test_utils import MICRO_BATCH_SIZE, SEQ_LENGTH, tiny_config
from tests.unit_tests.multiprocess_harness import run_on_ranks

HIDDEN, HEAD_DIM = 32, 8  # tiny_config: 4 heads of 8 channels


def _block_output(cp_size, hidden_states):
    """A two-layer block (fixed weights) on this rank's rows of `hidden_states` (`[s, b, h]`), rotated by the
    angles of a `RotaryEmbedding` built as a Core API user builds it; returns (output, angles)."""
    parallel_state.initialize_model_parallel(context_parallel_size=cp_size)
    try:
        model_parallel_cuda_manual_seed(5)
        config = tiny_config(context_parallel_size=cp_size, init_seed=5)
        block = TransformerBlock(config).eval()
        local = local_rows(hidden_states, 0, cp_size, parallel_state.get_context_parallel_rank())
        rope = RotaryEmbedding(HEAD_DIM, rotary_percent=1.0)
        angles = rope(SEQ_LENGTH)  # the whole sequence's length, as upstream
        with torch.no_grad():
            return block(local, attention_mask=None, rotary_pos_emb=angles), angles
    finally:
        parallel_state.destroy_model_parallel()


def _cp2_block_against_cp1():
    hidden_states = torch.randn(SEQ_LENGTH, MICRO_BATCH_SIZE, HIDDEN, generator=torch.Generator().manual_seed(0))
    reference, full_angles = _block_output(1, hidden_states)
    output, angles = _block_output(2, hidden_states)
    rank = dist.get_rank()
    return ((output - local_rows(reference, 0, 2, rank)).abs().max().item(),
            (angles - local_rows(full_angles, 0, 2, rank)).abs().max().item(), tuple(angles.shape))


def test_user_built_rotary_embedding_feeds_a_cp2_transformer_block():
    for output_error, angle_error, shape in run_on_ranks(2, _cp2_block_against_cp1):
        assert shape == (SEQ_LENGTH // 2, 1, 1, HEAD_DIM)
        assert angle_error == 0.0
        assert output_error < 1e-5


def _shares_over_an_explicit_group():
    group, rank = dist.group.WORLD, dist.get_rank()
    rope = RotaryEmbedding(HEAD_DIM, cp_group=group)
    yarn = YarnRotaryEmbedding(HEAD_DIM, scaling_factor=4.0, original_max_position_embeddings=8, cp_group=group)
    yarn_angles, scale = yarn(8)
    copied = copy.deepcopy(rope)  # the copy shares the group, which cannot be copied
    return {
        "rope": rope(8).equal(local_rows(rotary_angles(rope, 8), 0, 2, rank)),
        "rope chunks": rope(8)[:, 0, 0, 1].tolist(),
        "yarn": yarn_angles.equal(local_rows(rotary_angles(yarn, 8), 0, 2, rank)) and scale == yarn.cos_sin_scale,
        "copy": copied.cp_group is group and copied(8).equal(rope(8)),
        "whole sequence": rotary_angles(rope, 8).shape[0],
    }


def test_cp_group_keyword_slices_rope_and_yarn_angles_to_this_rank():
    results = run_on_ranks(2, _shares_over_an_explicit_group)
    for result in results:
        assert result["rope"] and result["yarn"] and result["copy"] and result["whole sequence"] == 8
    # positions of the four chunks of 2: rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2
    inverse_frequency = 10000 ** (-2 / HEAD_DIM)
    assert results[0]["rope chunks"] == pytest.approx([p * inverse_frequency for p in (0, 1, 6, 7)])
    assert results[1]["rope chunks"] == pytest.approx([p * inverse_frequency for p in (2, 3, 4, 5)])


def _indivisible_length_message():
    with pytest.raises(ValueError) as error:
        RotaryEmbedding(HEAD_DIM, cp_group=dist.group.WORLD)(6)
    return str(error.value)


def test_a_local_length_under_context_parallelism_is_refused_with_the_fix():
    for message in run_on_ranks(2, _indivisible_length_message):
        assert "max_seq_len 6 must be the whole sequence's length" in message and "get_rotary_seq_len" in message


def test_get_rotary_seq_len_takes_upstreams_arguments():
    rope = RotaryEmbedding(HEAD_DIM)
    hidden_states = torch.zeros(4, 2, HIDDEN)
    config = tiny_config(context_parallel_size=2)
    assert rope.get_rotary_seq_len(None, None, hidden_states, config) == 8
    sequence_parallel = tiny_config(tp=2, sequence_parallel=True, context_parallel_size=2)
    assert rope.get_rotary_seq_len(None, None, hidden_states, sequence_parallel, None) == 16

    class Received:
        input_tensor = torch.zeros(3, 2, HIDDEN)

    assert rope.get_rotary_seq_len(None, Received(), hidden_states, tiny_config()) == 3

    class Context:
        max_sequence_length = 24

    assert rope.get_rotary_seq_len(None, None, hidden_states, tiny_config(), inference_params=Context()) == 24
    from megatron.core.packed_seq_params import PackedSeqParams

    offsets = torch.tensor([0, 5, 12])
    packed = PackedSeqParams(cu_seqlens_q=offsets, cu_seqlens_kv=offsets, max_seqlen_q=7, max_seqlen_kv=7)
    assert rope.get_rotary_seq_len(None, None, hidden_states, config, packed) == 7  # the longest sequence
    with pytest.raises(ValueError, match=r"set max_seqlen_q and max_seqlen_kv"):
        rope.get_rotary_seq_len(None, None, hidden_states, config, PackedSeqParams(cu_seqlens_q=offsets))


def test_without_context_parallelism_the_call_returns_every_position():
    parallel_state.destroy_model_parallel()  # no context-parallel group: nothing to cut
    rope = RotaryEmbedding(HEAD_DIM, use_cpu_initialization=True)
    assert rope(6).equal(rope.full_angles(6)) and rope(6).shape == (6, 1, 1, HEAD_DIM)
