"""`DynamicInferenceContext`: chunks sized from the buffer, reserved per request and given back, the positions and
last rows of a step, the keys each request attends over, and the limits it enforces."""

import pytest
import torch

from megatron.core.inference.contexts import DynamicInferenceContext

LAYERS, CHANNELS, HEADS, CHUNK = 2, 4, 2, 4
CHUNK_BYTES = 2 * LAYERS * CHUNK * HEADS * CHANNELS * 4  # keys and values of every layer, fp32


def _context(chunks=5, **kwargs):
    return DynamicInferenceContext(torch.float32, LAYERS, CHANNELS, HEADS, max_sequence_length=12,
                                   buffer_size_gb=chunks * CHUNK_BYTES / 1024**3, chunk_size_tokens=CHUNK, **kwargs)


def test_chunks_come_from_the_buffer_and_go_back():
    context = _context(chunks=5, max_requests_override=3)
    assert context.is_dynamic_batching() and not context.is_static_batching()
    assert context.num_chunks == 5 and context.max_requests == 3 and context.max_tokens == 12
    context.allocate("a", 9)  # 3 chunks
    context.allocate("b", 4)  # 1 chunk
    assert context.request_chunks == {"a": [0, 1, 2], "b": [3]} and context.free_chunks == [4]
    assert context.can_allocate(4) and not context.can_allocate(5)
    with pytest.raises(RuntimeError, match=r"no room for 5 positions \(1 free chunks"):
        context.allocate("c", 5)
    with pytest.raises(ValueError, match="already holds memory"):
        context.allocate("a", 1)
    with pytest.raises(ValueError, match="13 positions exceed the context's max_sequence_length 12"):
        context.allocate("d", 13)
    context.release("a")
    assert sorted(context.free_chunks) == [0, 1, 2, 4] and "a" not in context.request_lengths
    split = _context(chunks=5, tensor_model_parallel_size=2)
    assert split.heads_per_rank == 1 and split.num_chunks == 10  # half the heads: twice the chunks per rank


def test_the_requests_mamba_states_come_out_of_the_buffer_first():
    # 10 chunks' bytes; each request's Mamba states take one and a half chunks.
    states = CHUNK_BYTES * 3 // 2
    # 3 requests: 4.5 chunks' bytes of states, 5 whole chunks left (fewer than 3 requests of 12 positions fill).
    assert _context(chunks=10, max_requests_override=3, mamba_state_bytes_per_request=states).num_chunks == 5
    # Without a request limit every chunk may be a request of its own: chunk and states together.
    assert _context(chunks=10, mamba_state_bytes_per_request=states).num_chunks == 10 * 2 // 5
    with pytest.raises(ValueError, match=r"beside the requests' Mamba states \(%d bytes each\)" % (4 * CHUNK_BYTES)):
        _context(chunks=3, max_requests_override=1, mamba_state_bytes_per_request=4 * CHUNK_BYTES)


def test_a_step_writes_each_request_and_reads_back_its_own_positions():
    context = _context(chunks=5)
    context.allocate("a", 6)
    context.allocate("b", 3)
    first = torch.arange(5 * HEADS * CHANNELS, dtype=torch.float32).view(5, 1, HEADS, CHANNELS)
    context.initialize_step([("a", 3), ("b", 2)])
    assert context.token_positions().tolist() == [0, 1, 2, 0, 1] and context.last_token_rows() == [2, 4]
    read = list(context.attention_inputs(1, first, -first))
    context.finish_step()
    assert [(rows, offset) for rows, _, _, offset in read] == [(slice(0, 3), 0), (slice(3, 5), 0)]
    assert torch.equal(read[0][1], first[:3]) and torch.equal(read[1][2], -first[3:])
    second = 100 + first[:3]
    context.initialize_step([("b", 1), ("a", 2)])  # b first this time; a's positions 3 and 4 span its two chunks
    assert context.token_positions().tolist() == [2, 3, 4]
    (_, keys_b, _, offset_b), (rows_a, keys_a, values_a, offset_a) = context.attention_inputs(1, second, -second)
    context.finish_step()
    assert (offset_b, offset_a, rows_a) == (2, 3, slice(1, 3))
    assert torch.equal(keys_b, torch.cat([first[3:5], second[:1]]))
    assert torch.equal(keys_a, torch.cat([first[:3], second[1:3]])) and torch.equal(values_a, -keys_a)
    assert context.request_lengths == {"a": 5, "b": 3}


def test_a_step_stays_within_the_reserved_positions_and_the_step_tokens():
    context = _context(chunks=5, max_tokens_override=4)
    context.allocate("a", 2)  # one chunk: 4 positions
    with pytest.raises(ValueError, match="a step of 5 tokens exceeds the context's max_tokens 4"):
        context.initialize_step([("a", 5)])
    context.initialize_step([("a", 4)])
    context.finish_step()
    with pytest.raises(ValueError, match="would write past the 4 positions it reserved"):
        context.initialize_step([("a", 1)])
    with pytest.raises(ValueError, match="holds no chunk"):
        _context(chunks=0.5)
    with pytest.raises(ValueError, match="num_attention_heads \\(2 key/value heads\\) must be divisible"):
        _context(tensor_model_parallel_size=4)
