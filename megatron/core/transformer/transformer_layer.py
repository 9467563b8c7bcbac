"""One pre-norm transformer layer: x + drop(attn(norm(x))), then x + drop(mlp(norm(x)))."""

import torch

from megatron.core import tensor_parallel
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.norms import build_norm
from megatron.core.transformer.transformer_config import TransformerConfig


class TransformerLayer(torch.nn.Module):
    """Args: config; layer_number: 1-based index of this layer in the whole model."""

    def __init__(self, config: TransformerConfig, layer_number: int):
        super().__init__()
        self.config = config
        self.layer_number = layer_number
        self.input_layernorm = build_norm(config, config.hidden_size)
        self.self_attention = SelfAttention(config, layer_number)
        self.pre_mlp_layernorm = build_norm(config, config.hidden_size)
        self.mlp = MLP(config)
        self.hidden_dropout = torch.nn.Dropout(config.hidden_dropout)

    def _dropout(self, x):
        if self.config.sequence_parallel:
            # Sequence-parallel ranks hold different tokens: each needs its own mask.
            with tensor_parallel.get_cuda_rng_tracker().fork():
                return self.hidden_dropout(x)
        return self.hidden_dropout(x)

    def forward(self, hidden_states, attention_mask=None, rotary_pos_emb=None):
        attention_output = self.self_attention(
            self.input_layernorm(hidden_states), attention_mask=attention_mask, rotary_pos_emb=rotary_pos_emb
        )
        hidden_states = hidden_states + self._dropout(attention_output)
        mlp_output = self.mlp(self.pre_mlp_layernorm(hidden_states))
        return hidden_states + self._dropout(mlp_output)
