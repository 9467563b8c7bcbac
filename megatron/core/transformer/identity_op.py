"""Modules that stand in for an optional submodule of a layer spec (upstream names)."""

import torch


class IdentityOp(torch.nn.Module):
    """Returns its first input unchanged, whatever else it is called with (a layer spec's "no module here")."""

    def __init__(self, *args, **kwargs):
        super().__init__()

    def forward(self, x, *args, **kwargs):
        return x


class IdentityFuncOp(IdentityOp):
    """Returns the identity function: stands in for a submodule whose caller expects a function back."""

    def forward(self, *args, **kwargs):
        return super().forward
