"""Multi-latent attention (DeepSeek-V2/V3): keys and values come from a shared low-rank latent of each token.

With n heads, d_n = qk_head_dim, d_r = qk_pos_emb_head_dim, d_v = v_head_dim:
- queries: `linear_q_proj` H -> n (d_n + d_r), or with a query latent `linear_q_down_proj` H -> q_lora_rank,
  `q_layernorm`, `linear_q_up_proj` q_lora_rank -> n (d_n + d_r); each head's query is `[q_nope | q_rope]`;
- keys and values: `linear_kv_down_proj` H -> kv_lora_rank + d_r, split into the latent and k_rope (one vector
  per token, shared by every head); `kv_layernorm` on the latent; `linear_kv_up_proj` kv_lora_rank ->
  n (d_n + d_v), per head `[k_nope | v]`; each head's key is `[k_nope | k_rope]`;
- RoPE (YaRN by default, see `yarn_rotary_pos_embedding`) rotates only q_rope and k_rope;
- softmax scale ms(s, mscale_all_dim)^2 / sqrt(d_n + d_r) (ms = 1 without rotary scaling);
- `linear_proj` n d_v -> H.
The latent norms exist with `qk_layernorm` (`--qk-layernorm`), as in Megatron's layer specs; the linear layers
have no bias except `linear_proj` (`add_bias_linear`).

Tensor parallelism: the up projections are column-parallel and `linear_proj` row-parallel, so each rank holds
whole heads (the output rows are laid out per head, independent of the TP size). The down projections are
duplicated on every rank (`DuplicatedLinear`): with sequence parallelism each rank projects its own tokens and
the up projections all-gather the (small) latents; k_rope, which no parallel layer consumes, is gathered (or,
without sequence parallelism, its gradient all-reduced over the heads of every rank) here.

Context parallelism uses the project's context-parallel attention with RoPE at global positions; values are
zero-padded to the query width there when d_v differs (the padded output columns are zero and dropped).

With `qk_clip` or `log_max_attention_logit`, each training forward raises `max_attention_logits` (fp32, one entry
per local head) to the largest pre-softmax logit softmax_scale * [q_nope | q_rope] . [k_nope | k_rope] it saw, as
`SelfAttention` does (see attention_logits.py; not measured again in a recompute). QK-Clip's rescale of the
query and key rows is in megatron/core/optimizer/qk_clip.py.

Sliding-window layers (`window_size`, `window_attn_skip_freq`) and attention sinks (`softmax_type`, with
"learnable" the parameter `softmax_offset` `[heads per partition]`) work as in `SelfAttention`, from
attention_variants.py: the window is an explicit mask over global positions added before the logit tracking (keys
outside it do not count) and context parallelism; the sinks take MLA's softmax scale.

When decoding (`inference_context`, a `StaticInferenceContext`), each layer caches the up-projected keys
`[k_nope | k_rope]` (k_rope rotated at its absolute position) and values of this rank's heads, as upstream's static
inference does, and the step's queries (rotated at positions offset .. offset + s - 1) attend over every cached
position through `core_attention` with the causal (or windowed) mask of those positions.
"""

import math
from contextlib import nullcontext

import torch
import torch.nn.functional as F

from megatron.core import parallel_state, tensor_parallel
from megatron.core.extensions.transformer_engine import layer_classes
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import (
    YarnRotaryEmbedding,
    apply_rotary_pos_emb_regrouped,
    rotary_angles,
    yarn_get_mscale,
)
from megatron.core.offloading.fine_grained import offloaded_saved_tensors
from megatron.core.packed_sequences import packed_attention_mask_with, packed_attention_rows, packed_rotary_angles
from megatron.core.tensor_parallel.duplicated_linear import DuplicatedLinear
from megatron.core.transformer import layer_scaled_attention
from megatron.core.transformer.attention import (
    Attention,
    check_layer_number,
    is_dynamic_batching,
    one_inference_context,
    refuse_unsupported_forward_inputs,
)
from megatron.core.transformer.attention_variants import (
    attention_with_sinks,
    blocked_or_causal,
    build_softmax_offset,
    is_layer_window_attention,
    window_blocked,
    windowed_mask,
)
from megatron.core.transformer.context_parallel import comm_type_of_layer, context_parallel_attention, local_rows
from megatron.core.transformer.init_seeds import build_with_init_seed, derive_init_seed, resolve_base_init_seed
from megatron.core.transformer.norms import build_norm
from megatron.core.transformer.packed_attention import attention_runs, per_run_core_attention
from megatron.core.transformer.recompute import checkpointed, is_recomputing, output_recomputed_in_backward
from megatron.core.transformer.transformer_config import TransformerConfig


def mla_softmax_scale(config: TransformerConfig) -> float:
    """ms(s, mscale_all_dim)^2 / sqrt(qk_head_dim + qk_pos_emb_head_dim); ms is 1 with plain RoPE."""
    correction = 1.0
    if config.effective_rope_type == "yarn":
        correction = yarn_get_mscale(config.rotary_scaling_factor, config.mscale_all_dim)
    return correction * correction / math.sqrt(config.qk_head_dim + config.qk_pos_emb_head_dim)


def build_mla_rotary_embedding(config: TransformerConfig):
    """(the rotary embedding of the rope channels, the factor on its cos and sin)."""
    if config.effective_rope_type == "rope":
        return RotaryEmbedding(config.qk_pos_emb_head_dim, rotary_base=config.rotary_base), 1.0
    yarn = YarnRotaryEmbedding(
        config.qk_pos_emb_head_dim,
        rotary_base=config.rotary_base,
        scaling_factor=config.rotary_scaling_factor,
        original_max_position_embeddings=config.original_max_position_embeddings,
        beta_fast=config.beta_fast,
        beta_slow=config.beta_slow,
        mscale=config.mscale,
        mscale_all_dim=config.mscale_all_dim,
    )
    return yarn, yarn.cos_sin_scale


class MLASelfAttention(Attention):
    """Multi-latent self-attention of one transformer layer (same interface as `SelfAttention`).

    Args:
        config: the transformer config (`multi_latent_attention` fields set).
        layer_number: 1-based index of the owning layer in the whole model.
        init_seed: seed of the owning layer's initial weights; None derives it from `config.init_seed`.
    """

    def __init__(self, config: TransformerConfig, layer_number: int, init_seed=None):
        super().__init__()
        if not config.multi_latent_attention:
            raise ValueError("MLASelfAttention needs a config with multi_latent_attention (--multi-latent-attention)")
        check_layer_number("MLASelfAttention", layer_number)
        self.config = config
        self.layer_number = layer_number
        tp_size = config.tensor_model_parallel_size
        heads = config.num_attention_heads
        self.num_heads_per_partition = heads // tp_size
        self.q_head_dim = config.qk_head_dim + config.qk_pos_emb_head_dim
        self.softmax_scale = mla_softmax_scale(config)
        self.rotary_pos_emb, self.rotary_cos_sin_scale = build_mla_rotary_embedding(config)
        if init_seed is None:
            init_seed = derive_init_seed(resolve_base_init_seed(config), "layer", layer_number)
        column_parallel_linear, row_parallel_linear = layer_classes(config)

        def seeded(name, build):
            return build_with_init_seed(derive_init_seed(init_seed, f"self_attention.{name}"), build)

        def column(name, input_size, output_size):
            return seeded(name, lambda: column_parallel_linear(
                input_size, output_size, config=config, init_method=config.init_method, bias=False,
                gather_output=False))

        def duplicated(name, input_size, output_size):
            return seeded(name, lambda: DuplicatedLinear(
                input_size, output_size, config=config, init_method=config.init_method).register_fp8_histories())

        self.q_layernorm = None
        if config.q_lora_rank is None:
            self.linear_q_proj = column("linear_q_proj", config.hidden_size, heads * self.q_head_dim)
        else:
            self.linear_q_down_proj = duplicated("linear_q_down_proj", config.hidden_size, config.q_lora_rank)
            if config.qk_layernorm:
                self.q_layernorm = build_norm(config, config.q_lora_rank)
            self.linear_q_up_proj = column("linear_q_up_proj", config.q_lora_rank, heads * self.q_head_dim)
        self.linear_kv_down_proj = duplicated(
            "linear_kv_down_proj", config.hidden_size, config.kv_lora_rank + config.qk_pos_emb_head_dim)
        self.kv_layernorm = build_norm(config, config.kv_lora_rank) if config.qk_layernorm else None
        self.linear_kv_up_proj = column(
            "linear_kv_up_proj", config.kv_lora_rank, heads * (config.qk_head_dim + config.v_head_dim))
        self.linear_proj = seeded("linear_proj", lambda: row_parallel_linear(
            heads * config.v_head_dim, config.hidden_size, config=config,
            init_method=config.output_layer_init_method, bias=config.add_bias_linear, input_is_parallel=True,
            skip_bias_add=config.add_bias_linear))  # the bias is returned, as upstream (see `forward`)
        self.tracks_max_attention_logits = config.qk_clip or config.log_max_attention_logit
        self.max_attention_logits = None  # [heads per partition] fp32 while tracking; None before a forward
        self.window_size = (config.window_size if is_layer_window_attention(
            config.window_size, config.window_attn_skip_freq, layer_number) else None)
        self.softmax_offset = build_softmax_offset(config, self.num_heads_per_partition)

    # ------------------------------------------------------------------------------------------------
    # Projections
    # ------------------------------------------------------------------------------------------------

    def _down_projections(self, hidden_states):
        """(the query path's input to `_up_projections`: the query latent, or `hidden_states` without one; the
        key/value latent `[S, b, kv_lora_rank]`; k_rope `[S, b, 1, d_r]`, ready for every head of this rank)."""
        config = self.config
        query_input = hidden_states
        if config.q_lora_rank is not None:
            query_input, _ = self.linear_q_down_proj(hidden_states)
        compressed, _ = self.linear_kv_down_proj(hidden_states)
        kv_latent, k_rope = torch.split(compressed, [config.kv_lora_rank, config.qk_pos_emb_head_dim], dim=-1)
        # k_rope serves this rank's heads only: its gradient must be summed over the ranks' heads.
        if config.sequence_parallel and config.tensor_model_parallel_size > 1:
            k_rope = tensor_parallel.gather_from_sequence_parallel_region(k_rope, tensor_parallel_output_grad=True)
        else:
            k_rope = tensor_parallel.copy_to_tensor_model_parallel_region(k_rope)
        return query_input, kv_latent, k_rope.unsqueeze(2)

    def _up_projections(self, query_input, kv_latent, k_rope, angles):
        """The latents' norms, the up projections and RoPE -> (query, key `[S, b, heads, d_n + d_r]`, value
        `[S, b, heads, d_v]`), S the whole sequence of this rank's TP group."""
        config = self.config
        if config.q_lora_rank is None:
            query, _ = self.linear_q_proj(query_input)
        else:
            if self.q_layernorm is not None:
                query_input = self.q_layernorm(query_input)
            query, _ = self.linear_q_up_proj(query_input)
        query = query.view(query.shape[0], query.shape[1], self.num_heads_per_partition, self.q_head_dim)
        if self.kv_layernorm is not None:
            kv_latent = self.kv_layernorm(kv_latent)
        kv, _ = self.linear_kv_up_proj(kv_latent)
        kv = kv.view(kv.shape[0], kv.shape[1], self.num_heads_per_partition, config.qk_head_dim + config.v_head_dim)
        k_nope, value = torch.split(kv, [config.qk_head_dim, config.v_head_dim], dim=-1)
        q_nope, q_rope = torch.split(query, [config.qk_head_dim, config.qk_pos_emb_head_dim], dim=-1)
        q_rope = apply_rotary_pos_emb_regrouped(q_rope, angles, self.rotary_cos_sin_scale)
        k_rope = apply_rotary_pos_emb_regrouped(k_rope, angles, self.rotary_cos_sin_scale)
        query = torch.cat((q_nope, q_rope), dim=-1)
        key = torch.cat((k_nope, k_rope.expand(-1, -1, self.num_heads_per_partition, -1)), dim=-1)
        return query, key, value

    def _rotary_angles(self, seq_len, device):
        """Angles of this rank's `seq_len` positions (global positions under context parallelism)."""
        cp_size = self.config.context_parallel_size
        if cp_size == 1:
            return rotary_angles(self.rotary_pos_emb, seq_len, device=device)
        angles = rotary_angles(self.rotary_pos_emb, seq_len * cp_size, device=device)
        return local_rows(angles, 0, cp_size, parallel_state.get_context_parallel_rank())

    # ------------------------------------------------------------------------------------------------
    # Attention
    # ------------------------------------------------------------------------------------------------

    def core_attention(self, query, key, value, attention_mask):
        """Attention of `[S, b, heads, d_n + d_r]` queries and keys over `[S, b, heads, d_v]` values ->
        `[S, b, heads * d_v]`; `attention_mask` as in `SelfAttention.core_attention` (None: causal).

        A training forward measures the logits first (`track_max_attention_logits`) when they are tracked; the
        same call recomputed in backward does not."""
        if self.tracks_max_attention_logits and self.training and not is_recomputing():
            self.track_max_attention_logits(query, key, attention_mask, scale=self.softmax_scale)
        dropout_p = self.config.attention_dropout if self.training else 0.0
        sinks = self._sinks(query.device)
        if self.config.context_parallel_size > 1:
            value_width = value.shape[-1]
            if value_width < query.shape[-1]:
                value = F.pad(value, (0, query.shape[-1] - value_width))
            elif value_width > query.shape[-1]:
                query, key = (F.pad(t, (0, value_width - t.shape[-1])) for t in (query, key))
            comm_type = comm_type_of_layer(self.config.cp_comm_type, self.layer_number)
            group = (parallel_state.get_hierarchical_context_parallel_groups() if comm_type == "a2a+p2p"
                     else parallel_state.get_context_parallel_group())
            context = context_parallel_attention(query, key, value, attention_mask, comm_type=comm_type, group=group,
                                                 dropout_p=dropout_p, scale=self.softmax_scale, sinks=sinks)
            seq_len, batch = context.shape[0], context.shape[1]
            context = context.view(seq_len, batch, self.num_heads_per_partition, -1)[..., :value_width]
            return context.reshape(seq_len, batch, -1)
        query, key, value = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # -> [b, heads, S, d]
        if sinks is not None:
            blocked = blocked_or_causal(attention_mask, query.shape[2], key.shape[2], query.device)
            with tensor_parallel.get_cuda_rng_tracker().fork():
                context = attention_with_sinks(query, key, value, blocked, sinks, dropout_p, scale=self.softmax_scale)
            return context.permute(2, 0, 1, 3).reshape(context.shape[2], context.shape[0], -1)
        if layer_scaled_attention.applies(self.config, query):
            # Its scores are Q.K^T / sqrt(d): the query carries the rest of the softmax scale (YaRN's mscale^2).
            correction = self.softmax_scale * math.sqrt(query.shape[-1])
            context = layer_scaled_attention.layer_scaled_attention(
                query * correction if correction != 1.0 else query, key, value, attention_mask, self.layer_number,
                dropout_p)
            return context.permute(2, 0, 1, 3).reshape(context.shape[2], context.shape[0], -1)
        if attention_mask is None:
            mask_kwargs = {"is_causal": True}
        else:
            mask_kwargs = {"attn_mask": ~attention_mask.to(torch.bool)}
        with tensor_parallel.get_cuda_rng_tracker().fork():  # ranks hold different heads: different masks
            context = F.scaled_dot_product_attention(query, key, value, dropout_p=dropout_p, scale=self.softmax_scale,
                                                     **mask_kwargs)
        seq_len, batch = context.shape[2], context.shape[0]
        return context.permute(2, 0, 1, 3).reshape(seq_len, batch, -1)

    def cached_attention(self, hidden_states, inference_context):
        """One decoding step: `hidden_states` `[s, b, h]` at positions offset .. offset + s - 1 of
        `inference_context`; this step's keys and values join its cache, the queries attend over all cached ones
        -> the attention output before `linear_proj`, `[s, b, heads * d_v]`."""
        offset = inference_context.sequence_len_offset
        query_input, kv_latent, k_rope = self._down_projections(hidden_states)
        step_len, device = k_rope.shape[0], k_rope.device
        angles = rotary_angles(self.rotary_pos_emb, step_len, device=device, offset=offset)
        query, key, value = self._up_projections(query_input, kv_latent, k_rope, angles)
        key, value = inference_context.append_key_value(self.layer_number, key, value)
        query_positions = torch.arange(offset, offset + step_len, device=device)
        key_positions = torch.arange(key.shape[0], device=device)
        if self.window_size is None:
            blocked = key_positions.unsqueeze(0) > query_positions.unsqueeze(1)  # True where masked
        else:
            blocked = window_blocked(query_positions, key_positions, self.window_size)
        return self.core_attention(query, key, value, blocked)

    def forward(self, hidden_states, attention_mask=None, key_value_states=None, inference_context=None,
                rotary_pos_emb=None, rotary_pos_cos=None, rotary_pos_sin=None, attention_bias=None,
                packed_seq_params=None, sequence_len_offset=None, *, inference_params=None):
        """`hidden_states` `[s, b, h]` (`[s / tp, b, h]` with sequence parallelism) -> `(output, bias)` as
        upstream: the output has the input's shape; `bias` is `linear_proj`'s, not yet added (None without
        `add_bias_linear`); the layer adds it with the residual dropout. Upstream's arguments in its order (see
        `SelfAttention.forward`).

        `rotary_pos_emb` (the model's angles for whole heads) is not used: the rope channels have their own.
        With `packed_seq_params` each token attends within its own packed sequence, its rope channels rotated by
        its position in it (megatron/core/packed_sequences.py).
        With `inference_context` the step goes through its key/value cache (`cached_attention`); the causal mask
        then follows the absolute positions, so `attention_mask` must be None.

        Selective recompute: core_attn checkpoints the attention; mla_up_proj recomputes the up projections and
        RoPE in backward without keeping their outputs (both together: one checkpoint over the two)."""
        del rotary_pos_emb
        refuse_unsupported_forward_inputs(
            "MLASelfAttention", key_value_states=key_value_states, rotary_pos_cos=rotary_pos_cos,
            rotary_pos_sin=rotary_pos_sin, attention_bias=attention_bias, sequence_len_offset=sequence_len_offset)
        inference_context = one_inference_context("MLASelfAttention", inference_context, inference_params)
        rows = runs = None
        if packed_seq_params is not None:
            rows = packed_attention_rows("MLASelfAttention", packed_seq_params, self.config, hidden_states,
                                         inference_context is not None)
        if inference_context is not None:
            if attention_mask is not None:
                raise ValueError("MLASelfAttention: decoding through a key/value cache (inference_context) is causal "
                                 "over the cached positions; pass attention_mask=None")
            if is_dynamic_batching(inference_context):
                raise ValueError("MLASelfAttention: continuous batching (DynamicInferenceContext) is not supported "
                                 "with multi-latent attention; generate with the StaticInferenceEngine")
            return self.linear_proj(self.cached_attention(hidden_states, inference_context))
        query_input, kv_latent, k_rope = self._down_projections(hidden_states)
        if rows is None:
            angles = self._rotary_angles(k_rope.shape[0], k_rope.device)
        else:  # the angles of every row's position in its own sequence (all rows' angles, then this rank's)
            all_rows = k_rope.shape[0] * self.config.context_parallel_size
            angles = packed_rotary_angles(rotary_angles(self.rotary_pos_emb, all_rows, device=k_rope.device),
                                          rows.positions)
            # One sequence at a time, or the whole row under the block-diagonal mask (packed_attention.py).
            runs = attention_runs(rows, attention_mask, self._plain_attention(k_rope))
            if runs is None:  # the window, if any, applied within each sequence
                attention_mask = packed_attention_mask_with(rows, attention_mask, self.window_size)
        core_attention = per_run_core_attention(self.core_attention, runs)
        if self.window_size is not None and rows is None:
            # Over global positions: under context parallelism the mask covers the whole sequence.
            full_len = k_rope.shape[0] * self.config.context_parallel_size
            attention_mask = windowed_mask(attention_mask, self.window_size, full_len, k_rope.device)
        recompute_up = self.training and self.config.recomputes("mla_up_proj")
        recompute_attention = self.config.recomputes("core_attn")

        def up_projections(query_input, kv_latent, k_rope):
            return self._up_projections(query_input, kv_latent, k_rope, angles)

        if recompute_up and recompute_attention:
            context = checkpointed(
                lambda *latents: core_attention(*up_projections(*latents), attention_mask),
                query_input, kv_latent, k_rope)
        else:
            if recompute_up:
                (query, key, value), attention_context = output_recomputed_in_backward(
                    up_projections, query_input, kv_latent, k_rope)
            else:
                (query, key, value), attention_context = up_projections(query_input, kv_latent, k_rope), nullcontext()
            with attention_context:
                if recompute_attention:
                    context = checkpointed(core_attention, query, key, value, attention_mask)
                else:
                    with offloaded_saved_tensors(self, "core_attn"):
                        context = core_attention(query, key, value, attention_mask)
        return self.linear_proj(context)
