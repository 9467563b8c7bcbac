"""`SharedExpertMLP`: the dense MLP every token goes through beside its routed experts (DeepSeek-style shared
experts), of width `--moe-shared-expert-intermediate-size` (the shared experts' total width). It is a plain
tensor-parallel `MLP` (dense parameters, reduced over DP x CP) whose output the MoE layer adds to the routed
experts' output."""

import dataclasses

from megatron.core.transformer.init_seeds import derive_init_seed
from megatron.core.transformer.mlp import MLP


class SharedExpertMLP(MLP):
    """Args: config (with `moe_shared_expert_intermediate_size` set); layer_init_seed: the owning layer's seed."""

    def __init__(self, config, layer_init_seed):
        shared_config = dataclasses.replace(config, ffn_hidden_size=config.moe_shared_expert_intermediate_size)
        super().__init__(shared_config, init_seed=derive_init_seed(layer_init_seed, "mlp.shared_experts"))
