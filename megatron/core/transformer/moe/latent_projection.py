"""`LatentProjection`: the two projections of latent MoE (`--moe-latent-size`), `fc1_latent_proj` (hidden ->
latent, before the tokens are dispatched) and `fc2_latent_proj` (latent -> hidden, after they are combined).

Each is a plain `x W^T (+ b)` whose weight `[out, in]` (and bias, with `--add-bias-linear`) is replicated on every
rank, like the router's: under sequence parallelism each tensor-parallel rank projects its own tokens, so the
parameters are marked `sequence_parallel` and their gradients summed over the tensor-parallel group. They are dense
parameters (reduced over DP x CP), not expert parameters. The weight is drawn under a seed derived from the
layer's seed and the projection's name alone, so it does not depend on the parallel layout; the bias starts at
zero. The projections compute in the parameters' dtype, also inside an FP8 region (like the router; only the
experts' GEMMs run in FP8).
"""

import torch
import torch.nn.functional as F

from megatron.core.transformer.init_seeds import derive_init_seed, initialization_rng
from megatron.core.transformer.utils import initialize_from_cpu_master, parameter_device


class LatentProjection(torch.nn.Module):
    """Args: config (with `moe_latent_size`); input_size, output_size: the widths; init_method: draws the weight;
    init_seed: the owning layer's seed; name: the module's name in the layer (`fc1_latent_proj` or
    `fc2_latent_proj`), part of its seed."""

    def __init__(self, config, input_size, output_size, *, init_method, init_seed, name):
        super().__init__()
        self.config = config
        self.init_method = init_method
        self.init_seed = derive_init_seed(init_seed, f"mlp.{name}")
        device = parameter_device(config)
        self.weight = torch.nn.Parameter(torch.empty(output_size, input_size, dtype=config.params_dtype,
                                                     device=device))
        self.weight.sequence_parallel = config.sequence_parallel
        self.bias = None
        if config.add_bias_linear:
            self.bias = torch.nn.Parameter(torch.empty(output_size, dtype=config.params_dtype, device=device))
            self.bias.sequence_parallel = config.sequence_parallel
        self.reset_parameters()

    def reset_parameters(self):
        if self.config.perform_initialization:
            with initialization_rng(self.init_seed):
                initialize_from_cpu_master(self.weight, self.init_method)
        if self.bias is not None and not self.bias.is_meta:
            with torch.no_grad():
                self.bias.zero_()

    def forward(self, hidden_states):
        """`[..., input_size]` -> `[..., output_size]`."""
        return F.linear(hidden_states, self.weight, self.bias)

    def extra_repr(self):
        return f"in={self.weight.shape[1]}, out={self.weight.shape[0]}, bias={self.bias is not None}"
