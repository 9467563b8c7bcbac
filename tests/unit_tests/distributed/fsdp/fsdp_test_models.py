"""Small models and reference training loops shared by the Megatron-FSDP tests."""

import copy

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

GLOBAL_BATCH = 12  # divisible by every tested data-parallel size (1, 2, 3, 4)
IN_FEATURES, HIDDEN = 7, 13


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(HIDDEN, IN_FEATURES)
        self.norm = nn.LayerNorm(IN_FEATURES)
        self.fc2 = nn.Linear(IN_FEATURES, HIDDEN)

    def forward(self, x):
        return x + self.fc2(torch.tanh(self.norm(self.fc1(x))))


class ScaleVector(nn.Module):
    """A module owning a plain vector parameter (reset_parameters makes it meta-initialisable)."""

    def __init__(self, size, fill=None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size))
        self.fill = fill
        self.reset_parameters()

    def reset_parameters(self):
        with torch.no_grad():
            if self.fill is None:
                self.weight.normal_(0.0, 0.5)
            else:
                self.weight.fill_(self.fill)


class TinyModel(nn.Module):
    """Odd shapes, a weight tied across a unit and the root, a frozen layer, tiny and empty params, a buffer."""

    def __init__(self, num_blocks=3, checkpoint_blocks=False):
        super().__init__()
        self.inp = nn.Linear(IN_FEATURES, HIDDEN)
        self.blocks = nn.ModuleList([Block() for _ in range(num_blocks)])
        self.frozen = nn.Linear(HIDDEN, HIDDEN)
        self.scale = ScaleVector(HIDDEN, fill=1.0)
        self.tiny = ScaleVector(2)
        self.empty = ScaleVector(0)
        self.out = nn.Linear(HIDDEN, IN_FEATURES)
        self.frozen.requires_grad_(False)
        self.blocks[0].fc2.weight = self.inp.weight  # tied: used by the root and by unit 0 (both 13x7)
        self.register_buffer("offset", torch.linspace(-0.1, 0.1, HIDDEN))
        self.checkpoint_blocks = checkpoint_blocks

    def reset_parameters(self):
        """Fills this module's own buffer (its parameters belong to submodules with their own resets)."""
        with torch.no_grad():
            self.offset.copy_(torch.linspace(-0.1, 0.1, HIDDEN))

    def forward(self, x):
        h = self.inp(x) * self.scale.weight + self.offset
        for block in self.blocks:
            if self.checkpoint_blocks:
                h = torch.utils.checkpoint.checkpoint(block, h, use_reentrant=False)
            else:
                h = block(h)
        h = h + 0.1 * self.frozen(h)
        return self.out(h) + self.tiny.weight.sum() + self.empty.weight.sum()


def make_model(seed=0, dtype=torch.float32, **kwargs):
    torch.manual_seed(seed)
    return TinyModel(**kwargs).to(dtype)


def make_batches(num_steps, seed=1, dtype=torch.float32):
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randn(GLOBAL_BATCH, IN_FEATURES, generator=generator).to(dtype),
             torch.randn(GLOBAL_BATCH, IN_FEATURES, generator=generator).to(dtype)) for _ in range(num_steps)]


def local_slice(tensor, rank, world_size):
    per_rank = tensor.shape[0] // world_size
    return tensor[rank * per_rank:(rank + 1) * per_rank]


def loss_fn(output, target):
    return F.mse_loss(output.float(), target.float())


def make_optimizer(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def train_single_process(model, num_steps, dtype=torch.float32):
    """Single-process AdamW training of `model` on the full batch: loss before each step and after the last."""
    optimizer = make_optimizer([p for p in model.parameters() if p.requires_grad])
    losses = []
    for step, (inputs, target) in enumerate(make_batches(num_steps + 1, dtype=dtype)):
        loss = loss_fn(model(inputs), target)
        losses.append(loss.item())
        if step == num_steps:
            break
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return losses


def reference_losses(num_steps, dtype=torch.float32, seed=0, model_kwargs=None):
    """Single-process AdamW training on the full batch: loss before each step and after the last one."""
    model = make_model(seed, dtype, **(model_kwargs or {}))
    losses = train_single_process(model, num_steps, dtype)
    # Every name the module's state dict has, tied aliases included (a wrapped model's state dict has them too).
    return losses, {name: p.detach().float().clone() for name, p in model.named_parameters(remove_duplicate=False)}


def global_mean(value):
    value = torch.tensor(float(value), dtype=torch.float64)
    dist.all_reduce(value)
    return value.item() / dist.get_world_size()


def train_sharded(model, optimizer, num_steps, dtype=torch.float32, microbatches=1):
    """Data-parallel training with Megatron-FSDP; returns the global mean loss before each step and after."""
    rank, world = dist.get_rank(), dist.get_world_size()
    batches = make_batches(num_steps + 1, dtype=dtype)
    losses = []
    for step in range(num_steps + 1):
        inputs, target = (local_slice(t, rank, world) for t in batches[step])
        if step == num_steps:
            with torch.no_grad():
                losses.append(global_mean(loss_fn(model(inputs), target).item()))
            break
        optimizer.zero_grad()
        chunk = inputs.shape[0] // microbatches
        total = 0.0
        for micro in range(microbatches):
            part = slice(micro * chunk, (micro + 1) * chunk)
            context = model.no_sync() if micro < microbatches - 1 else _null()
            with context:
                loss = loss_fn(model(inputs[part]), target[part]) / microbatches
                loss.backward()
            total += loss.item()
        losses.append(global_mean(total))
        optimizer.step()
    return losses


def train_from_step(model, optimizer, steps, first_step, dtype=torch.float32):
    """Data-parallel training from batch `first_step` for `steps` steps (a resumed run continues where the
    uninterrupted one was); returns the global mean loss before each step and after the last one."""
    rank, world = dist.get_rank(), dist.get_world_size()
    batches = make_batches(first_step + steps + 1, dtype=dtype)
    losses = []
    for step in range(first_step, first_step + steps + 1):
        inputs, target = (local_slice(t, rank, world) for t in batches[step])
        optimizer.zero_grad()
        loss = loss_fn(model(inputs), target)
        losses.append(global_mean(loss.item()))
        if step == first_step + steps:
            break
        loss.backward()
        optimizer.step()
    return losses


def train_with_gradient_scaling(model, optimizer, num_steps, loss_factor, grad_factor, scale_after_sync,
                                dtype=torch.float32):
    """Global mean losses; each step backpropagates `loss * loss_factor`, then (unless `grad_factor` is None)
    calls `scale_gradients(grad_factor)` before `optimizer.step()`, after an explicit `finish_grad_sync()` when
    `scale_after_sync` (the gradients are then the ones the optimizer steps on)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    batches = make_batches(num_steps + 1, dtype=dtype)
    losses = []
    for step in range(num_steps + 1):
        inputs, target = (local_slice(t, rank, world) for t in batches[step])
        optimizer.zero_grad()
        loss = loss_fn(model(inputs), target)
        losses.append(global_mean(loss.item()))
        if step == num_steps:
            break
        (loss * loss_factor).backward()
        if grad_factor is not None:
            if scale_after_sync:
                model.finish_grad_sync()
            model.scale_gradients(grad_factor)
        optimizer.step()
    return losses


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def precision_of(model, optimizer):
    """(dtypes of the module's compute weights, dtypes of the main weights the optimizer steps on)."""
    return ({p.dtype for p in model.module.parameters()},
            {p.dtype for group in optimizer.param_groups for p in group["params"]})


def assert_ran_in_low_precision(losses, precision, reference_low, reference_fp32, dtype=torch.bfloat16):
    """The step-0 loss is the forward of the initial weights: in bf16 it lands within bf16 rounding of the
    bf16 reference's (2.5e-3 away from the fp32 one, measured), before any gradient or update is involved."""
    assert precision == ({dtype}, {torch.float32}), precision
    assert abs(losses[0] - reference_low[0]) < 5e-4, (losses[0], reference_low[0])
    assert abs(losses[0] - reference_fp32[0]) > 1.5e-3, (losses[0], reference_fp32[0])


def full_params(model):
    """Full (unsharded) parameter values by name, from the DTensor state dict."""
    result = {}
    for name, value in model.state_dict().items():
        if hasattr(value, "full_tensor"):
            result[name] = value.full_tensor().float()
    return result


def clone_module(module):
    return copy.deepcopy(module)


def reference_losses_mixed(num_steps, dtype=torch.bfloat16, seed=0):
    """Single-process reference with low-precision compute weights and fp32 AdamW master weights."""
    model = make_model(seed, dtype)
    trainable = [p for p in model.parameters() if p.requires_grad]
    masters = [p.detach().float().clone() for p in trainable]
    optimizer = make_optimizer(masters)
    batches = make_batches(num_steps + 1, dtype=dtype)
    losses = []
    for step in range(num_steps + 1):
        inputs, target = batches[step]
        loss = loss_fn(model(inputs), target)
        losses.append(loss.item())
        if step == num_steps:
            break
        model.zero_grad()
        loss.backward()
        for master, param in zip(masters, trainable):
            master.grad = param.grad.float()
        optimizer.step()
        with torch.no_grad():
            for master, param in zip(masters, trainable):
                param.copy_(master)
    return losses


class ScaledLinear(torch.nn.Module):
    """A linear layer times a learned 0-dim temperature (held by data-parallel rank 0's shard; its optimizer
    moments are 0-dim too)."""

    def __init__(self):
        super().__init__()
        self.temperature = torch.nn.Parameter(torch.tensor(1.5))
        self.linear = torch.nn.Linear(IN_FEATURES, IN_FEATURES)

    def forward(self, x):
        return self.linear(x) * self.temperature
