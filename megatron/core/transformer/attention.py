"""Causal multi-head self-attention with its heads split across tensor-parallel ranks.

The fused QKV projection is column-parallel; its output, viewed per query group, is laid out as
`[groups, (q_0 | ... | q_{m-1} | k | v) of head_dim each]` with m = heads / groups query heads per group. With
multi-head attention (groups == heads, the default) that is `[heads, (q | k | v)]`. A contiguous slice of output
rows is a set of whole groups with their own queries, key and value, so each rank attends with its own groups
only, and the output projection is row-parallel and sums the heads' contributions across ranks. The layout does
not depend on the tensor-parallel size, so the same full weight gives the same model at every TP size.

The QKV projection has a bias with `add_bias_linear` or, alone among the linears, with `add_qkv_bias` (Qwen2).

When decoding (`inference_context`, a `StaticInferenceContext`), each layer writes this step's keys and values
(after rotary embedding, so cached keys keep their absolute positions) into the context's cache, and the queries
attend over every cached position: query i of the step sits at position offset + i and sees keys up to there.
Under tensor parallelism each rank caches its own query groups only.

With `qk_layernorm` each query and key head is normalised over its head_dim by a norm shared by all heads. Ranks
hold different heads, so a rank's gradient of those weights is a partial sum: they carry `sequence_parallel=True`,
which makes gradient finalisation all-reduce them over the tensor-parallel group.

With `qk_clip` or `log_max_attention_logit`, each training forward raises `max_attention_logits` (fp32, one
entry per local query head) to the largest pre-softmax logit it saw (see attention_logits.py); the training step
reduces it over data- and context-parallel ranks, QK-Clip reads it (megatron/core/optimizer/qk_clip.py), and the
next step starts it afresh; a forward recomputed in backward (`--recompute-granularity full`) is not
measured again.

Sliding-window layers (`window_size`, `window_attn_skip_freq`) attend under the causal mask and the window (see
attention_variants.py); the window is an explicit mask, so it composes with a given mask, context parallelism
(a mask over global positions) and the logit tracking (keys outside the window do not count). With
`softmax_type` other than vanilla the softmax has a sink per head; "learnable" makes it the parameter
`softmax_offset` `[heads per partition]`, split over tensor-parallel ranks by heads like the queries.

NoPE layers (`no_rope_freq`), the L2 norm of the query and key heads (`qk_l2_norm`) and the output gate
(`attention_output_gate`, which adds the gate's rows to each group of the fused QKV projection) are described in
attention_head_transforms.py.
"""

import torch
import torch.nn.functional as F

from megatron.core import parallel_state, tensor_parallel
from megatron.core.extensions.transformer_engine import fused_norm_linear_class, layer_classes
from megatron.core.models.common.embeddings.rotary_pos_embedding import apply_rotary_pos_emb
from megatron.core.offloading.fine_grained import offloaded_saved_tensors
from megatron.core.packed_sequences import packed_attention_mask_with, packed_attention_rows, rows_rotary_angles
from megatron.core.transformer.attention_logits import context_parallel_max_attention_logits, max_attention_logits
from megatron.core.transformer.context_parallel import comm_type_of_layer, context_parallel_attention
from megatron.core.transformer import layer_scaled_attention
from megatron.core.transformer.attention_head_transforms import (
    gate_attention_output,
    is_no_rope_layer,
    l2_normalize_heads,
    split_fused_qkv,
)
from megatron.core.transformer.attention_variants import (
    attention_with_sinks,
    blocked_or_causal,
    build_softmax_offset,
    is_layer_window_attention,
    sink_logits,
    window_blocked,
    windowed_mask,
)
from megatron.core.transformer.init_seeds import build_with_init_seed, derive_init_seed, resolve_base_init_seed
from megatron.core.transformer.norms import build_norm
from megatron.core.transformer.packed_attention import attention_runs, per_run_core_attention
from megatron.core.transformer.recompute import checkpointed, is_recomputing
from megatron.core.transformer.transformer_config import TransformerConfig


def check_layer_number(module_name, layer_number):
    """Attention modules take (config, layer_number, ...): upstream's (config, submodules, layer_number, ...) would
    put its submodules where the layer number goes."""
    if isinstance(layer_number, bool) or not isinstance(layer_number, int) or layer_number < 1:
        raise TypeError(f"{module_name}(config, layer_number, ...): layer_number must be the layer's 1-based number "
                        f"in the whole model, got {layer_number!r}; upstream's second argument, submodules, is not "
                        f"taken here (the attention is built from the config): pass layer_number=N by keyword")


_UNSUPPORTED_FORWARD_INPUTS = {
    "context": "cross-attention needs an encoder's output, and layers here are decoder-only self-attention",
    "context_mask": "cross-attention needs an encoder's output, and layers here are decoder-only self-attention",
    "key_value_states": "cross-attention needs an encoder's output, and layers here are decoder-only self-attention",
    "rotary_pos_cos": "pass the rotary angles as rotary_pos_emb (GPTModel computes them)",
    "rotary_pos_sin": "pass the rotary angles as rotary_pos_emb (GPTModel computes them)",
    "attention_bias": "an additive attention bias is not supported; mask with attention_mask (True where masked)",
    "sequence_len_offset": "decoding takes its offset from inference_context.sequence_len_offset",
}


def refuse_unsupported_forward_inputs(module_name, **given):
    """Upstream's forward arguments of the layer and its attention that this project has no use for must be
    None; each one given is refused by name."""
    for name, value in given.items():
        if value is not None:
            raise ValueError(f"{module_name}.forward({name}=...) is not supported: "
                             f"{_UNSUPPORTED_FORWARD_INPUTS[name]}; pass {name}=None")


def is_dynamic_batching(inference_context) -> bool:
    """Whether `inference_context` is continuous batching's (a `DynamicInferenceContext`)."""
    query = getattr(inference_context, "is_dynamic_batching", None)
    return bool(query()) if callable(query) else False


def one_inference_context(module_name, inference_context, inference_params):
    """`inference_context`, or upstream's older name for it, `inference_params`."""
    if inference_params is None:
        return inference_context
    if inference_context is not None and inference_context is not inference_params:
        raise ValueError(f"{module_name}.forward: pass inference_context or its older name inference_params, not "
                         "two different contexts")
    return inference_params


class Attention(torch.nn.Module):
    """Base of the attention modules (upstream's name, which tools test modules against)."""

    def reset_parameters(self):
        """Initialise the parameters this module owns itself (the learnable sinks `softmax_offset`: zeros, as
        upstream); the projections and norms reset themselves."""
        if getattr(self, "softmax_offset", None) is not None:
            with torch.no_grad():
                self.softmax_offset.zero_()

    def _plain_attention(self, query) -> bool:
        """Whether the core attention is plain causal attention that a packed row may run one sequence at a time
        (packed_attention.py): no context parallelism, window, sinks, fp16 layer scaling or logit tracking."""
        return (self.config.context_parallel_size == 1 and self.window_size is None
                and self._sinks(query.device) is None and not layer_scaled_attention.applies(self.config, query)
                and not self.tracks_max_attention_logits)

    def _sinks(self, device):
        """The sink logit of each local head for `--softmax-type` off-by-one / learnable; None for vanilla."""
        return sink_logits(self.config.softmax_type, self.softmax_offset, self.num_heads_per_partition, device)

    def track_max_attention_logits(self, query, key, attention_mask, scale=None):
        """Raise `max_attention_logits` to this forward's per-head maxima (the arguments of `core_attention`;
        `scale`: the softmax scale, None for 1 / sqrt(head dim))."""
        if self.config.context_parallel_size > 1:
            maxima = context_parallel_max_attention_logits(query, key, attention_mask,
                                                           parallel_state.get_context_parallel_group(), scale=scale)
        else:
            maxima = max_attention_logits(query, key, attention_mask, scale=scale)
        previous = self.max_attention_logits
        self.max_attention_logits = maxima if previous is None else torch.maximum(previous, maxima)


class SelfAttention(Attention):
    """Self-attention of one transformer layer.

    Args:
        config: the transformer config.
        layer_number: 1-based index of the owning layer in the whole model (not the stage).
        init_seed: seed of the owning layer's initial weights (see `init_seeds`); None derives it from
            `config.init_seed` and `layer_number`.
        fused_input_norm: the owning layer's input norm when the QKV projection applies it (Transformer
            Engine's fused LayerNorm-linear, see `fused_norm_linear_class`); None when the layer applies it.
    """

    def __init__(self, config: TransformerConfig, layer_number: int, init_seed=None, fused_input_norm=None):
        super().__init__()
        check_layer_number("SelfAttention", layer_number)
        self.config = config
        self.layer_number = layer_number
        tp_size = config.tensor_model_parallel_size
        self.head_dim = config.kv_channels
        self.num_heads_per_partition = config.num_attention_heads // tp_size
        self.num_groups_per_partition = config.num_query_groups // tp_size
        self.heads_per_group = config.num_attention_heads // config.num_query_groups
        projection_size = config.num_attention_heads * config.kv_channels
        qkv_size = projection_size + 2 * config.num_query_groups * config.kv_channels
        # See attention_head_transforms.py: the gate rows, a NoPE layer, the L2 norm of the heads.
        self.output_gate = config.attention_output_gate
        if self.output_gate:
            qkv_size += projection_size
        self.skips_rotary_embedding = is_no_rope_layer(config.no_rope_freq, layer_number)
        if init_seed is None:
            init_seed = derive_init_seed(resolve_base_init_seed(config), "layer", layer_number)
        column_parallel_linear, row_parallel_linear = layer_classes(config)
        qkv_kwargs = {}
        if fused_input_norm is not None:
            column_parallel_linear = fused_norm_linear_class(config)
            qkv_kwargs = {"norm": fused_input_norm}

        self.linear_qkv = build_with_init_seed(
            derive_init_seed(init_seed, "self_attention.linear_qkv"),
            lambda: column_parallel_linear(
                config.hidden_size,
                qkv_size,
                config=config,
                init_method=config.init_method,
                bias=config.add_bias_linear or config.add_qkv_bias,
                gather_output=False,
                **qkv_kwargs,
            ),
        )
        self.linear_proj = build_with_init_seed(
            derive_init_seed(init_seed, "self_attention.linear_proj"),
            lambda: row_parallel_linear(
                projection_size,
                config.hidden_size,
                config=config,
                init_method=config.output_layer_init_method,
                bias=config.add_bias_linear,
                input_is_parallel=True,
                skip_bias_add=config.add_bias_linear,  # returned by forward, as upstream
            ),
        )
        self.q_layernorm = self.k_layernorm = None
        if config.qk_layernorm:
            self.q_layernorm = build_norm(config, self.head_dim)
            self.k_layernorm = build_norm(config, self.head_dim)
            for param in (*self.q_layernorm.parameters(), *self.k_layernorm.parameters()):
                param.sequence_parallel = tp_size > 1
        self.tracks_max_attention_logits = config.qk_clip or config.log_max_attention_logit
        self.max_attention_logits = None  # [heads per partition] fp32 while tracking; None before a forward
        self.window_size = (config.window_size if is_layer_window_attention(
            config.window_size, config.window_attn_skip_freq, layer_number) else None)
        self.softmax_offset = build_softmax_offset(config, self.num_heads_per_partition)

    def core_attention(self, query, key, value, attention_mask):
        """Scaled dot-product attention on `[s, b, heads, head_dim]` queries and `[s, b, groups, head_dim]` keys
        and values (query head i uses group i // (heads / groups)) -> `[s, b, heads * head_dim]`.

        `attention_mask` follows Megatron: a bool tensor broadcastable to `[b, heads, s, s]` that is True where
        attention is NOT allowed; None means causal. Under context parallelism `s` is this rank's share of the
        sequence and the mask (if any) covers the whole sequence (see `context_parallel`).
        """
        dropout_p = self.config.attention_dropout if self.training else 0.0
        if self.config.context_parallel_size > 1:
            # This rank's two sequence chunks; the comm type makes the result exact over the whole sequence.
            comm_type = comm_type_of_layer(self.config.cp_comm_type, self.layer_number)
            group = (parallel_state.get_hierarchical_context_parallel_groups() if comm_type == "a2a+p2p"
                     else parallel_state.get_context_parallel_group())
            return context_parallel_attention(query, key, value, attention_mask, comm_type=comm_type, group=group,
                                              dropout_p=dropout_p, sinks=self._sinks(query.device))
        query, key, value = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # -> [b, heads, s, head_dim]
        if layer_scaled_attention.applies(self.config, query):
            context = layer_scaled_attention.layer_scaled_attention(query, key, value, attention_mask,
                                                                    self.layer_number, dropout_p)
            return context.permute(2, 0, 1, 3).reshape(context.shape[2], context.shape[0], -1)
        sinks = self._sinks(query.device)
        if sinks is not None:
            blocked = blocked_or_causal(attention_mask, query.shape[2], key.shape[2], query.device)
            with tensor_parallel.get_cuda_rng_tracker().fork():
                context = attention_with_sinks(query, key, value, blocked, sinks, dropout_p)
            return context.permute(2, 0, 1, 3).reshape(context.shape[2], context.shape[0], -1)
        if attention_mask is None:
            mask_kwargs = {"is_causal": True}
        else:
            mask_kwargs = {"attn_mask": ~attention_mask.to(torch.bool)}
        # Ranks hold different heads, so their attention dropout masks must differ: use the tracker's stream.
        with tensor_parallel.get_cuda_rng_tracker().fork():
            context = F.scaled_dot_product_attention(query, key, value, dropout_p=dropout_p,
                                                     enable_gqa=key.shape[1] != query.shape[1], **mask_kwargs)
        seq_len, batch = context.shape[2], context.shape[0]
        return context.permute(2, 0, 1, 3).reshape(seq_len, batch, -1)

    def cached_core_attention(self, query, key, value, inference_context):
        """Attention of this step's queries `[s, b, heads, head_dim]` over the cached keys and values, after
        appending this step's `key` / `value` `[s, b, groups, head_dim]` to `inference_context`'s cache at its
        offset -> `[s, b, heads * head_dim]`. Causal in absolute positions; no dropout (decoding)."""
        offset = inference_context.sequence_len_offset
        key, value = inference_context.append_key_value(self.layer_number, key, value)
        return self._attend_cached(query, key, value, offset)

    def dynamic_core_attention(self, query, key, value, inference_context):
        """`cached_core_attention` for continuous batching (a `DynamicInferenceContext`): the step's rows belong
        to several requests; each request's queries attend over its own cached keys and values."""
        pieces = [self._attend_cached(query[rows], request_keys, request_values, offset)
                  for rows, request_keys, request_values, offset
                  in inference_context.attention_inputs(self.layer_number, key, value)]
        return torch.cat(pieces, dim=0)

    def _attend_cached(self, query, key, value, offset):
        """Queries `[s, b, heads, head_dim]` at positions offset .. offset + s - 1 over the keys and values of
        positions 0 .. offset + s - 1 (`[offset + s, b, groups, ...]`) -> `[s, b, heads * head_dim]`."""
        query, key, value = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # -> [b, heads, s, head_dim]
        query_len, key_len = query.shape[2], key.shape[2]
        # True where masked (Megatron's convention): query i (position offset + i) sees keys 0 .. offset + i.
        if self.window_size is None:
            blocked = torch.ones(query_len, key_len, dtype=torch.bool, device=query.device).triu(offset + 1)
        else:
            blocked = window_blocked(torch.arange(offset, offset + query_len, device=query.device),
                                     torch.arange(key_len, device=query.device), self.window_size)
        sinks = self._sinks(query.device)
        if sinks is not None:
            context = attention_with_sinks(query, key, value, blocked, sinks)
        elif layer_scaled_attention.applies(self.config, query):
            context = layer_scaled_attention.layer_scaled_attention(query, key, value, blocked, self.layer_number,
                                                                    dropout_p=0.0)
        else:
            context = F.scaled_dot_product_attention(query, key, value, attn_mask=~blocked,
                                                     enable_gqa=key.shape[1] != query.shape[1])
        return context.permute(2, 0, 1, 3).reshape(query_len, context.shape[0], -1)

    def forward(self, hidden_states, attention_mask=None, key_value_states=None, inference_context=None,
                rotary_pos_emb=None, rotary_pos_cos=None, rotary_pos_sin=None, attention_bias=None,
                packed_seq_params=None, sequence_len_offset=None, *, inference_params=None):
        """`hidden_states` `[s, b, h]` (`[s / tp, b, h]` with sequence parallelism) -> `(output, bias)` as
        upstream: the output has the input's shape; `bias` `[h]` is `linear_proj`'s, not yet added (None without
        `add_bias_linear`); the layer adds it with the residual dropout. Upstream's arguments in its order;
        `key_value_states`, `rotary_pos_cos` / `rotary_pos_sin`, `attention_bias` and `sequence_len_offset` must
        be None, and `inference_params` is `inference_context`'s older name.

        With `packed_seq_params` (upstream's THD call: `hidden_states` `[t, 1, h]`, `rotary_pos_emb` the angles of
        positions 0 .. n - 1, n at least the longest sequence) each token attends within its own sequence, rotated
        by its position in it (megatron/core/packed_sequences.py).

        With `inference_context` the step's keys and values go into its cache and the queries attend over all
        cached positions (`rotary_pos_emb` must then hold the angles of positions offset .. offset + s - 1);
        the causal mask follows the absolute positions, so `attention_mask` must be None."""
        refuse_unsupported_forward_inputs(
            "SelfAttention", key_value_states=key_value_states, rotary_pos_cos=rotary_pos_cos,
            rotary_pos_sin=rotary_pos_sin, attention_bias=attention_bias, sequence_len_offset=sequence_len_offset)
        inference_context = one_inference_context("SelfAttention", inference_context, inference_params)
        rows = runs = None
        if packed_seq_params is not None:
            rows = packed_attention_rows("SelfAttention", packed_seq_params, self.config, hidden_states,
                                         inference_context is not None)
            if rotary_pos_emb is not None:
                rotary_pos_emb = rows_rotary_angles("SelfAttention", rotary_pos_emb, rows)
        # [s, b, groups_per_partition * (m + 2) * head_dim]; (2m + 2) * head_dim per group with the output gate
        mixed_qkv, _ = self.linear_qkv(hidden_states)
        seq_len = mixed_qkv.shape[0]
        query, key, value, gate = split_fused_qkv(mixed_qkv, self.num_groups_per_partition, self.heads_per_group,
                                                  self.head_dim, self.output_gate)
        # Both head norms come before the rotary embedding, as upstream (the L2 norm takes q_layernorm's place):
        # YaRN's factor on cos and sin then survives into the logits.
        if self.q_layernorm is not None:
            query, key = self.q_layernorm(query), self.k_layernorm(key)
        if self.config.qk_l2_norm:
            eps = self.config.layernorm_epsilon
            query, key = l2_normalize_heads(query, eps), l2_normalize_heads(key, eps)

        if rotary_pos_emb is not None and not self.skips_rotary_embedding:
            scale = self.config.yarn_cos_sin_scale
            query = apply_rotary_pos_emb(query, rotary_pos_emb, self.config, mscale=scale)
            key = apply_rotary_pos_emb(key, rotary_pos_emb, self.config, mscale=scale)

        if rows is not None:  # packed: one sequence at a time, or the whole row under the block-diagonal mask
            runs = attention_runs(rows, attention_mask, self._plain_attention(query))
            if runs is None:  # the window, if any, applied within each sequence
                attention_mask = packed_attention_mask_with(rows, attention_mask, self.window_size)
        core_attention = per_run_core_attention(self.core_attention, runs)
        if inference_context is not None:
            if attention_mask is not None:
                raise ValueError("SelfAttention: decoding through a key/value cache (inference_context) is causal "
                                 "over the cached positions; pass attention_mask=None")
            if is_dynamic_batching(inference_context):
                context = self.dynamic_core_attention(query, key, value, inference_context)
            else:
                context = self.cached_core_attention(query, key, value, inference_context)
        else:
            if self.window_size is not None and rows is None:
                # Over global positions: under context parallelism the mask covers the whole sequence.
                full_len = seq_len * self.config.context_parallel_size
                attention_mask = windowed_mask(attention_mask, self.window_size, full_len, query.device)
            if self.tracks_max_attention_logits and self.training and not is_recomputing():
                self.track_max_attention_logits(query, key, attention_mask)
            if self.config.recomputes("core_attn"):
                context = checkpointed(core_attention, query, key, value, attention_mask)
            else:
                with offloaded_saved_tensors(self, "core_attn"):
                    context = core_attention(query, key, value, attention_mask)

        if gate is not None:
            context = gate_attention_output(context, gate)
        return self.linear_proj(context)
