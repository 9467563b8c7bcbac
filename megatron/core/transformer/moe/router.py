"""`TopKRouter`: which experts each token goes to, with what probability, and the router's auxiliary losses.

The router weight `[num_experts, hidden]` is a dense parameter replicated on every rank. Under sequence
parallelism each tensor-parallel rank routes its own tokens, so the weight is marked `sequence_parallel` and its
gradient is summed over the tensor-parallel group by `finalize_model_grads`, like the norms' weights. With
`--moe-router-bias` (gpt-oss) the logits are x W^T + b, b `[num_experts]` (`router.bias`, zeros at
initialisation) a parameter of the same kind; it enters the probabilities, unlike the expert bias below.

Aux-loss-free balancing (`--moe-router-enable-expert-bias`) keeps two buffers: `expert_bias` (saved with the
model) and `local_tokens_per_expert` (counts since the last update, not saved). `update_expert_biases`, called
once per optimizer step by the training loop, sums the counts over the stage's TP x DP x CP ranks and moves each
bias by rate * sign(mean count - count).

`global_aux_loss` balances over the whole global batch: the router keeps a running sum of its top-k counts,
all-reduced over the stage's TP x DP x CP ranks, and the number of microbatches so far; each microbatch's loss
uses the average count (sum / microbatches). The training loop starts them afresh for every global batch
(`reset_global_aux_loss_counts`). They are plain attributes, not saved with the model.

Switches: `--moe-input-jitter-eps` multiplies the router's input (not the experts') by uniform noise in training;
`--moe-router-force-load-balancing` routes by random normal logits (benchmarking; the gradient reaches the real
logits unchanged); `--moe-router-padding-for-fp8` pads each expert's token count with probability-0 tokens after
the expert-bias counts are taken. The random draws use the default generator, whose state activation recompute
restores, so a recomputed forward routes as the original did.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.core import parallel_state
from megatron.core.transformer.init_seeds import derive_init_seed, initialization_rng, resolve_base_init_seed
from megatron.core.transformer.moe import moe_utils
from megatron.core.transformer.moe.moe_config import aux_loss_terms, fp8_routing_pad_multiple
from megatron.core.transformer.moe.routing import (
    apply_capacity,
    expert_capacity,
    pad_routing_map,
    scores_for_aux_loss,
    topk_routing,
)
from megatron.core.transformer.recompute import is_recomputing
from megatron.core.transformer.utils import initialize_from_cpu_master, parameter_device

_ROUTER_DTYPES = {"fp32": torch.float32, "fp64": torch.float64}


class _RandomLogits(torch.autograd.Function):
    """Forward: standard normal logits of the same shape (`--moe-router-force-load-balancing`); backward: the
    gradient passes to the real logits unchanged (straight through), as upstream."""

    @staticmethod
    def forward(ctx, logits):
        return torch.randn(logits.shape, dtype=logits.dtype, device=logits.device)

    @staticmethod
    def backward(ctx, grad_output):
        return grad_output


def _group_size(group_getter):
    if not parallel_state.model_parallel_is_initialized():
        return None, 1
    group = group_getter()
    return group, dist.get_world_size(group)


class TopKRouter(torch.nn.Module):
    """Args: config; pg_collection (upstream's second argument): must be None, the groups come from
    `parallel_state`; layer_number: 1-based global layer index (for logging; `set_layer_number`); init_seed: seed
    of the layer's initial weights (the router draws from a seed derived from it)."""

    def __init__(self, config, pg_collection=None, *, layer_number=1, init_seed=None):
        super().__init__()
        if pg_collection is not None:
            raise ValueError("TopKRouter(pg_collection=...) is not supported: the process groups come from "
                             "parallel_state.initialize_model_parallel; drop pg_collection")
        self.config = config
        self.layer_number = layer_number  # where the aux losses are logged (`log_aux_losses_as_layer`)
        # Entries of the loss tracker: the decoder's layers, then the multi-token-prediction depths'.
        self.num_logged_layers = config.num_layers + (getattr(config, "mtp_num_layers", None) or 0)
        self.num_experts = config.num_moe_experts
        self.topk = config.moe_router_topk
        if init_seed is None:
            init_seed = resolve_base_init_seed(config)
        self.init_seed = derive_init_seed(init_seed, "mlp.router")
        self.weight = torch.nn.Parameter(torch.empty(self.num_experts, config.hidden_size, dtype=config.params_dtype,
                                                     device=parameter_device(config)))
        self.weight.sequence_parallel = config.sequence_parallel
        self.bias = None
        if config.moe_router_bias:
            self.bias = torch.nn.Parameter(torch.empty(self.num_experts, dtype=config.params_dtype,
                                                       device=self.weight.device))
            self.bias.sequence_parallel = config.sequence_parallel
        if config.moe_router_enable_expert_bias:
            device = self.weight.device
            self.register_buffer("expert_bias", torch.zeros(self.num_experts, dtype=torch.float32, device=device))
            self.register_buffer("local_tokens_per_expert",
                                 torch.zeros(self.num_experts, dtype=torch.float32, device=device), persistent=False)
        else:
            self.expert_bias = None
            self.local_tokens_per_expert = None
        self.reset_global_aux_loss_counts()
        self.reset_parameters()

    def reset_global_aux_loss_counts(self):
        """Forget the global batch's running counts of `global_aux_loss` (before each global batch)."""
        self.global_tokens_per_expert = None  # int64 [E], summed over TP x DP x CP and the microbatches so far
        self.global_aux_microbatches = 0
        # The average count each forward used, oldest first: a recomputed forward (activation recompute, run in
        # backward, after later microbatches' forwards under pipelining) takes its original's.
        self._global_aux_averages = []

    def reset_parameters(self):
        if self.config.perform_initialization:
            with initialization_rng(self.init_seed):
                initialize_from_cpu_master(self.weight, self.config.init_method)
        if self.bias is not None and not self.bias.is_meta:
            with torch.no_grad():
                self.bias.zero_()
        if self.expert_bias is not None and not self.expert_bias.is_meta:
            self.expert_bias.zero_()
            self.local_tokens_per_expert.zero_()

    def _apply(self, fn, recurse=True):
        """Module casts (`.to(torch.bfloat16)`, `.half()`, `Float16Module`) move the expert-bias buffers but keep
        them in fp32, as upstream: in bf16 an update of 1e-3 to a bias of 0.5 rounds away, and counts above 256
        lose whole tokens."""
        kept = {name: self._buffers[name] for name in ("expert_bias", "local_tokens_per_expert")
                if self._buffers.get(name) is not None}
        result = super()._apply(fn, recurse)
        for name, original in kept.items():
            moved = self._buffers[name]
            if moved.dtype != torch.float32:
                self._buffers[name] = original.to(device=moved.device)
        return result

    def set_layer_number(self, layer_number):
        """The 1-based global layer number under which the losses are logged (None: not logged)."""
        self.layer_number = layer_number

    @property
    def router_dtype(self):
        return _ROUTER_DTYPES.get(self.config.moe_router_dtype)

    def forward(self, hidden_states):
        """`[s, b, h]` -> (probs `[s*b, E]`, zero off the chosen experts, in the router dtype; routing_map
        `[s*b, E]` bool). In training the auxiliary losses ride on the returned tensors' backward."""
        if hidden_states.dim() != 3 or hidden_states.size(-1) != self.config.hidden_size:
            raise ValueError(f"MoE hidden_states must be [s, b, {self.config.hidden_size}] (--hidden-size), got "
                             f"{tuple(hidden_states.shape)}")
        seq_length, batch_size = hidden_states.shape[0], hidden_states.shape[1]
        tokens = hidden_states.reshape(-1, hidden_states.size(-1))
        training = self.training and torch.is_grad_enabled()
        eps = self.config.moe_input_jitter_eps
        router_input = tokens
        if eps is not None and training:
            router_input = tokens * torch.empty_like(tokens).uniform_(1.0 - eps, 1.0 + eps)
        logits = self.gating(router_input)
        if self.config.moe_router_force_load_balancing:
            logits = _RandomLogits.apply(logits)
        if training and self.config.moe_z_loss_coeff:
            logits = self._attach_z_loss(logits)
        config = self.config
        if config.moe_router_load_balancing_type == "sinkhorn":
            probs, routing_map = self._sinkhorn_routing(logits, training)
        else:
            probs, routing_map = topk_routing(
                logits, self.topk, score_function=config.moe_router_score_function,
                pre_softmax=config.moe_router_pre_softmax, scaling_factor=config.moe_router_topk_scaling_factor,
                num_groups=config.moe_router_num_groups, group_topk=config.moe_router_group_topk,
                expert_bias=self.expert_bias,
            )
            if config.moe_expert_capacity_factor is not None:
                capacity = expert_capacity(tokens.size(0), self.topk, self.num_experts,
                                           config.moe_expert_capacity_factor)
                probs, routing_map = apply_capacity(probs, routing_map, capacity, config.moe_token_drop_policy,
                                                    config.moe_pad_expert_input_to_capacity)
            terms = aux_loss_terms(config.moe_router_load_balancing_type, config.moe_aux_loss_coeff)
            if training and terms:
                probs = self._attach_load_balancing_losses(probs, logits, seq_length, batch_size, terms)
        if self.local_tokens_per_expert is not None and torch.is_grad_enabled() and not is_recomputing():
            with torch.no_grad():
                self.local_tokens_per_expert += routing_map.sum(dim=0).to(self.local_tokens_per_expert.dtype)
        if config.moe_router_padding_for_fp8:
            probs, routing_map = pad_routing_map(probs, routing_map, fp8_routing_pad_multiple(config))
        return probs, routing_map

    def gating(self, hidden_states):
        """The router logits x W^T (+ b), in the router dtype (`--moe-router-dtype`, else the input's), for input
        of any leading shape (upstream's method)."""
        dtype = self.router_dtype or hidden_states.dtype
        bias = None if self.bias is None else self.bias.to(dtype)
        return F.linear(hidden_states.to(dtype), self.weight.to(dtype), bias)

    def _sinkhorn_routing(self, logits, training):
        """Choose by Sinkhorn-balanced scores in training (by the activations in evaluation); the probabilities
        are the sigmoid (k = 1) or softmax of the logits at the chosen experts."""
        activation = torch.sigmoid(logits) if self.topk == 1 else torch.softmax(logits, dim=-1)
        with torch.no_grad():
            choice_scores = moe_utils.sinkhorn(logits.detach().float()) if training else activation
            indices = choice_scores.topk(self.topk, dim=-1).indices
        routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, indices, True)
        return activation * routing_map, routing_map

    def _attach_z_loss(self, logits):
        group, size = _group_size(parallel_state.get_tensor_and_context_parallel_group)
        coeff = self.config.moe_z_loss_coeff / size
        loss = moe_utils.z_loss(logits, coeff)
        # Each rank's z-loss of its own tokens, averaged over TP x CP for the log (as upstream).
        moe_utils.save_to_aux_losses_tracker("z_loss", loss / coeff, self.layer_number, self.num_logged_layers,
                                             avg_group=group if size > 1 else None,
                                             per_layer=self.config.moe_per_layer_logging)
        return moe_utils.MoEAuxLossAutoScaler.apply(logits, loss)

    def _attach_load_balancing_losses(self, probs, logits, seq_length, batch_size, terms):
        """Each (type, coefficient) of `terms` rides on `probs`' backward; all use the same normalised scores."""
        config = self.config
        scores, aux_map = scores_for_aux_loss(logits, self.topk, config.moe_router_score_function)
        for kind, coeff in terms:
            if kind == "aux_loss":
                loss = self._switch_loss(scores, aux_map, coeff)
            elif kind == "seq_aux_loss":
                loss = self._sequence_loss(scores, aux_map, seq_length, batch_size, coeff)
            else:
                loss = self._global_loss(scores, aux_map, coeff)
            # Each rank's loss is its share of the loss of the tokens its counts span: the log sums the shares
            # over that group (TP x CP; TP x DP x CP for the global batch's loss), as upstream.
            share_group = self._share_group(kind)
            moe_utils.save_to_aux_losses_tracker(moe_utils.AUX_LOSS_LOG_NAMES[kind], loss / coeff, self.layer_number,
                                                 self.num_logged_layers, reduce_group=share_group,
                                                 reduce_group_has_dp=kind == "global_aux_loss",
                                                 per_layer=config.moe_per_layer_logging)
            probs = moe_utils.MoEAuxLossAutoScaler.apply(probs, loss)
        return probs

    @staticmethod
    def _share_group(kind):
        """The group whose ranks' losses add up to `kind`'s loss (None: one rank holds all of it)."""
        if kind == "global_aux_loss":
            group, size = _group_size(
                lambda: parallel_state.get_tensor_and_data_parallel_group(with_context_parallel=True))
        else:
            group, size = _group_size(parallel_state.get_tensor_and_context_parallel_group)
        return group if size > 1 else None

    def _switch_loss(self, scores, aux_map, coeff):
        group, size = _group_size(parallel_state.get_tensor_and_context_parallel_group)
        counts = aux_map.sum(dim=0).to(scores.dtype)
        if size > 1:
            dist.all_reduce(counts, group=group)
        return moe_utils.switch_load_balancing_loss(scores, counts, scores.size(0) * size, self.topk, coeff)

    def _sequence_loss(self, scores, aux_map, seq_length, batch_size, coeff):
        group, size = _group_size(parallel_state.get_tensor_and_context_parallel_group)
        counts = aux_map.view(seq_length, batch_size, -1).sum(dim=0).to(scores.dtype)
        if size > 1:
            dist.all_reduce(counts, group=group)
        return moe_utils.sequence_load_balancing_loss(scores, counts, seq_length * size, self.topk, coeff)

    def _global_loss(self, scores, aux_map, coeff):
        """The switch loss with counts summed over TP x DP x CP and averaged over the global batch's microbatches
        so far; T = local tokens x the group's size."""
        group, size = _group_size(
            lambda: parallel_state.get_tensor_and_data_parallel_group(with_context_parallel=True))
        if is_recomputing():
            average = self._global_aux_averages.pop(0)
        else:
            counts = aux_map.sum(dim=0).to(torch.int64)
            if size > 1:
                dist.all_reduce(counts, group=group)
            if self.global_tokens_per_expert is None:
                self.global_tokens_per_expert = torch.zeros_like(counts)
            self.global_tokens_per_expert += counts
            self.global_aux_microbatches += 1
            average = self.global_tokens_per_expert.to(scores.dtype) / self.global_aux_microbatches
            self._global_aux_averages.append(average)
        return moe_utils.switch_load_balancing_loss(scores, average, scores.size(0) * size, self.topk, coeff)


def routers_of(model_chunks):
    return [module for chunk in model_chunks for module in chunk.modules() if isinstance(module, TopKRouter)]


def log_aux_losses_as_layer(module, layer_number):
    """Every router in `module` logs its auxiliary losses under the 1-based `layer_number`: a
    multi-token-prediction depth k's layer, built like the decoder's last layer, logs as layer num_layers + k."""
    for router in routers_of([module]):
        router.layer_number = layer_number


@torch.no_grad()
def update_expert_biases(model_chunks):
    """After a global batch: every router with an expert bias moves it by rate * sign(mean(c) - c), c its token
    counts summed over the batch's microbatches and the stage's TP x DP x CP ranks; the counts restart at 0.
    Collective over that group when any router has a bias (the same on every rank of a stage)."""
    routers = [router for router in routers_of(model_chunks) if router.expert_bias is not None]
    if not routers:
        return
    counts = torch.stack([router.local_tokens_per_expert for router in routers])
    group, size = _group_size(lambda: parallel_state.get_tensor_and_data_parallel_group(with_context_parallel=True))
    if size > 1:
        dist.all_reduce(counts, group=group)
    for router, router_counts in zip(routers, counts):
        rate = router.config.moe_router_bias_update_rate
        router.expert_bias += rate * torch.sign(router_counts.mean() - router_counts)
        router.local_tokens_per_expert.zero_()


def reset_global_aux_loss_counts(model_chunks):
    """Start every router's `global_aux_loss` counts afresh: once per global batch, before its first forward."""
    for router in routers_of(model_chunks):
        router.reset_global_aux_loss_counts()
