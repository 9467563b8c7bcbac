"""`SharedExpertMLP`: the dense MLP every token goes through beside its routed experts (DeepSeek-style shared
experts), of width `--moe-shared-expert-intermediate-size` (the shared experts' total width). It is a plain
tensor-parallel `MLP` (dense parameters, reduced over DP x CP) whose output the MoE layer adds to the routed
experts' output.

`--moe-shared-expert-gate` multiplies that output by sigmoid(x . w) per token, `gate_weight` w `[1, hidden]`. Like
the router weight, w is replicated on every rank; under sequence parallelism each tensor-parallel rank gates its
own tokens, so w is marked `sequence_parallel` and its gradient is summed over the tensor-parallel group.

Selective `--recompute-modules shared_experts` checkpoints the shared experts (gate included) in training.
"""

import dataclasses

import torch
import torch.nn.functional as F

from megatron.core.transformer.init_seeds import derive_init_seed, initialization_rng, resolve_base_init_seed
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.recompute import checkpointed
from megatron.core.transformer.utils import initialize_from_cpu_master, parameter_device


class SharedExpertMLP(MLP):
    """Args, in upstream's order: config (with `moe_shared_expert_intermediate_size` set); submodules: upstream's
    `MLPSubmodules` (the config picks the modules here; accepted and not read); gate: build the gate (None: as
    `moe_shared_expert_gate`); pg_collection: must be None (the groups come from `parallel_state`).
    layer_init_seed (keyword): the owning layer's init seed (None: the config's base seed, see `init_seeds`)."""

    def __init__(self, config, submodules=None, gate=None, pg_collection=None, *, layer_init_seed=None):
        if isinstance(submodules, int) and not isinstance(submodules, bool):
            raise TypeError("SharedExpertMLP(config, submodules, gate): pass the layer's init seed as the keyword "
                            "layer_init_seed")
        if pg_collection is not None:
            raise ValueError("SharedExpertMLP(pg_collection=...) is not supported: the process groups come from "
                             "parallel_state.initialize_model_parallel; drop pg_collection")
        if config.moe_shared_expert_intermediate_size is None:
            raise ValueError("SharedExpertMLP needs --moe-shared-expert-intermediate-size "
                             "(config.moe_shared_expert_intermediate_size), the shared experts' total width")
        if layer_init_seed is None:
            layer_init_seed = resolve_base_init_seed(config)
        shared_config = dataclasses.replace(config, ffn_hidden_size=config.moe_shared_expert_intermediate_size)
        super().__init__(shared_config, init_seed=derive_init_seed(layer_init_seed, "mlp.shared_experts"))
        self.gate_weight = None
        if config.moe_shared_expert_gate if gate is None else gate:
            self.gate_init_seed = derive_init_seed(layer_init_seed, "mlp.shared_experts.gate_weight")
            self.gate_weight = torch.nn.Parameter(torch.empty(1, config.hidden_size, dtype=config.params_dtype,
                                                              device=parameter_device(config)))
            self.gate_weight.sequence_parallel = config.sequence_parallel
            self.reset_parameters()

    def reset_parameters(self):
        """Draw the gate's weight (the linears draw their own)."""
        if self.gate_weight is not None and self.config.perform_initialization:
            with initialization_rng(self.gate_init_seed):
                initialize_from_cpu_master(self.gate_weight, self.config.init_method)

    def forward(self, hidden_states):
        """`[s, b, h]` (or its sequence-parallel slice) -> same shape, gated per token when configured."""
        if self.training and self.config.recomputes("shared_experts"):
            return checkpointed(self._gated_forward, hidden_states)
        return self._gated_forward(hidden_states)

    def _gated_forward(self, hidden_states):
        output, bias = super().forward(hidden_states)
        if bias is not None:
            output = output + bias
        if self.gate_weight is None:
            return output
        return output * torch.sigmoid(F.linear(hidden_states, self.gate_weight))
