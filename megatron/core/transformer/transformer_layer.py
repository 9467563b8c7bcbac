"""One pre-norm transformer layer: x + drop(attn(norm(x))), then x + drop(mlp(norm(x))).

With `apply_residual_connection_post_layernorm` the residual is the normalised input instead:
norm(x) + drop(attn(norm(x))), then the same around the MLP. With `fp32_residual_connection` the residual stream
`x` is fp32 (the block casts its input); each norm reads it in the parameters' dtype, and the sums promote back
to fp32.

Under `--transformer-impl transformer_engine` the two norms run inside the first linear of the attention (QKV)
and of the MLP (fc1), Transformer Engine's fused LayerNorm-linear, as in Megatron's TE layer spec; the layer then
does not apply them itself. The norm modules stay the layer's (`input_layernorm`, `pre_mlp_layernorm`) and the
fused linears use their parameters, so both implementations have the same parameter and checkpoint names. The
post-layernorm residual needs the norm's output itself, so with it the layer applies its norms and TE's plain
linears run.

A heterogeneous model's layer (`--heterogeneous-layers-config-path`, see `heterogeneous/`) builds its attention
and MLP from its own config (query groups, MLP width); either may be absent (`no_op`: the residual passes through,
no norm) or one hidden x hidden linear after the norm (`replace_with_linear`: `self_attention.linear_attn`,
`mlp.linear_mlp`).

Selective recompute (`--recompute-modules`): with mlp, a dense layer's MLP is checkpointed (MoE layers: moe, see
`MoELayer`); with layernorm, the layer's norms are recomputed in backward and their outputs are not kept by the
sublayers reading them (`output_recomputed_in_backward`). Norms fused into TE's linears, and the post-layernorm
residual (which keeps the norm's output anyway), are left as they are. When the MLP is checkpointed the pre-MLP
norm runs inside its checkpoint.
"""

from contextlib import nullcontext

import torch

from megatron.core.extensions.transformer_engine import uses_transformer_engine
from megatron.core.ssm.mamba_config import ATTENTION as ATTENTION_LAYER
from megatron.core.ssm.mamba_config import MLP as MLP_LAYER
from megatron.core.ssm.mamba_config import MOE as MOE_LAYER
from megatron.core.transformer.attention import (
    SelfAttention,
    one_inference_context,
    refuse_unsupported_forward_inputs,
)
from megatron.core.transformer.heterogeneous.linear_replacements import LinearReplacedAttention, LinearReplacedMLP
from megatron.core.transformer.init_seeds import derive_init_seed, reset_children_parameters, resolve_base_init_seed
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.moe.moe_config import moe_layer_pattern
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.multi_latent_attention import MLASelfAttention
from megatron.core.transformer.norms import build_norm
from megatron.core.transformer.recompute import checkpointed, output_recomputed_in_backward
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import residual_dropout


def layer_init_seed(base_seed: int, layer_number: int) -> int:
    """Seed of the initial weights of global layer `layer_number` (the same on every pipeline layout)."""
    return derive_init_seed(base_seed, "layer", layer_number)


def _check_upstream_layer_arguments(submodules, pg_collection, vp_stage):
    """Upstream's (config, submodules, layer_number, hidden_dropout, pg_collection, vp_stage): what this layer,
    built from the config, cannot honour is refused by name."""
    if isinstance(submodules, int) and not isinstance(submodules, bool):
        raise TypeError(f"TransformerLayer(config, {submodules}, ...): the second argument is upstream's submodules; "
                        f"pass the layer number by keyword (layer_number={submodules})")
    if submodules is not None:
        raise TypeError(f"TransformerLayer(submodules={submodules!r}): layers are built from the TransformerConfig "
                        "here, so the submodules of get_gpt_layer_local_spec() are None; pass spec.submodules (None)")
    if pg_collection is not None:
        raise ValueError("TransformerLayer(pg_collection=...) is not supported here: the layer uses parallel_state's "
                         "process groups (initialize_model_parallel); pass None")
    if vp_stage is not None:
        raise ValueError("TransformerLayer(vp_stage=...) is not supported here: layer_number is the layer's 1-based "
                         "number in the whole model (no pipeline offset is added); pass that and vp_stage=None")


def _add_bias(output_and_bias):
    """A sublayer's `(output, bias)` (upstream's return of attention, `MLP` and `MoELayer`) -> output + bias; the
    residual dropout then applies to the sum, as upstream's bias-dropout-add."""
    output, bias = output_and_bias
    return output if bias is None else output + bias


class TransformerLayer(torch.nn.Module):
    """Args (upstream's order): config; submodules: None (the `.submodules` of the specs of `gpt_layer_specs`: the
    layer is built from the config); layer_number: 1-based
    index of this layer in the whole model; hidden_dropout: the residual dropout (None: `config.hidden_dropout`);
    pg_collection and vp_stage: None. base_init_seed (keyword): the model's base init seed (None:
    `config.init_seed`, else the default generator's seed). The layer's initial weights depend only on the base
    seed and `layer_number`."""

    def __init__(self, config: TransformerConfig, submodules=None, layer_number: int = 1, hidden_dropout=None,
                 pg_collection=None, vp_stage=None, *, base_init_seed=None):
        super().__init__()
        _check_upstream_layer_arguments(submodules, pg_collection, vp_stage)
        self.config = config
        self.layer_number = layer_number
        if base_init_seed is None:
            base_init_seed = resolve_base_init_seed(config)
        self.init_seed = layer_init_seed(base_init_seed, layer_number)
        # Under TE the norms are applied by the fused LayerNorm-linears (QKV, fc1), with these modules' parameters.
        self.norms_fused_into_linears = (uses_transformer_engine(config)
                                         and not config.apply_residual_connection_post_layernorm)
        fused = self.norms_fused_into_linears
        # A hybrid model's attention layer ('*') has no MLP, its MLP and MoE layers ('-', 'E') no attention
        # (upstream's IdentityOp).
        symbol = config.layer_symbol(layer_number)
        self.input_layernorm = self.self_attention = self.pre_mlp_layernorm = self.mlp = None
        self.norms_fused_into_mlp = False
        if symbol not in (MLP_LAYER, MOE_LAYER):
            self._build_attention(config, layer_number, fused)
        if symbol != ATTENTION_LAYER:
            self._build_mlp(config, layer_number, fused)
        self.hidden_dropout = torch.nn.Dropout(config.hidden_dropout if hidden_dropout is None else hidden_dropout)
        recompute_norms = config.recomputes("layernorm") and not config.apply_residual_connection_post_layernorm
        self.recompute_input_layernorm = recompute_norms and not self.norms_fused_into_linears
        self.recompute_pre_mlp_layernorm = recompute_norms and not self.norms_fused_into_mlp
        # A dense MLP checkpointed here; a MoE layer checkpoints itself, with the norm here when both are asked.
        self.checkpoint_mlp = config.recomputes("mlp") and isinstance(self.mlp, MLP)
        self.checkpoint_norm_and_mlp = self.recompute_pre_mlp_layernorm and isinstance(self.mlp, MoELayer) and (
            config.recomputes("moe") or config.moe_layer_recompute)

    def _build_attention(self, config, layer_number, fused):
        # A heterogeneous model's layer may drop its attention (no_op) or put one linear in its place.
        block = config.heterogeneous_block(layer_number)
        if block is not None and block.attention.no_op:
            return
        self.input_layernorm = build_norm(config, config.hidden_size)
        if block is not None and block.attention.replace_with_linear:
            self.norms_fused_into_linears = False
            self.self_attention = LinearReplacedAttention(config, init_seed=self.init_seed)
            return
        config = config.get_config_for_layer(layer_number)
        if config.multi_latent_attention:
            self.self_attention = MLASelfAttention(config, layer_number, init_seed=self.init_seed)
        else:
            self.self_attention = SelfAttention(config, layer_number, init_seed=self.init_seed,
                                                fused_input_norm=self.input_layernorm if fused else None)

    def _build_mlp(self, config, layer_number, fused):
        block = config.heterogeneous_block(layer_number)
        if block is not None and block.mlp.no_op:
            return
        self.pre_mlp_layernorm = build_norm(config, config.hidden_size)
        if block is not None and block.mlp.replace_with_linear:
            self.mlp = LinearReplacedMLP(config, init_seed=self.init_seed)
            return
        config = config.get_config_for_layer(layer_number)
        if moe_layer_pattern(config)[layer_number - 1]:
            self.mlp = MoELayer(config, layer_number=layer_number, init_seed=self.init_seed)
            self.norms_fused_into_mlp = False  # the router and the experts read the normalised input
        else:
            self.mlp = MLP(config, init_seed=self.init_seed,
                           fused_input_norm=self.pre_mlp_layernorm if fused else None)
            self.norms_fused_into_mlp = fused

    def reset_parameters(self):
        """Redraw this layer's initial weights; the same values as at construction, whatever else ran before."""
        reset_children_parameters(self)

    def _dropout(self, x):
        return residual_dropout(self.hidden_dropout, x, self.config.sequence_parallel)

    def _norm(self, norm, hidden_states, fused):
        """The sublayer's input: `norm(hidden_states)`, or `hidden_states` itself when the sublayer's first linear
        applies the norm (`fused`). An fp32 residual is read in the parameters' dtype."""
        if self.config.fp32_residual_connection:
            hidden_states = hidden_states.to(self.config.params_dtype)
        return hidden_states if fused else norm(hidden_states)

    def _residual_add(self, residual, sublayer_input, sublayer_output):
        if self.config.apply_residual_connection_post_layernorm:
            residual = sublayer_input
        if self.config.fp32_residual_connection:
            residual = residual.float()
        return residual + self._dropout(sublayer_output)

    def _norm_for(self, norm, hidden_states, fused, recompute):
        """(the sublayer's input, the context to run the sublayer in): with `recompute` (training) the norm's
        output is not kept for backward."""
        if recompute and self.training:
            return output_recomputed_in_backward(lambda hidden: self._norm(norm, hidden, fused), hidden_states)
        return self._norm(norm, hidden_states, fused), nullcontext()

    def _mlp_block(self, hidden_states):
        """(the MLP's input, its output) of the residual stream `hidden_states`; the input is None when it ran
        inside a checkpoint together with the MLP (not needed: no post-layernorm residual then)."""
        fused = self.norms_fused_into_mlp
        if self.training and (self.checkpoint_mlp or self.checkpoint_norm_and_mlp):
            if self.recompute_pre_mlp_layernorm:
                return None, _add_bias(checkpointed(
                    lambda hidden: self.mlp(self._norm(self.pre_mlp_layernorm, hidden, fused)), hidden_states))
            mlp_input = self._norm(self.pre_mlp_layernorm, hidden_states, fused)
            return mlp_input, _add_bias(checkpointed(self.mlp, mlp_input))
        mlp_input, mlp_context = self._norm_for(self.pre_mlp_layernorm, hidden_states, fused,
                                                self.recompute_pre_mlp_layernorm)
        with mlp_context:
            return mlp_input, _add_bias(self.mlp(mlp_input))

    def forward(self, hidden_states, attention_mask=None, context=None, context_mask=None, rotary_pos_emb=None,
                rotary_pos_cos=None, rotary_pos_sin=None, attention_bias=None, inference_context=None,
                packed_seq_params=None, sequence_len_offset=None, *, inference_params=None):
        """Upstream's signature and return: `(hidden_states, context)`, the layer's output `[s, b, h]` and
        `context` (None: a decoder-only layer has no cross-attention). `inference_context` (a
        `StaticInferenceContext`; `inference_params` is its older name): decode through its key/value cache (see
        `SelfAttention.forward`); None in training. The cross-attention inputs (`context`, `context_mask`),
        `rotary_pos_cos` / `rotary_pos_sin`, `attention_bias` and `sequence_len_offset` must be None (see
        `refuse_unsupported_forward_inputs`); `packed_seq_params` goes to the attention (see
        `SelfAttention.forward`)."""
        refuse_unsupported_forward_inputs("TransformerLayer", context=context, context_mask=context_mask,
                                          rotary_pos_cos=rotary_pos_cos, rotary_pos_sin=rotary_pos_sin,
                                          attention_bias=attention_bias, sequence_len_offset=sequence_len_offset)
        inference_context = one_inference_context("TransformerLayer", inference_context, inference_params)
        if self.self_attention is not None:
            hidden_states = self._attention_block(hidden_states, attention_mask, rotary_pos_emb, inference_context,
                                                  packed_seq_params)
        if self.mlp is None:
            return hidden_states, None
        mlp_input, mlp_output = self._mlp_block(hidden_states)
        return self._residual_add(hidden_states, mlp_input, mlp_output), None

    def _attention_block(self, hidden_states, attention_mask, rotary_pos_emb, inference_context, packed_seq_params):
        attention_input, attention_context = self._norm_for(self.input_layernorm, hidden_states,
                                                            self.norms_fused_into_linears,
                                                            self.recompute_input_layernorm)
        with attention_context:
            # Only the inputs given: an attention from a spec may not take the others.
            given = {name: value for name, value in (("inference_context", inference_context),
                                                     ("packed_seq_params", packed_seq_params)) if value is not None}
            attention_output = _add_bias(self.self_attention(attention_input, attention_mask=attention_mask,
                                                             rotary_pos_emb=rotary_pos_emb, **given))
        return self._residual_add(hidden_states, attention_input, attention_output)
