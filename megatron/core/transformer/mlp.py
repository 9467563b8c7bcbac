"""The feed-forward block: column-parallel fc1, activation (plain or gated), row-parallel fc2.

For a gated MLP (swiglu, quick geglu) fc1 produces a gate and an up projection for each of the ffn units. Its
output rows are interleaved per unit, `[gate_0, up_0, gate_1, up_1, ...]`, so a contiguous slice of rows (what a
tensor-parallel rank holds) carries whole units with both their gate and their up rows. The full weight layout
is therefore the same at every TP size, shards are plain contiguous slices (partition_stride 1), and TP=2
reproduces TP=1 exactly from the same full initialisation.
"""

import torch

from megatron.core.activations import gated_linear_unit
from megatron.core.extensions.transformer_engine import fused_norm_linear_class, layer_classes
from megatron.core.transformer.init_seeds import build_with_init_seed, derive_init_seed, resolve_base_init_seed
from megatron.core.transformer.transformer_config import TransformerConfig


class MLP(torch.nn.Module):
    """Args: config; init_seed: seed of the owning layer's initial weights (see `init_seeds`), None derives one
    from `config.init_seed`; fused_input_norm: the owning layer's pre-MLP norm when fc1 applies it (Transformer
    Engine's fused LayerNorm-linear), None when the layer applies it; is_expert: an expert of a MoE layer (its
    parameters are reduced over the expert data-parallel group, `allreduce = False`)."""

    def __init__(self, config: TransformerConfig, init_seed=None, fused_input_norm=None, is_expert=False):
        super().__init__()
        self.config = config
        if init_seed is None:
            init_seed = derive_init_seed(resolve_base_init_seed(config), "mlp")
        fc1_output_size = config.ffn_hidden_size * (2 if config.gated_linear_unit else 1)
        column_parallel_linear, row_parallel_linear = layer_classes(config)
        fc1_class, fc1_kwargs = column_parallel_linear, {}
        if fused_input_norm is not None:
            fc1_class, fc1_kwargs = fused_norm_linear_class(config), {"norm": fused_input_norm}
        self.linear_fc1 = build_with_init_seed(
            derive_init_seed(init_seed, "mlp.linear_fc1"),
            lambda: fc1_class(
                config.hidden_size,
                fc1_output_size,
                config=config,
                init_method=config.init_method,
                bias=config.add_bias_linear,
                gather_output=False,
                is_expert=is_expert,
                **fc1_kwargs,
            ),
        )
        self.linear_fc2 = build_with_init_seed(
            derive_init_seed(init_seed, "mlp.linear_fc2"),
            lambda: row_parallel_linear(
                config.ffn_hidden_size,
                config.hidden_size,
                config=config,
                init_method=config.output_layer_init_method,
                bias=config.add_bias_linear,
                input_is_parallel=True,
                is_expert=is_expert,
            ),
        )

    def forward(self, hidden_states):
        """`[s, b, h]` (or its sequence-parallel slice) -> same shape."""
        intermediate, _ = self.linear_fc1(hidden_states)
        if self.config.gated_linear_unit:
            intermediate = gated_linear_unit(self.config, intermediate)
        else:
            intermediate = self.config.activation_func(intermediate)
        output, _ = self.linear_fc2(intermediate)
        return output
