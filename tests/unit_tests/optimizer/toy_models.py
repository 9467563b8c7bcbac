"""Small plain-torch models and data shared by the optimizer and DDP tests (no GPT model needed)."""

import torch


def build_toy_model(seed=0, dtype=torch.float32):
    """Linear -> LayerNorm -> Tanh -> Linear -> Tanh -> Linear: 233 parameters in weights, biases and a norm."""
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(6, 10),
        torch.nn.LayerNorm(10),
        torch.nn.Tanh(),
        torch.nn.Linear(10, 10),
        torch.nn.Tanh(),
        torch.nn.Linear(10, 3),
    )
    with torch.no_grad():
        for param in model.parameters():  # non-trivial norm parameters, so their updates are visible
            param.add_(0.1 * torch.randn_like(param))
    torch.random.set_rng_state(generator_state)
    return model.to(dtype)


def toy_batch(seed, num_samples, dtype=torch.float32):
    generator = torch.Generator().manual_seed(1000 + seed)
    inputs = torch.randn(num_samples, 6, generator=generator)
    targets = torch.randn(num_samples, 3, generator=generator)
    return inputs.to(dtype), targets.to(dtype)


def mse_loss(model, inputs, targets):
    return torch.nn.functional.mse_loss(model(inputs).float(), targets.float())


def reference_param_groups(model, weight_decay, lr):
    """Weight decay on weights with >= 2 dims only, the rule get_megatron_optimizer must follow."""
    decay = [param for param in model.parameters() if param.dim() >= 2]
    no_decay = [param for param in model.parameters() if param.dim() < 2]
    return [
        {"params": decay, "weight_decay": weight_decay, "lr": lr},
        {"params": no_decay, "weight_decay": 0.0, "lr": lr},
    ]
