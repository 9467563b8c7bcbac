"""The feed-forward block: column-parallel fc1, activation (plain or gated), row-parallel fc2.

For a gated MLP (swiglu) fc1 produces a gate and an up projection for each of the ffn units. Its output rows
are interleaved per unit, `[gate_0, up_0, gate_1, up_1, ...]`, so a contiguous slice of rows (what a
tensor-parallel rank holds) carries whole units with both their gate and their up rows. The full weight layout
is therefore the same at every TP size, shards are plain contiguous slices (partition_stride 1), and TP=2
reproduces TP=1 exactly from the same full initialisation.
"""

import torch

from megatron.core import tensor_parallel
from megatron.core.transformer.transformer_config import TransformerConfig


class MLP(torch.nn.Module):
    def __init__(self, config: TransformerConfig):
        super().__init__()
        self.config = config
        fc1_output_size = config.ffn_hidden_size * (2 if config.gated_linear_unit else 1)
        self.linear_fc1 = tensor_parallel.ColumnParallelLinear(
            config.hidden_size,
            fc1_output_size,
            config=config,
            init_method=config.init_method,
            bias=config.add_bias_linear,
            gather_output=False,
        )
        self.linear_fc2 = tensor_parallel.RowParallelLinear(
            config.ffn_hidden_size,
            config.hidden_size,
            config=config,
            init_method=config.output_layer_init_method,
            bias=config.add_bias_linear,
            input_is_parallel=True,
        )

    def forward(self, hidden_states):
        """`[s, b, h]` (or its sequence-parallel slice) -> same shape."""
        intermediate, _ = self.linear_fc1(hidden_states)
        if self.config.gated_linear_unit:
            units = intermediate.view(*intermediate.shape[:-1], -1, 2)
            gate, up = units[..., 0], units[..., 1]
            intermediate = self.config.activation_func(gate) * up
        else:
            intermediate = self.config.activation_func(intermediate)
        output, _ = self.linear_fc2(intermediate)
        return output
