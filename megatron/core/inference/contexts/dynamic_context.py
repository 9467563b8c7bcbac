"""`DynamicInferenceContext`: the key/value memory of continuous batching (upstream's class).

Requests of different lengths are decoded together and come and go between steps. The memory is one pool of
`buffer_size_gb` per rank, cut into chunks of `chunk_size_tokens` positions; each request owns the chunks that
hold its positions (for every layer at once), taken when it is admitted and given back when it ends. A step runs
the new tokens of several requests as one row (`[1, T]`): the whole prompt of a request that starts, one token of
a request that goes on. Each attention layer writes the step's keys and values into the requests' chunks
(`attention_inputs`), and every token attends to the positions of its own request up to its own. A hybrid model's
Mamba layers keep instead, per request, their last convolution inputs and scan state (a fixed size per request,
outside the chunk pool), continued step after step and dropped with the request; `mamba_state_bytes_per_request`
(ours: those bytes of all this rank's Mamba layers) is taken from `buffer_size_gb` for every request the context
admits before the rest is cut into chunks.

`num_attention_heads` is the model's number of key/value heads (its query groups), split over
`tensor_model_parallel_size` ranks as the attention splits them. A request needs its whole length (prompt plus
tokens to generate) in chunks when it is admitted (`allocate`), so a running request never waits for memory.
`max_requests_override` / `max_tokens_override` bound the requests of a step and the tokens of a step (default:
as many requests as chunks, and `max_sequence_length` tokens, so that any prompt fits one step); with
`max_requests_override` the pool holds at most the chunks of that many requests of `max_sequence_length`. The pool
of a layer is allocated at its first step. Upstream's
`buffer_guaranteed_fraction`, `buffer_overflow_factor`, `num_cuda_graphs` and `use_flashinfer_fused_rope` are
accepted and unused (no request pausing, CUDA graphs or fused kernels here).
"""

import math
from typing import Dict, List, Optional, Tuple

import torch


class DynamicInferenceContext:
    def __init__(self, params_dtype, num_layers: int, kv_channels: int, num_attention_heads: int,
                 max_sequence_length: int, buffer_size_gb: float, buffer_guaranteed_fraction: Optional[float] = None,
                 chunk_size_tokens: int = 256, buffer_overflow_factor: Optional[float] = None,
                 max_requests_override: Optional[int] = None, max_tokens_override: Optional[int] = None,
                 tensor_model_parallel_size: Optional[int] = None, num_cuda_graphs: Optional[int] = None,
                 use_flashinfer_fused_rope: bool = False, mamba_state_bytes_per_request: int = 0):
        del buffer_guaranteed_fraction, buffer_overflow_factor, num_cuda_graphs, use_flashinfer_fused_rope
        tp = 1 if tensor_model_parallel_size is None else tensor_model_parallel_size
        for name, value in (("num_layers", num_layers), ("kv_channels", kv_channels),
                            ("num_attention_heads", num_attention_heads), ("max_sequence_length", max_sequence_length),
                            ("chunk_size_tokens", chunk_size_tokens), ("tensor_model_parallel_size", tp)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"DynamicInferenceContext: {name} must be a positive integer, got {value!r}")
        if num_attention_heads % tp:
            raise ValueError(f"DynamicInferenceContext: num_attention_heads ({num_attention_heads} key/value heads) "
                             f"must be divisible by tensor_model_parallel_size ({tp})")
        self.params_dtype, self.num_layers, self.kv_channels = params_dtype, num_layers, kv_channels
        self.heads_per_rank = num_attention_heads // tp
        self.max_sequence_length, self.chunk_size_tokens = max_sequence_length, chunk_size_tokens
        dtype_bytes = torch.empty(0, dtype=params_dtype).element_size()
        chunk_bytes = 2 * num_layers * chunk_size_tokens * self.heads_per_rank * kv_channels * dtype_bytes
        if not isinstance(mamba_state_bytes_per_request, int) or mamba_state_bytes_per_request < 0:
            raise ValueError("DynamicInferenceContext: mamba_state_bytes_per_request must be a non-negative integer, "
                             f"got {mamba_state_bytes_per_request!r}")
        budget = int(buffer_size_gb * 1024**3)
        if max_requests_override is None:  # as many requests as chunks, each with its Mamba states
            self.num_chunks = budget // (chunk_bytes + mamba_state_bytes_per_request)
        else:  # the requests' Mamba states first; never more chunks than the requests can fill
            states = max_requests_override * mamba_state_bytes_per_request
            self.num_chunks = min(max(0, budget - states) // chunk_bytes,
                                  max_requests_override * self.chunks_for(max_sequence_length))
        if self.num_chunks < 1:
            raise ValueError(f"DynamicInferenceContext: buffer_size_gb={buffer_size_gb} holds no chunk of "
                             f"{chunk_size_tokens} positions ({chunk_bytes} bytes for {num_layers} layers) beside "
                             f"the requests' Mamba states ({mamba_state_bytes_per_request} bytes each); raise it "
                             "or lower chunk_size_tokens")
        self.max_requests = self.num_chunks if max_requests_override is None else max_requests_override
        self.max_tokens = max_sequence_length if max_tokens_override is None else max_tokens_override
        self.free_chunks: List[int] = list(range(self.num_chunks))
        self.request_chunks: Dict[object, List[int]] = {}
        self.request_lengths: Dict[object, int] = {}  # positions written so far
        self.key_value_memory: Dict[int, Tuple[torch.Tensor, torch.Tensor]] = {}
        # A hybrid model's Mamba layers: (convolution inputs, scan state) per (layer, request).
        self.mamba_memory: Dict[Tuple[int, object], Tuple[torch.Tensor, torch.Tensor]] = {}
        self.step_entries: List[Tuple[object, int]] = []  # (request id, new tokens) of the current step

    # ---- upstream's mode queries ---------------------------------------------------------------------------
    def is_static_batching(self) -> bool:
        return False

    def is_dynamic_batching(self) -> bool:
        return True

    # ---- requests --------------------------------------------------------------------------------------------
    def chunks_for(self, num_positions: int) -> int:
        return math.ceil(num_positions / self.chunk_size_tokens)

    def can_allocate(self, num_positions: int) -> bool:
        return (len(self.request_chunks) < self.max_requests
                and self.chunks_for(num_positions) <= len(self.free_chunks))

    def allocate(self, request_id, num_positions: int):
        """Reserve the chunks of `num_positions` positions (prompt plus tokens to generate) for a new request."""
        if num_positions > self.max_sequence_length:
            raise ValueError(f"request {request_id!r}: {num_positions} positions exceed the context's "
                             f"max_sequence_length {self.max_sequence_length}")
        if request_id in self.request_chunks:
            raise ValueError(f"request {request_id!r} already holds memory in this context")
        if not self.can_allocate(num_positions):
            raise RuntimeError(f"request {request_id!r}: no room for {num_positions} positions "
                               f"({len(self.free_chunks)} free chunks, {len(self.request_chunks)} of "
                               f"{self.max_requests} requests)")
        needed = self.chunks_for(num_positions)
        self.request_chunks[request_id] = self.free_chunks[:needed]
        del self.free_chunks[:needed]
        self.request_lengths[request_id] = 0

    def release(self, request_id):
        """Give a finished request's chunks back."""
        self.free_chunks.extend(self.request_chunks.pop(request_id))
        del self.request_lengths[request_id]
        for key in [key for key in self.mamba_memory if key[1] == request_id]:
            del self.mamba_memory[key]

    # ---- one step --------------------------------------------------------------------------------------------
    def initialize_step(self, entries: List[Tuple[object, int]]):
        """The step's requests and their numbers of new tokens, in row order (each request's tokens together)."""
        total = sum(count for _, count in entries)
        if total > self.max_tokens:
            raise ValueError(f"a step of {total} tokens exceeds the context's max_tokens {self.max_tokens}")
        for request_id, count in entries:
            capacity = len(self.request_chunks[request_id]) * self.chunk_size_tokens
            if self.request_lengths[request_id] + count > capacity:
                raise ValueError(f"request {request_id!r} would write past the {capacity} positions it reserved")
        self.step_entries = list(entries)

    def token_positions(self, device=None) -> torch.Tensor:
        """`[T]` int64: each new token's position in its request."""
        positions = [torch.arange(self.request_lengths[request_id], self.request_lengths[request_id] + count)
                     for request_id, count in self.step_entries]
        return torch.cat(positions).to(device)

    def last_token_rows(self) -> List[int]:
        """The row of each request's last new token, in step order (where its next token's logits are)."""
        rows, row = [], 0
        for _, count in self.step_entries:
            row += count
            rows.append(row - 1)
        return rows

    def step_spans(self) -> List[Tuple[int, int]]:
        """[(first row, end row)] of each request's new tokens in the step's row, in step order."""
        spans, row = [], 0
        for _, count in self.step_entries:
            spans.append((row, row + count))
            row += count
        return spans

    def request_mamba_states(self, layer_number: int, request_id, conv_shape, ssm_shape, conv_dtype, device):
        """(convolution inputs `conv_shape`, fp32 scan state `ssm_shape`) a Mamba layer continues `request_id`
        from: zeros before its first token, else what `store_request_mamba_states` kept."""
        if self.request_lengths[request_id] == 0 or (layer_number, request_id) not in self.mamba_memory:
            return (torch.zeros(*conv_shape, dtype=conv_dtype, device=device),
                    torch.zeros(*ssm_shape, dtype=torch.float32, device=device))
        return self.mamba_memory[(layer_number, request_id)]

    def store_request_mamba_states(self, layer_number: int, request_id, conv_state, ssm_state):
        """Keep a Mamba layer's state of `request_id` after this step's tokens (released with the request)."""
        self.mamba_memory[(layer_number, request_id)] = (conv_state.detach(), ssm_state.detach())

    def _pool(self, layer_number, key, value):
        if layer_number not in self.key_value_memory:
            shape = (self.num_chunks, self.chunk_size_tokens, key.shape[2])
            self.key_value_memory[layer_number] = (
                torch.zeros(*shape, key.shape[3], dtype=key.dtype, device=key.device),
                torch.zeros(*shape, value.shape[3], dtype=value.dtype, device=value.device))
        return self.key_value_memory[layer_number]

    def attention_inputs(self, layer_number: int, key: torch.Tensor, value: torch.Tensor):
        """Write the step's `key` / `value` (`[T, 1, groups, head_dim]`) into each request's chunks and yield, per
        request in row order, (its rows of the step, every key and value of the request so far `[L, 1, groups,
        head_dim]`, the position of its first new token)."""
        key_pool, value_pool = self._pool(layer_number, key, value)
        row = 0
        for request_id, count in self.step_entries:
            offset = self.request_lengths[request_id]
            positions = torch.arange(offset + count, device=key.device)
            chunks = torch.tensor(self.request_chunks[request_id], device=key.device)
            chunk_of, slot_of = chunks[positions // self.chunk_size_tokens], positions % self.chunk_size_tokens
            new = slice(offset, offset + count)
            key_pool[chunk_of[new], slot_of[new]] = key[row:row + count, 0]
            value_pool[chunk_of[new], slot_of[new]] = value[row:row + count, 0]
            yield (slice(row, row + count), key_pool[chunk_of, slot_of].unsqueeze(1),
                   value_pool[chunk_of, slot_of].unsqueeze(1), offset)
            row += count

    def finish_step(self):
        """After the whole model ran: the step's tokens count as written."""
        for request_id, count in self.step_entries:
            self.request_lengths[request_id] += count
        self.step_entries = []
