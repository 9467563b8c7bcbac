"""The one-linear stand-ins of a heterogeneous layer's attention or MLP (`replace_with_linear`).

Each is a hidden x hidden linear applied to the normalised input, per token, the result added to the residual
like the sublayer it replaces. The weight is duplicated on every tensor-parallel rank (`DuplicatedLinear`: with
sequence parallelism each rank projects its own tokens and the weight's gradient is all-reduced over the
tensor-parallel group), so the layer needs no communication and its parameter is the same at every TP size.
Its initial weights follow the output projections' (`output_layer_init_method`): it writes into the residual.
"""

import torch

from megatron.core.tensor_parallel.duplicated_linear import DuplicatedLinear
from megatron.core.transformer.init_seeds import build_with_init_seed, derive_init_seed


def _hidden_linear(config, init_seed, name):
    return build_with_init_seed(derive_init_seed(init_seed, name), lambda: DuplicatedLinear(
        config.hidden_size, config.hidden_size, config=config, init_method=config.output_layer_init_method,
        bias=config.add_bias_linear))


class LinearReplacedAttention(torch.nn.Module):
    """`self_attention.linear_attn`: takes the attention's inputs and returns `(output, None)` like it; the
    mask, rotary angles, decoding context and packing do not change a per-token linear."""

    def __init__(self, config, *, init_seed):
        super().__init__()
        self.config = config
        self.linear_attn = _hidden_linear(config, init_seed, "self_attention.linear_attn")

    def forward(self, hidden_states, attention_mask=None, rotary_pos_emb=None, inference_context=None,
                packed_seq_params=None):
        output, _ = self.linear_attn(hidden_states)
        return output, None


class LinearReplacedMLP(torch.nn.Module):
    """`mlp.linear_mlp`: `[s, b, h]` -> `(output, None)` like `MLP`."""

    def __init__(self, config, *, init_seed):
        super().__init__()
        self.config = config
        self.linear_mlp = _hidden_linear(config, init_seed, "mlp.linear_mlp")

    def forward(self, hidden_states):
        output, _ = self.linear_mlp(hidden_states)
        return output, None
