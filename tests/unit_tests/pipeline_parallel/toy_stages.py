"""A toy model for schedule tests: a stack of Linear+tanh layers cut into pipeline stages.

Every rank builds the whole stack from one seed, so each stage's slice and the single-rank reference run
(`reference_losses_and_grads`, plain gradient accumulation over the same microbatches) start from the same
weights; the pipelined run must reproduce the reference's per-microbatch losses and every gradient.
"""

import dataclasses
from typing import Callable, Optional

import torch

HIDDEN_SIZE = 8
SEQ_LENGTH = 4
MICRO_BATCH_SIZE = 2
NUM_LAYERS = 4
MODEL_SEED = 1234


@dataclasses.dataclass
class ToyConfig:
    hidden_size: int = HIDDEN_SIZE
    pipeline_dtype: torch.dtype = torch.float32
    sequence_parallel: bool = False
    variable_seq_lengths: bool = False
    deallocate_pipeline_outputs: bool = False
    calculate_per_token_loss: bool = False
    no_sync_func: Optional[Callable] = None
    grad_sync_func: Optional[Callable] = None
    finalize_model_grads_func: Optional[Callable] = None
    grad_scale_func: Optional[Callable] = None


class ToyStage(torch.nn.Module):
    """Layers of the stack; the first stage reads the batch, later stages the tensor set by the schedule."""

    def __init__(self, layers, pre_process, config=None):
        super().__init__()
        self.layers = torch.nn.ModuleList(layers)
        self.pre_process = pre_process
        if config is not None:
            self.config = config
        self.input_tensor = None

    def set_input_tensor(self, input_tensor):
        self.input_tensor = input_tensor

    def forward(self, x):
        hidden = x if self.pre_process else self.input_tensor
        for layer in self.layers:
            hidden = torch.tanh(layer(hidden))
        return hidden


class Wrapper(torch.nn.Module):
    """Stands for a DDP/FSDP wrapper: the real model sits in `.module`."""

    def __init__(self, module):
        super().__init__()
        self.module = module

    def forward(self, *args):
        return self.module(*args)


def build_layers():
    generator = torch.Generator().manual_seed(MODEL_SEED)
    layers = [torch.nn.Linear(HIDDEN_SIZE, HIDDEN_SIZE) for _ in range(NUM_LAYERS)]
    with torch.no_grad():
        for layer in layers:
            layer.weight.copy_(torch.randn(layer.weight.shape, generator=generator) * 0.5)
            layer.bias.copy_(torch.randn(layer.bias.shape, generator=generator) * 0.1)
    return layers


def stage_layer_indices(stage, num_stages):
    per_stage = NUM_LAYERS // num_stages
    return list(range(stage * per_stage, (stage + 1) * per_stage))


def build_stage(stage, num_stages, config=None):
    layers = build_layers()
    return ToyStage([layers[i] for i in stage_layer_indices(stage, num_stages)], stage == 0, config)


def make_batches(num_microbatches, seed=7, seq_lengths=None):
    """Microbatches with inputs `x`, targets and a 0/1 `loss_mask` (each at least one token), all [s, b, h]."""
    generator = torch.Generator().manual_seed(seed)
    batches = []
    for index in range(num_microbatches):
        seq_length = SEQ_LENGTH if seq_lengths is None else seq_lengths[index]
        shape = (seq_length, MICRO_BATCH_SIZE, HIDDEN_SIZE)
        loss_mask = (torch.rand(seq_length, MICRO_BATCH_SIZE, generator=generator) > 0.4).float()
        loss_mask[0, 0] = 1.0
        batches.append(
            {
                "x": torch.randn(shape, generator=generator),
                "target": torch.randn(shape, generator=generator),
                "loss_mask": loss_mask,
            }
        )
    return batches


def mean_loss(output, batch):
    return ((output - batch["target"]) ** 2).mean()


def token_loss_sum(output, batch):
    per_token = ((output - batch["target"]) ** 2).mean(dim=-1)
    return (per_token * batch["loss_mask"]).sum(), batch["loss_mask"].sum()


def forward_step_mean_loss(data_iterator, model):
    batch = next(data_iterator)
    output = model(batch["x"])

    def loss_func(output_tensor):
        loss = mean_loss(output_tensor, batch)
        return loss, {"lm loss": loss.detach()}

    return output, loss_func


def forward_step_token_loss(data_iterator, model):
    batch = next(data_iterator)
    output = model(batch["x"])

    def loss_func(output_tensor):
        loss_sum, num_tokens = token_loss_sum(output_tensor, batch)
        return loss_sum, num_tokens, {"lm loss": torch.stack([loss_sum.detach(), num_tokens])}

    return output, loss_func


def reference_losses_and_grads(batches, loss_kind="mean", num_replicas=1):
    """Whole model on one rank: per-microbatch losses and the gradients of the batch's mean loss.

    `loss_kind`: "mean" (mean of per-microbatch means), "token_mean_per_microbatch" (each microbatch's
    token-mean, averaged over microbatches) or "token_mean_global" (sum over all tokens / all tokens).
    `num_replicas` data-parallel replicas each ran len(batches) / num_replicas of the microbatches.
    """
    model = ToyStage(build_layers(), pre_process=True)
    losses = []
    total_tokens = sum(batch["loss_mask"].sum() for batch in batches)
    for batch in batches:
        output = model(batch["x"])
        if loss_kind == "mean":
            loss = mean_loss(output, batch)
            (loss / len(batches)).backward()
        elif loss_kind == "token_mean_per_microbatch":
            loss_sum, num_tokens = token_loss_sum(output, batch)
            loss = loss_sum / num_tokens
            (loss / len(batches)).backward()
        elif loss_kind == "token_mean_global":
            loss_sum, num_tokens = token_loss_sum(output, batch)
            loss = loss_sum
            (loss_sum / total_tokens).backward()
        else:
            raise ValueError(loss_kind)
        losses.append(loss.item())
    grads = [[p.grad.clone() for p in layer.parameters()] for layer in model.layers]
    return losses, grads


def stage_grads(stage_module):
    return [
        [None if p.grad is None else p.grad.clone() for p in layer.parameters()] for layer in stage_module.layers
    ]


def max_grad_error(stage_module, reference_grads, stage, num_stages):
    """Largest |pipelined - reference| over the stage's parameters."""
    worst = 0.0
    for local, global_index in zip(stage_grads(stage_module), stage_layer_indices(stage, num_stages)):
        for grad, expected in zip(local, reference_grads[global_index]):
            assert grad is not None, f"layer {global_index} got no gradient"
            worst = max(worst, (grad - expected).abs().max().item())
    return worst
