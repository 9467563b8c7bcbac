"""Activation-based importance of a GPTModel's width channels (Minitron), measured on calibration batches.

Three kinds of channel, each scored by the mean absolute activation it carries over every calibration token:

- an FFN neuron (per layer): its value in the MLP's intermediate output, the input of `linear_fc2` (after the
  activation, and after the gate with SwiGLU);
- an attention head (per layer): its `kv_channels` values in the attention output, the input of `linear_proj`,
  averaged over the head's channels too;
- a hidden (embedding) channel (one score for the whole model): its value in the output of every layer's two
  norms (`input_layernorm`, `pre_mlp_layernorm`), the per-norm means summed over the norms.

Sums and token counts are added over the data-parallel ranks before dividing, so every rank gets the scores of
all calibration tokens and prunes the same channels.
"""

from dataclasses import dataclass
from typing import Callable, List, Optional

import torch
import torch.distributed as dist


@dataclass
class WidthImportance:
    """Scores (higher: more important) of each layer's FFN neurons and heads and of the hidden channels."""

    ffn: List[torch.Tensor]  # per layer, [ffn_hidden_size]
    heads: List[torch.Tensor]  # per layer, [num_attention_heads]
    hidden: torch.Tensor  # [hidden_size]

    def negated(self) -> "WidthImportance":
        """The same scores negated: ranking by them keeps the least important channels."""
        return WidthImportance([-s for s in self.ffn], [-s for s in self.heads], -self.hidden)


def check_prunable(model):
    """Raise ValueError naming the flag when `model` is not a GPTModel that width pruning handles here."""
    from megatron.core.models.gpt.gpt_model import GPTModel

    if not isinstance(model, GPTModel):
        raise ValueError(f"width pruning takes an unwrapped GPTModel, got {type(model).__name__} (unwrap_model it)")
    config = model.config
    if config.tensor_model_parallel_size != 1:
        raise ValueError(f"width pruning runs at --tensor-model-parallel-size 1 (got "
                         f"{config.tensor_model_parallel_size}):"
                         " load the checkpoint at TP1 (torch_dist checkpoints load at any layout)")
    if config.pipeline_model_parallel_size != 1 or not (model.pre_process and model.post_process):
        raise ValueError(f"width pruning runs at --pipeline-model-parallel-size 1 (got "
                         f"{config.pipeline_model_parallel_size}): load the checkpoint on one pipeline stage")
    if getattr(config, "num_moe_experts", None):
        raise ValueError("width pruning handles dense MLPs only: a model with --num-experts (MoE) needs modelopt's "
                         "mcore_minitron plugin (--use-modelopt-plugin)")
    if getattr(config, "multi_latent_attention", False):
        raise ValueError("width pruning handles SelfAttention only: a model with --multi-latent-attention needs "
                         "modelopt's mcore_minitron plugin (--use-modelopt-plugin)")
    if getattr(config, "mtp_num_layers", None):
        raise ValueError("width pruning does not prune the multi-token-prediction depths of --mtp-num-layers (their "
                         "projections and layers are not scored): prune a model without them")
    if getattr(config, "attention_output_gate", False):
        raise ValueError("width pruning does not handle --attention-output-gate (gate rows inside the fused QKV "
                         "weight): prune a model without it")
    if getattr(config, "softmax_type", "vanilla") == "learnable":
        raise ValueError("width pruning does not prune the learnable attention sinks of --softmax-type learnable "
                         "(one per query head): prune a model without them")
    if getattr(config, "hybrid_layer_pattern", None) is not None:
        raise ValueError("width pruning scores layers of attention and MLP; a hybrid model's Mamba, attention-only "
                         "and MLP-only layers (--hybrid-override-pattern) are not covered: prune a GPT model")
    if getattr(config, "heterogeneous_block_configs", None) is not None:
        raise ValueError("width pruning gives every layer the same --target-ffn-hidden-size and heads; a "
                         "heterogeneous model's layers (--heterogeneous-layers-config-path) each have their own: "
                         "prune a model of uniform layers")
    if any(layer.norms_fused_into_linears for layer in model.decoder.layers):
        raise ValueError("width pruning reads the norms' outputs, which Transformer Engine's fused LayerNorm-linears "
                         "do not expose: build the model with --transformer-impl local (the weights are the same)")


class _AbsMean:
    """Running sum of |activation| per channel and the number of tokens summed."""

    def __init__(self):
        self.sum: Optional[torch.Tensor] = None
        self.tokens = 0

    def add(self, activation: torch.Tensor):
        """`activation` `[s, b, channels]`: every (s, b) position is one token."""
        flat = activation.detach().float().abs().reshape(-1, activation.shape[-1])
        total = flat.sum(dim=0).double()
        self.sum = total if self.sum is None else self.sum + total
        self.tokens += flat.shape[0]


def _all_reduced_means(meters, group):
    """Each meter's sum divided by its token count, both added over `group` first."""
    if any(meter.sum is None for meter in meters):
        raise RuntimeError("the calibration forward loop ran no forward pass through every layer: nothing to score")
    sums = torch.cat([meter.sum for meter in meters])
    tokens = torch.tensor([float(meter.tokens) for meter in meters], dtype=torch.float64, device=sums.device)
    if group is not None and dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(sums, group=group)
        dist.all_reduce(tokens, group=group)
    means, offset = [], 0
    for index, meter in enumerate(meters):
        size = meter.sum.numel()
        means.append((sums[offset:offset + size] / tokens[index]).float().cpu())
        offset += size
    return means


def collect_width_importance(model, forward_loop: Callable, group=None) -> WidthImportance:
    """Run `forward_loop(model)` (the calibration batches, forward only) with hooks that record the
    activations, and return the scores. `group`: the data-parallel group whose ranks saw the other batches
    (None: this rank's batches only)."""
    check_prunable(model)
    layers = list(model.decoder.layers)
    ffn_meters = [_AbsMean() for _ in layers]
    head_meters = [_AbsMean() for _ in layers]
    norm_meters = [_AbsMean() for _ in range(2 * len(layers))]

    def record_input(meter):
        return lambda module, inputs: meter.add(inputs[0])

    def record_output(meter):
        return lambda module, inputs, output: meter.add(output)

    handles = []
    for index, layer in enumerate(layers):
        handles.append(layer.mlp.linear_fc2.register_forward_pre_hook(record_input(ffn_meters[index])))
        handles.append(layer.self_attention.linear_proj.register_forward_pre_hook(record_input(head_meters[index])))
        handles.append(layer.input_layernorm.register_forward_hook(record_output(norm_meters[2 * index])))
        handles.append(layer.pre_mlp_layernorm.register_forward_hook(record_output(norm_meters[2 * index + 1])))
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            forward_loop(model)
    finally:
        for handle in handles:
            handle.remove()
        model.train(was_training)

    means = _all_reduced_means(ffn_meters + head_meters + norm_meters, group)
    num_layers = len(layers)
    ffn = means[:num_layers]
    heads_per_channel = means[num_layers:2 * num_layers]
    heads = [channels.view(model.config.num_attention_heads, model.config.kv_channels).mean(dim=1)
             for channels in heads_per_channel]
    hidden = torch.stack(means[2 * num_layers:]).sum(dim=0)
    return WidthImportance(ffn=ffn, heads=heads, hidden=hidden)
