"""`MoELayer`: the MLP block of a Mixture-of-Experts transformer layer (router, token dispatcher, this rank's
experts, optional shared experts). `[s, b, h]` in; out, as upstream, `(output [s, b, h], mlp_bias)` with
`mlp_bias` None (the experts' biases are inside the output).

At `--tensor-model-parallel-size` > 1 the layer trains only under `--sequence-parallel` (each TP rank routes its
own share of the tokens); without it (generation, in eval mode) every TP rank routes all the tokens, and the
dispatchers treat each rank's copy as tokens of its own, so every rank gets the whole output.

`--moe-apply-probs-on-input` (top-1) scales each token by its routing probability before dispatch and combines
the experts' outputs with weight 1; `--moe-layer-recompute` (or selective `--recompute-modules moe`) checkpoints
the whole layer (its collectives run again in backward).

`--moe-latent-size` (latent MoE, Nemotron-3): the router reads the full hidden state; the tokens are projected
down by `fc1_latent_proj` (hidden -> latent) before dispatch, so the token exchange carries latent-width tokens and
the experts work in the latent width; the combined output is projected back by `fc2_latent_proj` (latent ->
hidden). The shared experts read the full hidden state and add to the result. With `--moe-apply-probs-on-input`
the projected tokens are scaled.
"""

import torch

from megatron.core import parallel_state
from megatron.core.transformer.recompute import checkpointed
from megatron.core.transformer.init_seeds import resolve_base_init_seed
from megatron.core.transformer.moe.experts import build_experts
from megatron.core.transformer.moe.latent_projection import LatentProjection
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.shared_experts import SharedExpertMLP
from megatron.core.transformer.moe.token_dispatcher import build_token_dispatcher


class MoELayer(torch.nn.Module):
    """Args, in upstream's order: config (a `TransformerConfig` with `num_moe_experts`); submodules: upstream's
    `MLPSubmodules` of the experts (the config picks the modules here, see `spec_utils`; accepted and not read);
    layer_number: 1-based global layer index under which the router logs its losses (None: not logged, as
    upstream); pg_collection: must be None (the groups come from `parallel_state`); init_seed: the owning layer's
    init seed (see `init_seeds`)."""

    def __init__(self, config, submodules=None, layer_number=1, pg_collection=None, init_seed=None):
        super().__init__()
        if config.num_moe_experts is None:
            raise ValueError("MoELayer needs --num-experts")
        if pg_collection is not None:
            raise ValueError("MoELayer(pg_collection=...) is not supported: the process groups come from "
                             "parallel_state.initialize_model_parallel; drop pg_collection")
        self.config = config
        self.layer_number = layer_number
        if init_seed is None:
            init_seed = resolve_base_init_seed(config)
        initialized = parallel_state.model_parallel_is_initialized()
        ep_size = parallel_state.get_expert_model_parallel_world_size() if initialized else 1
        if ep_size != config.expert_model_parallel_size:
            raise ValueError(f"--expert-model-parallel-size is {config.expert_model_parallel_size} in the config but "
                             f"the expert-parallel group has {ep_size} ranks; initialise model parallel with it")
        ep_rank = parallel_state.get_expert_model_parallel_rank() if initialized else 0
        self.num_local_experts = config.num_moe_experts // ep_size
        first = ep_rank * self.num_local_experts
        self.local_expert_indices = list(range(first, first + self.num_local_experts))
        self.router = TopKRouter(config, layer_number=layer_number, init_seed=init_seed)
        self.fc1_latent_proj = self.fc2_latent_proj = None
        if config.moe_latent_size is not None:
            hidden, latent = config.hidden_size, config.moe_latent_size
            self.fc1_latent_proj = LatentProjection(config, hidden, latent, init_method=config.init_method,
                                                    init_seed=init_seed, name="fc1_latent_proj")
            self.fc2_latent_proj = LatentProjection(config, latent, hidden,
                                                    init_method=config.output_layer_init_method,
                                                    init_seed=init_seed, name="fc2_latent_proj")
        self.experts = build_experts(config, init_seed, self.num_local_experts, first)
        self.token_dispatcher = build_token_dispatcher(config, self.num_local_experts, self.local_expert_indices)
        self.shared_experts = None
        if config.moe_shared_expert_intermediate_size is not None:
            self.shared_experts = SharedExpertMLP(config, layer_init_seed=init_seed)

    def set_layer_number(self, layer_number):
        """The 1-based global layer number under which the router logs its losses (upstream's method)."""
        self.layer_number = layer_number
        self.router.set_layer_number(layer_number)

    def forward(self, hidden_states):
        if self.training and self.config.tensor_model_parallel_size > 1 and not self.config.sequence_parallel:
            # As upstream: training refuses it; generation (eval mode) runs it, every TP rank routing all tokens.
            raise ValueError(
                f"training MoE layers at --tensor-model-parallel-size {self.config.tensor_model_parallel_size} "
                "needs --sequence-parallel (each tensor-parallel rank then routes its own share of the tokens "
                "instead of all of them); add --sequence-parallel, or set the model to eval mode to generate")
        if (self.config.moe_layer_recompute or self.config.recomputes("moe")) and self.training:
            return checkpointed(self._forward, hidden_states), None
        return self._forward(hidden_states), None

    def _forward(self, hidden_states):
        probs, routing_map = self.router(hidden_states)
        expert_input = hidden_states
        if self.fc1_latent_proj is not None:
            expert_input = self.fc1_latent_proj(hidden_states)
        if self.config.moe_apply_probs_on_input:
            # Top-1: a token's row of probs holds its one expert's probability (0 if it was dropped).
            token_probs = probs.sum(dim=-1, keepdim=True)
            expert_input = (expert_input.reshape(token_probs.size(0), -1) * token_probs).to(expert_input.dtype)
            expert_input = expert_input.view(*hidden_states.shape[:-1], -1)
            # Weight 1 where routed; 0 on padding (capacity or FP8 padding), whose probability is 0.
            probs = (probs != 0).to(probs.dtype)
        shared_output = None
        if self.shared_experts is not None and self.config.moe_shared_expert_overlap:
            # Computed while the tokens are exchanged (see the all-to-all dispatcher).
            tokens, tokens_per_expert = self.token_dispatcher.dispatch(
                expert_input, probs, routing_map, while_tokens_travel=lambda: self.shared_experts(hidden_states))
            shared_output = self.token_dispatcher.overlapped_result
        else:
            tokens, tokens_per_expert = self.token_dispatcher.dispatch(expert_input, probs, routing_map)
            if self.shared_experts is not None:
                shared_output = self.shared_experts(hidden_states)
        output = self.token_dispatcher.combine(self.experts(tokens, tokens_per_expert))
        if self.fc2_latent_proj is not None:
            output = self.fc2_latent_proj(output)
        if shared_output is not None:
            output = output + shared_output
        return output
