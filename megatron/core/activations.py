"""Activation functions the MLP can use besides torch's own (`config.activation_func`)."""

import torch
import torch.nn.functional as F


def squared_relu(x: torch.Tensor) -> torch.Tensor:
    """relu(x) ** 2 (`--squared-relu`)."""
    return torch.pow(F.relu(x), 2)


QUICK_GELU_ALPHA = 1.702


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    """x * sigmoid(1.702 x), the sigmoid approximation of GeLU; the gate's activation of `--quick-geglu`."""
    return x * torch.sigmoid(QUICK_GELU_ALPHA * x)


def gated_linear_unit(config, intermediate: torch.Tensor) -> torch.Tensor:
    """The gated MLP's activation of fc1's output, whose last dimension interleaves gate and up per unit.

    Computes act(gate) * (up + config.glu_linear_offset), act = config.activation_func (silu for `--swiglu`,
    quick_gelu for `--quick-geglu`). With config.activation_func_clamp_value v, the gate is first clamped to at most
    v and up to [-v, v] (upstream's unfused GLU, as gpt-oss uses it).
    """
    units = intermediate.view(*intermediate.shape[:-1], intermediate.size(-1) // 2, 2)
    gate, up = units[..., 0], units[..., 1]
    clamp_value = config.activation_func_clamp_value
    if clamp_value is not None:
        gate = gate.clamp(max=clamp_value)
        up = up.clamp(min=-clamp_value, max=clamp_value)
    if config.glu_linear_offset:
        up = up + config.glu_linear_offset
    return config.activation_func(gate) * up
