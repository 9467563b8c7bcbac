"""`StaticInferenceContext`: the key/value cache of static-batch autoregressive decoding.

A batch of at most `max_batch_size` sequences is decoded together for at most `max_sequence_length` positions.
Each attention layer keeps a key and a value cache of shape `[max_sequence_length, max_batch_size, groups,
head_dim]` (`key_value_memory_dict[layer_number]`, sequence-first like the activations); the values may be of
another width than the keys (multi-latent attention caches its up-projected keys, `qk_head_dim +
qk_pos_emb_head_dim` wide, and values, `v_head_dim` wide, per head). A forward pass over
new positions writes its keys and values at `[sequence_len_offset, sequence_len_offset + n)` for the batch rows
`[batch_size_offset, batch_size_offset + b)` and attends to everything cached so far; after the whole model
ran, the caller advances `sequence_len_offset` by `n`. A batch may also run as several micro-batches of rows
(upstream's pipelined decoding): `increment_batch_size_offset(b)` after each, `reset_batch_size_offset()` before
the next step. `swap_key_value_dict(batch_idx)` reorders the cached sequences (beam search), `reset()` starts a new
batch. A hybrid model's Mamba layers keep, per batch row, their last convolution inputs and scan state instead
(`mamba_states` / `store_mamba_states`).
"""

import torch


class StaticInferenceContext:
    """Key/value cache and offsets of one static decoding batch."""

    def __init__(self, max_batch_size: int, max_sequence_length: int):
        for name, value in (("max_batch_size", max_batch_size), ("max_sequence_length", max_sequence_length)):
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        self.max_batch_size = max_batch_size
        self.max_sequence_length = max_sequence_length
        self.current_batch_size = max_batch_size
        self.sequence_len_offset = 0
        self.batch_size_offset = 0
        self.decode_mode = False
        self.key_value_memory_dict = {}
        self.mamba_state_dict = {}

    @classmethod
    def from_config(cls, inference_wrapper_config):
        """The context an `InferenceWrapperConfig` sizes (its inference_max_requests and inference_max_seq_length)."""
        return cls(inference_wrapper_config.inference_max_requests, inference_wrapper_config.inference_max_seq_length)

    # ---- mode and offsets ----------------------------------------------------------------------------------
    def is_static_batching(self) -> bool:
        return True

    def is_dynamic_batching(self) -> bool:
        return False

    def is_decode_only(self) -> bool:
        """True once the prompt is in the cache and each step adds one position."""
        return self.decode_mode

    def enable_prefill_mode(self):
        self.decode_mode = False

    def enable_decode_mode(self):
        self.decode_mode = True

    def increment_sequence_len_offset(self, increment: int):
        if self.sequence_len_offset + increment > self.max_sequence_length:
            raise ValueError(f"decoding past max_sequence_length {self.max_sequence_length} "
                             f"(offset {self.sequence_len_offset} + {increment})")
        self.sequence_len_offset += increment

    def increment_batch_size_offset(self, increment: int):
        """Move past the `increment` rows of the micro-batch just run: the next forward writes the rows after them."""
        if self.batch_size_offset + increment > self.max_batch_size:
            raise ValueError(f"batch rows past max_batch_size {self.max_batch_size} "
                             f"(offset {self.batch_size_offset} + {increment})")
        self.batch_size_offset += increment

    def reset_batch_size_offset(self):
        """Back to the first row (before the first micro-batch of the next step)."""
        self.batch_size_offset = 0

    def reset(self):
        """Start a new batch: offsets back to zero, decode mode off (the caches are reused and overwritten)."""
        self.sequence_len_offset = 0
        self.batch_size_offset = 0
        self.current_batch_size = self.max_batch_size
        self.decode_mode = False

    # ---- the cache -----------------------------------------------------------------------------------------
    def key_value_cache(self, layer_number: int, num_groups: int, head_dim: int, dtype, device,
                        value_head_dim=None):
        """The (key, value) cache of `layer_number`, allocated (zeros) on first use; the values are
        `value_head_dim` wide (None: `head_dim`)."""
        if layer_number not in self.key_value_memory_dict:
            rows = (self.max_sequence_length, self.max_batch_size, num_groups)
            value_head_dim = head_dim if value_head_dim is None else value_head_dim
            self.key_value_memory_dict[layer_number] = (torch.zeros(*rows, head_dim, dtype=dtype, device=device),
                                                        torch.zeros(*rows, value_head_dim, dtype=dtype, device=device))
        return self.key_value_memory_dict[layer_number]

    def append_key_value(self, layer_number: int, key: torch.Tensor, value: torch.Tensor):
        """Write `key` / `value` (`[new positions, batch, groups, head_dim]`, the value's head_dim may differ)
        at the current offsets; returns the keys and values of every position cached so far for these batch rows
        (`[offset + new, batch, ...]`)."""
        if key.dim() != 4 or value.dim() != 4 or key.shape[:3] != value.shape[:3]:
            raise ValueError(f"key and value must both be [sequence, batch, groups, head_dim] (the same but for "
                             f"head_dim), got {tuple(key.shape)} and {tuple(value.shape)}")
        new_positions, batch = key.shape[0], key.shape[1]
        seq_end = self.sequence_len_offset + new_positions
        batch_end = self.batch_size_offset + batch
        if seq_end > self.max_sequence_length or batch_end > self.max_batch_size:
            raise ValueError(f"positions up to {seq_end} / batch rows up to {batch_end} exceed the context's "
                             f"max_sequence_length {self.max_sequence_length} / max_batch_size {self.max_batch_size}")
        key_cache, value_cache = self.key_value_cache(layer_number, key.shape[2], key.shape[3], key.dtype,
                                                      key.device, value_head_dim=value.shape[3])
        rows = slice(self.batch_size_offset, batch_end)
        key_cache[self.sequence_len_offset:seq_end, rows] = key
        value_cache[self.sequence_len_offset:seq_end, rows] = value
        return key_cache[:seq_end, rows], value_cache[:seq_end, rows]

    # ---- a hybrid model's Mamba layers ----------------------------------------------------------------------
    def mamba_states(self, layer_number: int, batch: int, conv_shape, ssm_shape, conv_dtype, device):
        """(convolution inputs `[b, *conv_shape]`, scan state `[b, *ssm_shape]` fp32) a Mamba layer continues from,
        for the batch rows `[batch_size_offset, batch_size_offset + b)`: zeros at the start of a batch (offset 0),
        else what `store_mamba_states` kept at the previous step."""
        if self.sequence_len_offset == 0 or layer_number not in self.mamba_state_dict:
            return (torch.zeros(batch, *conv_shape, dtype=conv_dtype, device=device),
                    torch.zeros(batch, *ssm_shape, dtype=torch.float32, device=device))
        conv_state, ssm_state = self.mamba_state_dict[layer_number]
        rows = slice(self.batch_size_offset, self.batch_size_offset + batch)
        return conv_state[rows], ssm_state[rows]

    def store_mamba_states(self, layer_number: int, conv_state: torch.Tensor, ssm_state: torch.Tensor):
        """Keep a Mamba layer's state after the positions this forward added, for the current batch rows."""
        stored = self.mamba_state_dict.get(layer_number)
        if stored is None or stored[0].shape[1:] != conv_state.shape[1:] or stored[1].shape[1:] != ssm_state.shape[1:]:
            stored = tuple(torch.zeros(self.max_batch_size, *state.shape[1:], dtype=state.dtype, device=state.device)
                           for state in (conv_state, ssm_state))
            self.mamba_state_dict[layer_number] = stored
        rows = slice(self.batch_size_offset, self.batch_size_offset + conv_state.shape[0])
        stored[0][rows], stored[1][rows] = conv_state.detach(), ssm_state.detach()

    def swap_key_value_dict(self, batch_idx):
        """Reorder the cached sequences of every layer: row i becomes old row `batch_idx[i]` (rows past
        `len(batch_idx)` are left as they are); a Mamba layer's state moves with its row."""
        if not self.key_value_memory_dict and not self.mamba_state_dict:
            raise ValueError("swap_key_value_dict: the key/value cache is empty (nothing decoded yet)")
        batch_idx = torch.as_tensor(batch_idx, dtype=torch.long)
        if batch_idx.dim() != 1 or batch_idx.numel() > self.max_batch_size:
            raise ValueError(f"batch_idx must list at most max_batch_size ({self.max_batch_size}) rows, got "
                             f"shape {tuple(batch_idx.shape)}")
        for key_cache, value_cache in self.key_value_memory_dict.values():
            index = batch_idx.to(key_cache.device)
            for cache in (key_cache, value_cache):
                cache[:, :index.numel()] = cache.index_select(1, index)
        for states in self.mamba_state_dict.values():
            for state in states:
                index = batch_idx.to(state.device)
                state[:index.numel()] = state.index_select(0, index)

    def __str__(self):
        return (f"StaticInferenceContext(max_batch_size={self.max_batch_size}, max_sequence_length="
                f"{self.max_sequence_length}, sequence_len_offset={self.sequence_len_offset}, batch_size_offset="
                f"{self.batch_size_offset}, layers cached={sorted(self.key_value_memory_dict)})")
