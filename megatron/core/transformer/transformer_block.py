"""The layers one pipeline stage owns, plus the final norm on the last stage.

A stage holds consecutive global layers offset + 1 .. offset + count (1-based `layer_number`); inside the module
they are `layers.0 .. layers.{count - 1}` (a hybrid model's Mamba layers among them, see `build_layer`). Evenly
split, stage p of P holds L/P layers from p * L/P; with an interleaved pipeline each model chunk is one virtual
stage; uneven splits come from the pipeline-split flags (see `pipeline_stage_layer_range` and `pipeline_split`). A
stage that is not first takes its input from `set_input_tensor` (what the previous stage sent) instead of the
`hidden_states` argument. A stage may hold no layer at all (an uneven split): it then passes its input on
(normalised on the last stage).
"""

import contextlib
from typing import Optional

import torch

from megatron.core.fp8_utils import get_fp8_context
from megatron.core.offloading.activations import ActivationOffloader
from megatron.core.offloading.fine_grained import attach_fine_grained_offloading
from megatron.core.ssm.mamba_config import MAMBA as MAMBA_LAYER
from megatron.core.ssm.mamba_layer import MambaLayer
from megatron.core.transformer.attention import one_inference_context, refuse_unsupported_forward_inputs
from megatron.core.transformer.init_seeds import resolve_base_init_seed
from megatron.core.transformer.norms import build_norm
from megatron.core.transformer.pipeline_stage import pipeline_stage_layer_range
from megatron.core.transformer.recompute import checkpointed as plain_checkpointed
from megatron.core.transformer.recompute import distributed_checkpointed
from megatron.core.transformer.spec_utils import TransformerBlockSubmodules
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import TransformerLayer

__all__ = ["TransformerBlock", "TransformerBlockSubmodules", "pipeline_stage_layer_range"]


def build_layer(config: TransformerConfig, layer_number: int, base_init_seed):
    """Global layer `layer_number`: a `MambaLayer` where a hybrid model's pattern says 'M', else a
    `TransformerLayer` (attention only for '*', MLP only for '-', both in a GPT model)."""
    if config.layer_symbol(layer_number) == MAMBA_LAYER:
        return MambaLayer(config, layer_number, base_init_seed=base_init_seed)
    return TransformerLayer(config, layer_number=layer_number, base_init_seed=base_init_seed)


class TransformerBlock(torch.nn.Module):
    """Args (upstream's order): config; spec: upstream's layer spec or block spec (`TransformerBlockSubmodules`,
    from `gpt_layer_specs`) or None; the layers are built from the config, and a spec asking for other layers is
    refused; post_layer_norm: the last stage applies the final norm (True; a block spec's `layer_norm=None` turns
    it off, as upstream); pre_process: this stage is first (takes `hidden_states` from the embedding);
    post_process: this stage is last; base_init_seed: the model's base init seed (None: `config.init_seed`, else
    the default generator's seed). Each layer's initial weights depend only on it and the layer's global number,
    so a stage's layers equal the same layers of a single-stage model."""

    def __init__(
        self, config: TransformerConfig, spec=None, post_layer_norm: bool = True, pre_process: bool = True,
        post_process: bool = True, base_init_seed=None, vp_stage: Optional[int] = None,
    ):
        super().__init__()
        from megatron.core.models.gpt.gpt_layer_specs import check_layer_spec

        check_layer_spec(spec, config, vp_stage)
        if isinstance(spec, TransformerBlockSubmodules) and spec.layer_norm is None:
            post_layer_norm = False
        self.config = config
        self.pre_process = pre_process
        self.post_process = post_process
        self.layer_offset, num_local_layers = pipeline_stage_layer_range(config, vp_stage)
        if base_init_seed is None:
            base_init_seed = resolve_base_init_seed(config)
        self.layers = torch.nn.ModuleList(
            build_layer(config, self.layer_offset + index + 1, base_init_seed) for index in range(num_local_layers)
        )
        self.post_layer_norm = post_layer_norm
        self.final_layernorm = build_norm(config, config.hidden_size) if post_process and post_layer_norm else None
        self.input_tensor: Optional[torch.Tensor] = None
        self.activation_offloader = None  # --cpu-offloading builds it at the first forward
        if config.fine_grained_activation_offloading:
            # One offloader for the block: its labels (layer, piece) follow the forward order for the prefetch.
            self.activation_offloader = ActivationOffloader(min_offloaded_tensor_size=config.min_offloaded_tensor_size)
            for layer in self.layers:
                attach_fine_grained_offloading(layer, self.activation_offloader, config.offload_modules)

    def set_input_tensor(self, input_tensor: Optional[torch.Tensor]):
        """The activation received from the previous pipeline stage (`[s, b, h]`), used instead of the argument."""
        self.input_tensor = input_tensor

    def _run_layers(self, start, end, packed_seq_params=None):
        def run(hidden_states, attention_mask, rotary_pos_emb, inference_context=None):
            kwargs = {} if inference_context is None else {"inference_context": inference_context}
            if packed_seq_params is not None:
                kwargs["packed_seq_params"] = packed_seq_params
            for index in range(start, end):
                layer = self.layers[index]
                with get_fp8_context(self.config, layer.layer_number - 1), self._activation_offload(index, layer):
                    hidden_states, _ = layer(hidden_states, attention_mask=attention_mask,
                                             rotary_pos_emb=rotary_pos_emb, **kwargs)
            return hidden_states

        return run

    def _activation_offload(self, index, layer):
        """Saved-tensor hooks moving the activations of the first `cpu_offloading_num_layers` local layers to
        host memory (`--cpu-offloading`); a no-op context for the others and in evaluation."""
        if not (self.config.cpu_offloading and index < self.config.cpu_offloading_num_layers
                and torch.is_grad_enabled()):
            return contextlib.nullcontext()
        if self.activation_offloader is None:
            self.activation_offloader = ActivationOffloader()
        return self.activation_offloader.hooks(layer.layer_number)

    def _forward_with_full_recompute(self, hidden_states, attention_mask, rotary_pos_emb, packed_seq_params=None):
        checkpointed = distributed_checkpointed if self.config.distribute_saved_activations else plain_checkpointed
        num_layers = len(self.layers)
        chunk = self.config.recompute_num_layers
        if self.config.recompute_method == "uniform":
            for start in range(0, num_layers, chunk):
                run_chunk = self._run_layers(start, min(start + chunk, num_layers), packed_seq_params)
                hidden_states = checkpointed(run_chunk, hidden_states, attention_mask, rotary_pos_emb)
            return hidden_states
        # "block": recompute the first `chunk` layers of this stage, keep the activations of the rest.
        for index in range(num_layers):
            run_layer = self._run_layers(index, index + 1, packed_seq_params)
            if index < chunk:
                hidden_states = checkpointed(run_layer, hidden_states, attention_mask, rotary_pos_emb)
            else:
                hidden_states = run_layer(hidden_states, attention_mask, rotary_pos_emb)
        return hidden_states

    def forward(self, hidden_states, attention_mask=None, context=None, context_mask=None, rotary_pos_emb=None,
                rotary_pos_cos=None, rotary_pos_sin=None, attention_bias=None, inference_context=None,
                packed_seq_params=None, sequence_len_offset=None, *, inference_params=None):
        """`[s, b, h]` (`[s / tp, b, h]` with sequence parallelism) -> same shape. With `inference_context` (or
        its older name `inference_params`) each layer's attention decodes through the context's key/value cache
        (no recomputation). Upstream's arguments in its order; those the layers have no use for (`context`,
        `context_mask`, `rotary_pos_cos` / `rotary_pos_sin`, `attention_bias`, `sequence_len_offset`) must be
        None. `packed_seq_params` goes to every layer's attention (see `SelfAttention.forward`)."""
        refuse_unsupported_forward_inputs("TransformerBlock", context=context, context_mask=context_mask,
                                          rotary_pos_cos=rotary_pos_cos, rotary_pos_sin=rotary_pos_sin,
                                          attention_bias=attention_bias, sequence_len_offset=sequence_len_offset)
        inference_context = one_inference_context("TransformerBlock", inference_context, inference_params)
        if not self.pre_process:
            if self.input_tensor is None:
                raise RuntimeError("a pipeline stage that is not first needs set_input_tensor() before forward")
            hidden_states = self.input_tensor
        if self.config.fp32_residual_connection:
            # The residual stream stays fp32 through the layers (and between pipeline stages).
            hidden_states = hidden_states.float()
        if self.config.recompute_granularity == "full" and self.training and inference_context is None:
            hidden_states = self._forward_with_full_recompute(hidden_states, attention_mask, rotary_pos_emb,
                                                              packed_seq_params)
        else:
            hidden_states = self._run_layers(0, len(self.layers), packed_seq_params)(
                hidden_states, attention_mask, rotary_pos_emb, inference_context)
        if self.final_layernorm is not None:
            if self.config.fp32_residual_connection:
                hidden_states = hidden_states.to(self.config.params_dtype)
            hidden_states = self.final_layernorm(hidden_states)
        elif not self.layers and not self.pre_process:
            # A middle stage without layers passes its input on, but not as the received tensor itself: the
            # schedules keep that for the backward, and release what they sent. A copy gives the backward a
            # node to pass the gradient through and shares no storage (one activation copied per microbatch).
            hidden_states = hidden_states.clone()
        return hidden_states
