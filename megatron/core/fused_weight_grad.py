"""The weight gradient a linear layer hands autograd after adding it into `weight.main_grad` itself
(gradient-accumulation fusion), and how the data-parallel wrapper tells that placeholder apart.

The layer returns zeros (`weight_grad_after_main_grad`) so that autograd still runs the parameter's
post-accumulate-grad hook. Autograd sums them with the gradient of any other use of the weight (the embedding
lookup of a weight tied to the output layer) before the hook sees `param.grad`, so the hook must add `param.grad`
into `main_grad`, except when it is still the untouched placeholder (`is_untouched_placeholder`): then adding
would only read and write the whole `main_grad` to add zeros.
"""

import torch


def weight_grad_after_main_grad(weight):
    """What autograd receives for `weight` once its gradient went into `weight.main_grad`: zeros (marked as the
    placeholder) when the weight has a `grad_added_to_main_grad` flag (a data-parallel wrapper's parameter,
    whose gradient hook must run), which is set; else None."""
    if not hasattr(weight, "grad_added_to_main_grad"):
        return None
    weight.grad_added_to_main_grad = True
    zeros = torch.zeros_like(weight)
    # Known by its memory (held by autograd until the hook has seen it, so no other tensor can be there
    # meanwhile) and its version: a reference would keep zeros alive for a weight no hook clears.
    weight.fused_grad_placeholder = (zeros.data_ptr(), zeros._version)
    return zeros


def is_untouched_placeholder(param) -> bool:
    """Whether `param.grad` is the zeros `weight_grad_after_main_grad` returned, not replaced and not added to
    in place by autograd (no other use of the parameter contributed). Forgets the placeholder."""
    marker = getattr(param, "fused_grad_placeholder", None)
    if marker is None:
        return False
    param.fused_grad_placeholder = None
    address, version = marker
    grad = param.grad
    return grad is not None and grad.data_ptr() == address and grad._version == version
