"""The feed-forward block: column-parallel fc1, activation (plain or gated), row-parallel fc2.

For a gated MLP (swiglu, quick geglu) fc1 produces a gate and an up projection for each of the ffn units. Its
output rows are interleaved per unit, `[gate_0, up_0, gate_1, up_1, ...]`, so a contiguous slice of rows (what a
tensor-parallel rank holds) carries whole units with both their gate and their up rows. The full weight layout
is therefore the same at every TP size, shards are plain contiguous slices (partition_stride 1), and TP=2
reproduces TP=1 exactly from the same full initialisation.

As upstream, `forward` returns `(output, output_bias)`: fc2 skips its bias add, and the owning layer adds the bias
with the residual dropout (`output_bias` is None without `add_bias_linear`).
"""

import torch

from megatron.core.activations import gated_linear_unit
from megatron.core.extensions.transformer_engine import fused_norm_linear_class, layer_classes
from megatron.core.transformer.init_seeds import build_with_init_seed, derive_init_seed, resolve_base_init_seed
from megatron.core.transformer.transformer_config import TransformerConfig


def _check_upstream_mlp_arguments(submodules, tp_group):
    if isinstance(submodules, int) and not isinstance(submodules, bool):
        raise TypeError(f"MLP(config, {submodules}): the second argument is upstream's submodules; pass the seed by "
                        f"keyword (init_seed={submodules})")
    if tp_group is not None:
        raise ValueError("MLP(tp_group=...) is not supported: the tensor-parallel group comes from parallel_state "
                         "(initialize_model_parallel); pass tp_group=None")


class MLP(torch.nn.Module):
    """Args (upstream's order): config; submodules: upstream's `MLPSubmodules` (the config picks the linears here;
    accepted and not read); is_expert: an expert of a MoE layer (its parameters are reduced over the expert
    data-parallel group, `allreduce = False`); input_size: fc1's input width (None: `config.hidden_size`; fc2
    always returns `config.hidden_size`); ffn_hidden_size: the intermediate width (None: `config.ffn_hidden_size`);
    tp_group: must be None (the groups come from `parallel_state`). Keyword-only: init_seed, the seed of the
    owning layer's initial weights (see `init_seeds`; None derives one from `config.init_seed`); fused_input_norm:
    the owning layer's pre-MLP norm when fc1 applies it (Transformer Engine's fused LayerNorm-linear), None when
    the layer applies it."""

    def __init__(self, config: TransformerConfig, submodules=None, is_expert=False, input_size=None,
                 ffn_hidden_size=None, tp_group=None, *, init_seed=None, fused_input_norm=None):
        super().__init__()
        _check_upstream_mlp_arguments(submodules, tp_group)
        self.config = config
        if init_seed is None:
            init_seed = derive_init_seed(resolve_base_init_seed(config), "mlp")
        input_size = config.hidden_size if input_size is None else input_size
        ffn_hidden_size = config.ffn_hidden_size if ffn_hidden_size is None else ffn_hidden_size
        fc1_output_size = ffn_hidden_size * (2 if config.gated_linear_unit else 1)
        column_parallel_linear, row_parallel_linear = layer_classes(config)
        fc1_class, fc1_kwargs = column_parallel_linear, {}
        if fused_input_norm is not None:
            fc1_class, fc1_kwargs = fused_norm_linear_class(config), {"norm": fused_input_norm}
        self.linear_fc1 = build_with_init_seed(
            derive_init_seed(init_seed, "mlp.linear_fc1"),
            lambda: fc1_class(
                input_size,
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
                ffn_hidden_size,
                config.hidden_size,
                config=config,
                init_method=config.output_layer_init_method,
                bias=config.add_bias_linear,
                input_is_parallel=True,
                skip_bias_add=config.add_bias_linear,  # returned for the layer to add; asked only when there is one
                is_expert=is_expert,
            ),
        )

    def forward(self, hidden_states):
        """`[s, b, h]` (or its sequence-parallel slice) -> `(output, output_bias)`: the output has the input's
        shape; `output_bias` `[h]` is fc2's bias, not yet added (None without `add_bias_linear`)."""
        intermediate, _ = self.linear_fc1(hidden_states)
        if self.config.gated_linear_unit:
            intermediate = gated_linear_unit(self.config, intermediate)
        else:
            intermediate = self.config.activation_func(intermediate)
        return self.linear_fc2(intermediate)
