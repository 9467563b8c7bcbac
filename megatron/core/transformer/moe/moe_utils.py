"""Auxiliary losses of the MoE router, how they reach the backward pass, and the tracker that logs them.

The losses are not added to the language-model loss. Each is attached to an activation of the router by
`MoEAuxLossAutoScaler`: the forward returns the activation unchanged, and the backward adds
`backward_scale * d(loss)/d(inputs)` to the gradient flowing through that activation. The schedule sets
`backward_scale` so the auxiliary gradient is scaled like the language-model loss's (loss scale x CP / number of
microbatches, or the loss scale alone for a per-token loss, see `set_aux_loss_backward_scale`).
"""

import torch
import torch.distributed as dist

from megatron.core.device_utils import get_current_device
from megatron.core.transformer.moe.moe_config import aux_loss_terms, layer_pattern_from_freq
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
    num_experts = scores.size(-1)
    weight = num_experts * coeff / (topk * float(total_num_tokens) ** 2)
    return torch.sum(scores.sum(dim=0) * tokens_per_expert.to(scores.dtype)) * weight


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


def sinkhorn(cost, tolerance=1e-4, max_iterations=1000):
    """Sinkhorn balancing of exp(cost) [tokens, E]: rows and columns rescaled until the column scaling moves by
    less than `tolerance` (mean absolute change)."""
    cost = torch.exp(cost)
    row_scale = torch.ones(cost.size(0), dtype=cost.dtype, device=cost.device)
    column_scale = torch.ones(cost.size(1), dtype=cost.dtype, device=cost.device)
    epsilon = 1e-8
    for _ in range(max_iterations):
        row_scale = 1.0 / (cost.size(0) * (torch.sum(column_scale * cost, dim=1) + epsilon))
        new_column_scale = 1.0 / (cost.size(1) * (torch.sum(row_scale.unsqueeze(1) * cost, dim=0) + epsilon))
        change = torch.mean(torch.abs(new_column_scale - column_scale))
        column_scale = new_column_scale
        if change.item() <= tolerance:
            break
    return column_scale * cost * row_scale.unsqueeze(1)


# -------------------------------------------------------------------------------------------------------------
# Logging: per-layer values accumulated over the microbatches of one iteration
# -------------------------------------------------------------------------------------------------------------

AUX_LOSS_LOG_NAMES = {"aux_loss": "load_balancing_loss", "seq_aux_loss": "seq_load_balancing_loss",
                      "global_aux_loss": "global_load_balancing_loss"}
_tracked = {}  # name -> float64 tensor [num_layers] (global layer index), on the device of the first value
_tracked_layers = set()  # 1-based global numbers of the layers this rank tracked a loss for
_per_layer = {"requested": False}  # --moe-per-layer-logging, as the routers that tracked a value were configured


def aux_loss_layer_counts(num_layers, moe_layer_freq, mtp_num_layers=None):
    """(entries of the tracker, MoE layers among them). Layers 1..num_layers are the decoder's; a
    multi-token-prediction depth k logs under num_layers + k (as upstream) and is a MoE layer when the decoder's
    last layer is one (it is built like that layer)."""
    depths = mtp_num_layers or 0
    pattern = layer_pattern_from_freq(moe_layer_freq, num_layers)
    return num_layers + depths, sum(pattern) + (depths if pattern and pattern[-1] else 0)


def save_to_aux_losses_tracker(name, value, layer_number, num_layers, per_layer=False):
    """Add `value` (this rank's share of the layer's loss, without its coefficient) to layer `layer_number`'s
    (1-based, global) entry of loss `name`, one of `num_layers` entries (`aux_loss_layer_counts`); `per_layer`
    (`--moe-per-layer-logging`) asks the logger for each layer's value too. A recomputed forward (activation
    recompute) adds nothing: its original forward already did."""
    if is_recomputing():
        return
    _tracked_layers.add(layer_number)
    _per_layer["requested"] = _per_layer["requested"] or bool(per_layer)
    values = _tracked.get(name)
    if values is None or values.numel() != num_layers:
        values = torch.zeros(num_layers, dtype=torch.float64, device=value.device)
        _tracked[name] = values
    values[layer_number - 1] += value.detach().to(torch.float64)


def clear_aux_losses_tracker():
    _tracked.clear()
    _tracked_layers.clear()
    _per_layer["requested"] = False


def tracked_aux_loss_names(load_balancing_type, aux_loss_coeff, z_loss_coeff):
    """The names the routers log (the same on every rank); the load-balancing settings as the flags give them
    (one type and coefficient, or lists of them)."""
    names = [AUX_LOSS_LOG_NAMES[kind] for kind, _ in aux_loss_terms(load_balancing_type, aux_loss_coeff)]
    if z_loss_coeff:
        names.append("z_loss")
    return names


def reduce_aux_losses_for_logging(names, num_layers, num_moe_layers, num_microbatches, data_parallel_size, device):
    """{name: value} averaged over the MoE layers and microbatches (collective over the world: every rank calls
    it with the same `names`). Each rank holds its tensor-/context-parallel share of its pipeline stage's layers
    for its data-parallel replica, so the world sum divided by the data-parallel size is each layer's loss summed
    over microbatches. With `--moe-per-layer-logging` (on any rank's routers) also `{name}_layer_{i}`: MoE layer
    i's (0-based global index, as upstream) value averaged over the microbatches."""
    if not names:
        return {}
    stacked = torch.zeros(len(names), num_layers, dtype=torch.float64, device=device)
    for row, name in enumerate(names):
        if name in _tracked:
            stacked[row] = _tracked[name].to(device)
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

