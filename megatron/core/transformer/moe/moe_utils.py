"""Auxiliary losses of the MoE router, how they reach the backward pass, and the tracker that logs them.

The losses are not added to the language-model loss. Each is attached to an activation of the router by
`MoEAuxLossAutoScaler`: the forward returns the activation unchanged, and the backward adds
`backward_scale * d(loss)/d(inputs)` to the gradient flowing through that activation. The schedule sets
`backward_scale` so the auxiliary gradient is scaled like the language-model loss's (loss scale x CP / number of
microbatches, or the loss scale alone for a per-token loss, see `set_aux_loss_backward_scale`).
"""

import math

import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.device_utils import get_current_device
from megatron.core.transformer.moe.moe_config import aux_loss_terms, layer_pattern_from_freq
from megatron.core.transformer.moe.routing import apply_capacity, expert_capacity, scores_for_aux_loss, topk_routing
from megatron.core.transformer.recompute import is_recomputing


class MoEAuxLossAutoScaler(torch.autograd.Function):
    """`apply(activation, aux_loss)` -> activation; backward gives `aux_loss` the gradient `backward_scale`."""

    backward_scale = None  # a tensor; None means 1

    @staticmethod
    def forward(ctx, activation, aux_loss):
        ctx.save_for_backward(aux_loss)
        return activation

    @staticmethod
    def backward(ctx, grad_output):
        (aux_loss,) = ctx.saved_tensors
        scale = MoEAuxLossAutoScaler.backward_scale
        grad_aux = torch.ones_like(aux_loss) if scale is None else scale.to(aux_loss).expand_as(aux_loss).clone()
        return grad_output, grad_aux

    @staticmethod
    def set_loss_scale(scale):
        MoEAuxLossAutoScaler.backward_scale = torch.as_tensor(scale, dtype=torch.float32).detach().reshape(())


def set_aux_loss_backward_scale(config, num_microbatches):
    """Called by the schedule before each microbatch: the auxiliary losses' gradient scale equals the language
    model loss's: the fp16/bf16 loss scale, times the context-parallel size (gradients are averaged over DP x CP)
    and divided by the microbatches. A per-token loss keeps the loss scale alone: its gradients are summed over
    DP x CP and divided by the global token count, and each CP rank's auxiliary loss is its share of the whole
    sequence's. No-op for a model without experts."""
    if getattr(config, "num_moe_experts", None) is None:
        return
    grad_scale_func = getattr(config, "grad_scale_func", None)
    if grad_scale_func is not None:
        scale = float(grad_scale_func(torch.ones(1, device=get_current_device())).item())
    else:
        scale = 1.0
    if not getattr(config, "calculate_per_token_loss", False):
        scale = scale * getattr(config, "context_parallel_size", 1) / num_microbatches
    MoEAuxLossAutoScaler.set_loss_scale(scale)


# -------------------------------------------------------------------------------------------------------------
# The losses (pure functions of local tensors; the token counts come already reduced where they must be)
# -------------------------------------------------------------------------------------------------------------


def switch_load_balancing_loss(scores, tokens_per_expert, total_num_tokens, topk, coeff):
    """`aux_loss`: coeff * E / (k * T^2) * sum_i c_i * sum_x s_{x,i}.

    `scores` [tokens, E] are the local tokens' normalised scores over all experts, `tokens_per_expert` [E] the
    top-k counts c_i over every token of the sequence group, `total_num_tokens` T that group's token count."""
    return switch_load_balancing_loss_func(scores, tokens_per_expert, total_num_tokens, topk, scores.size(-1), coeff)


def sequence_load_balancing_loss(scores, per_sequence_counts, full_seq_length, topk, coeff):
    """`seq_aux_loss`: the switch loss of every sequence (T = its full length), averaged over the batch.

    `scores` [local tokens, E] in `[s, b]` order (this rank's positions of every sequence), `per_sequence_counts`
    [b, E] the top-k counts over each whole sequence."""
    batch_size, num_experts = per_sequence_counts.shape
    per_sequence_scores = scores.view(-1, batch_size, num_experts).sum(dim=0)
    weight = num_experts * coeff / (topk * float(full_seq_length) ** 2)
    return (per_sequence_counts.to(scores.dtype) * per_sequence_scores).sum(dim=-1).mean() * weight


def z_loss(logits, coeff):
    """coeff * mean_x logsumexp(logits_x)^2 (router z-loss, ST-MoE)."""
    return torch.mean(torch.square(torch.logsumexp(logits, dim=-1))) * coeff


def sinkhorn(cost, tol=1e-4, max_iterations=1000):
    """Sinkhorn balancing of exp(cost) [tokens, E]: rows and columns rescaled until the column scaling moves by
    at most `tol` (mean absolute change; upstream's argument name)."""
    cost = torch.exp(cost)
    row_scale = torch.ones(cost.size(0), dtype=cost.dtype, device=cost.device)
    column_scale = torch.ones(cost.size(1), dtype=cost.dtype, device=cost.device)
    epsilon = 1e-8
    for _ in range(max_iterations):
        row_scale = 1.0 / (cost.size(0) * (torch.sum(column_scale * cost, dim=1) + epsilon))
        new_column_scale = 1.0 / (cost.size(1) * (torch.sum(row_scale.unsqueeze(1) * cost, dim=0) + epsilon))
        change = torch.mean(torch.abs(new_column_scale - column_scale))
        column_scale = new_column_scale
        if change.item() <= tol:
            break
    return column_scale * cost * row_scale.unsqueeze(1)


# -------------------------------------------------------------------------------------------------------------
# Logging: per-layer values accumulated over the microbatches of one iteration
# -------------------------------------------------------------------------------------------------------------

AUX_LOSS_LOG_NAMES = {"aux_loss": "load_balancing_loss", "seq_aux_loss": "seq_load_balancing_loss",
                      "global_aux_loss": "global_load_balancing_loss"}
_tracked = {}  # name -> float64 tensor [num_layers] (global layer index), on the device of the first value
_tracked_groups = {}  # name -> (reduce_group, avg_group, reduce_group_has_dp), as the last save gave them
_tracked_layers = set()  # 1-based global numbers of the layers this rank tracked a loss for
_per_layer = {"requested": False}  # --moe-per-layer-logging, as the routers that tracked a value were configured


def aux_loss_layer_counts(num_layers, moe_layer_freq, mtp_num_layers=None):
    """(entries of the tracker, MoE layers among them). Layers 1..num_layers are the decoder's; a
    multi-token-prediction depth k logs under num_layers + k (as upstream) and is a MoE layer when the decoder's
    last layer is one (it is built like that layer)."""
    depths = mtp_num_layers or 0
    pattern = layer_pattern_from_freq(moe_layer_freq, num_layers)
    return num_layers + depths, sum(pattern) + (depths if pattern and pattern[-1] else 0)


def save_to_aux_losses_tracker(name, loss, layer_number, num_layers, reduce_group=None, avg_group=None,
                               reduce_group_has_dp=False, *, per_layer=False):
    """Add `loss` (this rank's value, without its coefficient) to layer `layer_number`'s (1-based, global) entry
    of loss `name`, one of `num_layers` entries (`aux_loss_layer_counts`). When logged, as upstream, the value is
    summed over `reduce_group` (each rank holds a share of the loss), averaged over `avg_group`, averaged over
    the data-parallel replicas (unless `reduce_group_has_dp`: the sum already spans them) and summed over the
    pipeline stages; without groups each rank's value is its own (averaged over the stage's ranks for the log).
    `per_layer` (`--moe-per-layer-logging`) asks the logger for each layer's value too. A recomputed forward
    (activation recompute) adds nothing: its original forward already did; nor does a layer without a number
    (None, as upstream: a router built outside a numbered transformer layer)."""
    if is_recomputing() or layer_number is None:
        return
    if not 1 <= layer_number <= num_layers:
        raise ValueError(f"save_to_aux_losses_tracker({name!r}): layer_number {layer_number} is outside 1.."
                         f"{num_layers} (num_layers); pass the 1-based global layer number")
    _tracked_layers.add(layer_number)
    _per_layer["requested"] = _per_layer["requested"] or bool(per_layer)
    values = _tracked.get(name)
    if values is None or values.numel() != num_layers:
        values = torch.zeros(num_layers, dtype=torch.float64, device=loss.device)
        _tracked[name] = values
    values[layer_number - 1] += loss.detach().to(torch.float64)
    _tracked_groups[name] = (reduce_group, avg_group, bool(reduce_group_has_dp))


def get_moe_layer_wise_logging_tracker():
    """Upstream's view of the tracker: {name: {"values": float64 tensor [num_layers], "reduce_group",
    "avg_group", "reduce_group_has_dp"}}, each layer's tracked value (summed over this iteration's microbatches,
    this rank's) at its 0-based global index, and the groups its last save named."""
    view = {}
    for name, values in _tracked.items():
        reduce_group, avg_group, has_dp = _tracked_groups.get(name, (None, None, False))
        view[name] = {"values": values, "reduce_group": reduce_group, "avg_group": avg_group,
                      "reduce_group_has_dp": has_dp}
    return view


def clear_aux_losses_tracker():
    _tracked.clear()
    _tracked_groups.clear()
    _tracked_layers.clear()
    _per_layer["requested"] = False


def _stage_size(data_parallel_size):
    """Ranks of one pipeline stage of one data-parallel replica (TP x CP): the world's sum of the logged shares,
    divided by the data-parallel size, must count each stage's value once."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return 1
    pipeline_size = (parallel_state.get_pipeline_model_parallel_world_size()
                     if parallel_state.model_parallel_is_initialized() else 1)
    return max(1, dist.get_world_size() // (pipeline_size * data_parallel_size))


def _logged_share(name, stage_size):
    """This rank's share of loss `name`'s logged value: its tracked values reduced over the groups the routers
    named (sum over `reduce_group`, mean over `avg_group`; collectives over those groups), over the stage size."""
    values = _tracked[name].clone()
    reduce_group, avg_group, _ = _tracked_groups.get(name, (None, None, False))
    if reduce_group is not None and dist.get_world_size(reduce_group) > 1:
        dist.all_reduce(values, group=reduce_group)
    if avg_group is not None and dist.get_world_size(avg_group) > 1:
        dist.all_reduce(values, group=avg_group)  # gloo has no AVG
        values /= dist.get_world_size(avg_group)
    return values / stage_size


def tracked_aux_loss_names(load_balancing_type, aux_loss_coeff, z_loss_coeff):
    """The names the routers log (the same on every rank); the load-balancing settings as the flags give them
    (one type and coefficient, or lists of them)."""
    names = [AUX_LOSS_LOG_NAMES[kind] for kind, _ in aux_loss_terms(load_balancing_type, aux_loss_coeff)]
    if z_loss_coeff:
        names.append("z_loss")
    return names


def reduce_aux_losses_for_logging(names, num_layers, num_moe_layers, num_microbatches, data_parallel_size, device):
    """{name: value} averaged over the MoE layers and microbatches (collective over the world: every rank calls
    it with the same `names`; and over the groups the routers named). After the groups' reductions each rank
    holds its share of its pipeline stage's layers for its data-parallel replica (`_logged_share`), so the world
    sum divided by the data-parallel size is each layer's loss summed over microbatches. With
    `--moe-per-layer-logging` (on any rank's routers) also `{name}_layer_{i}`: MoE layer i's (0-based global
    index, as upstream) value averaged over the microbatches."""
    if not names:
        return {}
    stacked = torch.zeros(len(names), num_layers, dtype=torch.float64, device=device)
    stage_size = _stage_size(data_parallel_size)
    for row, name in enumerate(names):
        if name in _tracked:
            stacked[row] = _logged_share(name, stage_size).to(device)
    # One more row: which layers some rank tracked, and (last element) whether per-layer values were asked for.
    extra = torch.zeros(num_layers + 1, dtype=torch.float64, device=device)
    for layer_number in _tracked_layers:
        extra[layer_number - 1] = 1.0
    extra[num_layers] = float(_per_layer["requested"])
    flat = torch.cat((stacked.reshape(-1), extra))
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(flat)
    stacked, extra = flat[: stacked.numel()].view(len(names), num_layers), flat[stacked.numel():]
    clear_aux_losses_tracker()
    per_microbatch = stacked / (data_parallel_size * num_microbatches)
    totals = per_microbatch.sum(dim=1) / max(num_moe_layers, 1)
    values = {name: float(total) for name, total in zip(names, totals.tolist())}
    if extra[num_layers] > 0:
        moe_layers = [index for index in range(num_layers) if extra[index] > 0]
        for row, name in enumerate(names):
            for index in moe_layers:
                values[f"{name}_layer_{index}"] = float(per_microbatch[row, index])
    return values



# -------------------------------------------------------------------------------------------------------------
# Upstream's functions of this module, by their names and arguments (`fused` there picks a fused kernel; the
# torch ops here give the same values with or without it)
# -------------------------------------------------------------------------------------------------------------


def switch_load_balancing_loss_func(probs, tokens_per_expert, total_num_tokens, topk, num_experts,
                                    moe_aux_loss_coeff, fused=False):
    """coeff * E / (k * T^2) * sum_i c_i * sum_x probs_{x,i}, E = `num_experts`. `probs` [tokens, n * E] may hold
    n groups side by side with counts [n * E] (upstream's seq_aux_loss passes [s, b * E])."""
    weight = num_experts * moe_aux_loss_coeff / (topk * float(total_num_tokens) ** 2)
    return torch.sum(probs.sum(dim=0) * tokens_per_expert.to(probs.dtype)) * weight


def z_loss_func(logits, z_loss_coeff):
    """coeff * mean_x logsumexp(logits_x)^2."""
    return z_loss(logits, z_loss_coeff)


def get_capacity(num_tokens, num_experts, capacity_factor, min_capacity=None):
    """ceil(num_tokens / num_experts * capacity_factor), raised to `min_capacity` if given. Callers pass
    tokens x top-k as `num_tokens` (the capacity of one expert on one rank)."""
    capacity = math.ceil(num_tokens / num_experts * capacity_factor)
    if min_capacity is not None and capacity < min_capacity:
        capacity = min_capacity
    return capacity


def compute_routing_scores_for_aux_loss(logits, topk, score_function, fused=False):
    """(routing_map [tokens, E] bool, scores [tokens, E]): the scores over all experts that the load-balancing
    losses use (softmax, or sigmoid / sqrtsoftplus normalised to sum to 1) and their own top-k map."""
    scores, routing_map = scores_for_aux_loss(logits, topk, score_function)
    return routing_map, scores


def topk_softmax_with_capacity(logits, topk, capacity_factor=None, pad_to_capacity=False, drop_policy="probs",
                               use_pre_softmax=False, num_groups=None, group_topk=None, scaling_factor=None,
                               deterministic_mode=False, score_function="softmax", expert_bias=None, fused=False):
    """(probs [tokens, E], routing_map [tokens, E] bool, tokens_per_expert [E]) for `logits` [tokens, E], as the
    router computes them (`routing.topk_routing`, then the capacity cut when `capacity_factor` is given);
    `tokens_per_expert` counts the top-k choices before any token is dropped."""
    if logits.dim() != 2:
        raise ValueError(f"topk_softmax_with_capacity takes logits [num_tokens, num_experts], got "
                         f"{tuple(logits.shape)}")
    if pad_to_capacity and capacity_factor is None:
        raise ValueError("pad_to_capacity needs a capacity_factor (--moe-pad-expert-input-to-capacity needs "
                         "--moe-expert-capacity-factor)")
    probs, routing_map = topk_routing(logits, topk, score_function=score_function, pre_softmax=use_pre_softmax,
                                      scaling_factor=scaling_factor, num_groups=num_groups, group_topk=group_topk,
                                      expert_bias=expert_bias)
    tokens_per_expert = routing_map.sum(dim=0)
    if capacity_factor is not None:
        capacity = expert_capacity(logits.size(0), topk, logits.size(1), capacity_factor)
        probs, routing_map = apply_capacity(probs, routing_map, capacity, drop_policy, pad_to_capacity)
    return probs, routing_map, tokens_per_expert


def permute(tokens, routing_map, probs=None, num_out_tokens=None, fused=False, drop_and_pad=False):
    """(permuted tokens, their probabilities or None, sorted_indices): the rows of `tokens` [num_tokens, h]
    grouped by expert (expert 0's tokens first, each expert's in token order), `sorted_indices` the source row
    of each. `drop_and_pad`: every expert gets exactly num_out_tokens / E rows, its routed tokens first, then
    tokens not routed to it (the padding of `--moe-pad-expert-input-to-capacity`)."""
    num_tokens, num_experts = routing_map.shape
    expert_major = routing_map.bool().t().contiguous()
    if drop_and_pad:
        if num_out_tokens is None or num_out_tokens % num_experts != 0:
            raise ValueError(f"permute(drop_and_pad=True) needs num_out_tokens, a multiple of the {num_experts} "
                             f"experts (capacity x experts), got {num_out_tokens}")
        capacity = num_out_tokens // num_experts
        order = torch.sort(expert_major.to(torch.int8), dim=-1, descending=True, stable=True).indices
        sorted_indices = order[:, :capacity].reshape(-1)
        permuted_probs = None
        if probs is not None:
            expert_of_row = torch.arange(num_experts, device=probs.device).repeat_interleave(capacity)
            permuted_probs = probs[sorted_indices.to(probs.device), expert_of_row]
    else:
        token_index = torch.arange(num_tokens, device=routing_map.device).unsqueeze(0).expand(num_experts, -1)
        sorted_indices = token_index.masked_select(expert_major)
        permuted_probs = None if probs is None else probs.t().contiguous().masked_select(expert_major)
    return tokens.index_select(0, sorted_indices.to(tokens.device)), permuted_probs, sorted_indices


def unpermute(permuted_tokens, sorted_indices, restore_shape, probs=None, routing_map=None, fused=False,
              drop_and_pad=False):
    """Inverse of `permute`: each row added back into its source token of a zero tensor `restore_shape`
    [num_tokens, h], weighted by that token's probability for the row's expert when `probs` [num_tokens, E]
    (with its `routing_map`) is given. The weighting and the sum run in `probs`' dtype; the result has
    `permuted_tokens`' dtype."""
    input_dtype = permuted_tokens.dtype
    if probs is not None:
        if routing_map is None:
            raise ValueError("unpermute with probs needs the routing_map that permuted the tokens")
        if drop_and_pad:
            num_experts = routing_map.size(1)
            capacity = sorted_indices.numel() // num_experts
            expert_of_row = torch.arange(num_experts, device=probs.device).repeat_interleave(capacity)
            permuted_probs = probs[sorted_indices.to(probs.device), expert_of_row]
        else:
            permuted_probs = probs.t().contiguous().masked_select(routing_map.bool().t().contiguous())
        permuted_tokens = permuted_tokens.to(torch.promote_types(input_dtype, probs.dtype))
        permuted_tokens = permuted_tokens * permuted_probs.unsqueeze(-1)
    output = permuted_tokens.new_zeros(restore_shape)
    output.index_add_(0, sorted_indices.to(output.device), permuted_tokens)
    return output.to(input_dtype)


def get_updated_expert_bias(tokens_per_expert, expert_bias, expert_bias_update_rate):
    """expert_bias + rate * sign(mean(c) - c), c = `tokens_per_expert` summed (in place) over the TP x DP x CP
    group when model parallelism is initialised (what `router.update_expert_biases` does for every router)."""
    with torch.no_grad():
        if parallel_state.model_parallel_is_initialized():
            group = parallel_state.get_tensor_and_data_parallel_group(with_context_parallel=True)
            if dist.get_world_size(group) > 1:
                dist.all_reduce(tokens_per_expert, group=group)
        counts = tokens_per_expert.to(expert_bias.dtype)
        offset = counts.mean(dim=-1, keepdim=True) - counts
        return expert_bias + torch.sign(offset) * expert_bias_update_rate


def track_moe_metrics(loss_scale, iteration, writer, wandb_writer=None, total_loss_dict=None,
                      per_layer_logging=False, force_initialize=False, track_names=None, num_layers=None,
                      moe_layer_freq=None, mtp_num_layers=None):
    """Upstream's logging step: the tracked losses, reduced over the world (a collective: every rank calls it
    with the same `track_names`), summed over the MoE layers x `loss_scale` (1 / microbatches) / the MoE layer
    count, written to `writer` (TensorBoard: `name`, with `per_layer_logging` also `moe/{name}_layer_{i}`) and
    `wandb_writer`, and added to `total_loss_dict[name]`; the tracker is then cleared. `num_layers`: the
    decoder's layers (`moe_layer_freq` picks the MoE ones, default all; multi-token-prediction depths follow)."""
    names = list(track_names) if track_names is not None else sorted(_tracked)
    if num_layers is None:
        lengths = {values.numel() for values in _tracked.values()}
        if len(lengths) != 1:
            raise ValueError("track_moe_metrics needs num_layers (--num-layers) when no loss has been tracked")
        num_layers = lengths.pop() - (mtp_num_layers or 0)
    entries, num_moe_layers = aux_loss_layer_counts(num_layers, moe_layer_freq or 1, mtp_num_layers)
    data_parallel_size = (parallel_state.get_data_parallel_world_size()
                          if parallel_state.model_parallel_is_initialized() else 1)
    device = next((values.device for values in _tracked.values()), get_current_device())
    _per_layer["requested"] = bool(per_layer_logging)
    # num_microbatches 1: the loss_scale below takes its place.
    values = reduce_aux_losses_for_logging(names, entries, num_moe_layers, 1, data_parallel_size, device)
    values = {key: value * loss_scale for key, value in values.items()}
    for name in names:
        if total_loss_dict is not None:
            total_loss_dict[name] = total_loss_dict.get(name, 0.0) + torch.tensor(values[name])
        per_layer = {f"moe/{key}": value for key, value in values.items()
                     if per_layer_logging and key.startswith(f"{name}_layer_")}
        if writer is not None:
            writer.add_scalar(name, values[name], iteration)
            for key, value in per_layer.items():
                writer.add_scalar(key, value, iteration)
        if wandb_writer is not None:
            wandb_writer.log({name: values[name], **per_layer}, iteration)
