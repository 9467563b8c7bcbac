"""Activation functions the MLP can use besides torch's own (`config.activation_func`)."""

import torch
import torch.nn.functional as F


def squared_relu(x: torch.Tensor) -> torch.Tensor:
    """relu(x) ** 2 (`--squared-relu`)."""
    return torch.pow(F.relu(x), 2)
