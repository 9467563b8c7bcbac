"""A Mamba layer of a hybrid model: x + drop(mixer(norm(x))), upstream's `MambaLayer` (parameters `norm.weight`
and `mixer.*`). It takes the transformer layers' forward arguments so that a block runs both kinds alike; the
attention inputs (mask, rotary angles) do not apply to it, packed sequences each scan on their own, and decoding
continues each batch row from the state a `StaticInferenceContext` keeps."""

import torch

from megatron.core.ssm.mamba_mixer import MambaMixer
from megatron.core.transformer.init_seeds import reset_children_parameters, resolve_base_init_seed
from megatron.core.transformer.norms import build_norm
from megatron.core.transformer.utils import residual_dropout


class MambaLayer(torch.nn.Module):
    """Args: config, layer_number (1-based, global), base_init_seed (keyword; None: `config.init_seed`). The
    layer's initial weights depend only on the base seed and its number, as a transformer layer's."""

    def __init__(self, config, layer_number: int = 1, *, base_init_seed=None):
        from megatron.core.transformer.transformer_layer import layer_init_seed

        super().__init__()
        self.config = config
        self.layer_number = layer_number
        if base_init_seed is None:
            base_init_seed = resolve_base_init_seed(config)
        self.init_seed = layer_init_seed(base_init_seed, layer_number)
        self.norm = build_norm(config, config.hidden_size)
        self.mixer = MambaMixer(config, layer_number, self.init_seed)
        self.hidden_dropout = torch.nn.Dropout(config.hidden_dropout)

    def reset_parameters(self):
        """Redraw this layer's initial weights; the same values as at construction."""
        reset_children_parameters(self)

    def forward(self, hidden_states, attention_mask=None, rotary_pos_emb=None, inference_context=None,
                packed_seq_params=None, **unused):
        """`[s, b, h]` -> (`[s, b, h]`, None), as `TransformerLayer.forward` (`inference_params` is the context's
        older name)."""
        inference_context = inference_context if inference_context is not None else unused.get("inference_params")
        residual = hidden_states
        if self.config.fp32_residual_connection:
            hidden_states = hidden_states.to(self.config.params_dtype)
            residual = residual.float()
        output, _ = self.mixer(self.norm(hidden_states), packed_seq_params=packed_seq_params,
                               inference_context=inference_context)
        return residual + residual_dropout(self.hidden_dropout, output, self.config.sequence_parallel), None
