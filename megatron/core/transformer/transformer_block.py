"""The layers one pipeline stage owns, plus the final norm on the last stage.

Stage p of P holds global layers p * L/P + 1 .. (p + 1) * L/P (1-based `layer_number`); inside the module they
are `layers.0 .. layers.{L/P - 1}`. With an interleaved pipeline each model chunk is one virtual stage and holds
L/(P*v) consecutive layers (see `pipeline_stage_layer_range`). A stage that is not first takes its input from
`set_input_tensor` (what the previous stage sent) instead of the `hidden_states` argument.
"""

import contextlib
from typing import Optional

import torch

from megatron.core import parallel_state
from megatron.core.fp8_utils import get_fp8_context
from megatron.core.transformer.init_seeds import resolve_base_init_seed
from megatron.core.transformer.norms import build_norm
from megatron.core.transformer.recompute import checkpointed
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import TransformerLayer


def pipeline_stage_layer_range(config: TransformerConfig, vp_stage: Optional[int] = None):
    """(offset, count): the 0-based index of this stage's first layer and how many layers it holds.

    With `v` virtual stages per pipeline rank (`config.virtual_pipeline_model_parallel_size`), model chunk `c`
    of pipeline rank `r` is virtual stage `c * p + r` and starts at layer `c * L / v + r * L / (p * v)`; the chunk
    is `vp_stage`, else the virtual pipeline rank being built (`set_virtual_pipeline_model_parallel_rank`).
    """
    pp_size = parallel_state.get_pipeline_model_parallel_world_size()
    if pp_size != config.pipeline_model_parallel_size:
        raise ValueError(
            f"--pipeline-model-parallel-size in the config ({config.pipeline_model_parallel_size}) differs from "
            f"the initialised pipeline group size ({pp_size}); build the config with the same size"
        )
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    num_chunks = getattr(config, "virtual_pipeline_model_parallel_size", None) or 1
    if num_chunks == 1:
        layers_per_stage = config.num_layers // pp_size
        return pp_rank * layers_per_stage, layers_per_stage
    if vp_stage is None:
        vp_stage = parallel_state.get_virtual_pipeline_model_parallel_rank()
    if vp_stage is None or not 0 <= vp_stage < num_chunks:
        raise ValueError(
            f"a model chunk of an interleaved pipeline ({num_chunks} virtual stages per pipeline rank) needs its "
            f"chunk index: pass vp_stage or set_virtual_pipeline_model_parallel_rank() (got {vp_stage!r})"
        )
    layers_per_chunk = config.num_layers // (pp_size * num_chunks)
    return vp_stage * (config.num_layers // num_chunks) + pp_rank * layers_per_chunk, layers_per_chunk


class TransformerBlock(torch.nn.Module):
    """Args: config; pre_process: this stage is first (takes `hidden_states` from the embedding);
    post_process: this stage is last (applies the final norm); base_init_seed: the model's base init seed
    (None: `config.init_seed`, else the default generator's seed). Each layer's initial weights depend only on
    it and the layer's global number, so a stage's layers equal the same layers of a single-stage model."""

    def __init__(
        self, config: TransformerConfig, pre_process: bool = True, post_process: bool = True, base_init_seed=None,
        vp_stage: Optional[int] = None,
    ):
        super().__init__()
        self.config = config
        self.pre_process = pre_process
        self.post_process = post_process
        self.layer_offset, num_local_layers = pipeline_stage_layer_range(config, vp_stage)
        if base_init_seed is None:
            base_init_seed = resolve_base_init_seed(config)
        self.layers = torch.nn.ModuleList(
            TransformerLayer(config, layer_number=self.layer_offset + index + 1, base_init_seed=base_init_seed)
            for index in range(num_local_layers)
        )
        self.final_layernorm = build_norm(config, config.hidden_size) if post_process else None
        self.input_tensor: Optional[torch.Tensor] = None
        self.activation_offloader = None  # built at the first forward with --cpu-offloading

    def set_input_tensor(self, input_tensor: Optional[torch.Tensor]):
        """The activation received from the previous pipeline stage (`[s, b, h]`), used instead of the argument."""
        self.input_tensor = input_tensor

    def _run_layers(self, start, end):
        def run(hidden_states, attention_mask, rotary_pos_emb):
            for index in range(start, end):
                layer = self.layers[index]
                with get_fp8_context(self.config, layer.layer_number - 1), self._activation_offload(index, layer):
                    hidden_states = layer(hidden_states, attention_mask=attention_mask, rotary_pos_emb=rotary_pos_emb)
            return hidden_states

        return run

    def _activation_offload(self, index, layer):
        """Saved-tensor hooks moving the activations of the first `cpu_offloading_num_layers` local layers to
        host memory (`--cpu-offloading`); a no-op context for the others and in evaluation."""
        if not (self.config.cpu_offloading and index < self.config.cpu_offloading_num_layers
                and torch.is_grad_enabled()):
            return contextlib.nullcontext()
        if self.activation_offloader is None:
            from megatron.core.offloading.activations import ActivationOffloader

            self.activation_offloader = ActivationOffloader()
        return self.activation_offloader.hooks(layer.layer_number)

    def _forward_with_full_recompute(self, hidden_states, attention_mask, rotary_pos_emb):
        num_layers = len(self.layers)
        chunk = self.config.recompute_num_layers
        if self.config.recompute_method == "uniform":
            for start in range(0, num_layers, chunk):
                run_chunk = self._run_layers(start, min(start + chunk, num_layers))
                hidden_states = checkpointed(run_chunk, hidden_states, attention_mask, rotary_pos_emb)
            return hidden_states
        # "block": recompute the first `chunk` layers of this stage, keep the activations of the rest.
        for index in range(num_layers):
            run_layer = self._run_layers(index, index + 1)
            if index < chunk:
                hidden_states = checkpointed(run_layer, hidden_states, attention_mask, rotary_pos_emb)
            else:
                hidden_states = run_layer(hidden_states, attention_mask, rotary_pos_emb)
        return hidden_states

    def forward(self, hidden_states, attention_mask=None, rotary_pos_emb=None):
        """`[s, b, h]` (`[s / tp, b, h]` with sequence parallelism) -> same shape."""
        if not self.pre_process:
            if self.input_tensor is None:
                raise RuntimeError("a pipeline stage that is not first needs set_input_tensor() before forward")
            hidden_states = self.input_tensor
        if self.config.recompute_granularity == "full" and self.training:
            hidden_states = self._forward_with_full_recompute(hidden_states, attention_mask, rotary_pos_emb)
        else:
            hidden_states = self._run_layers(0, len(self.layers))(hidden_states, attention_mask, rotary_pos_emb)
        if self.final_layernorm is not None:
            hidden_states = self.final_layernorm(hidden_states)
        return hidden_states
