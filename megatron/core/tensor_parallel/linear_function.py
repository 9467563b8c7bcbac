"""The GEMM of the tensor-parallel linear layers outside FP8 regions: an autograd function that adds the weight
gradient into `weight.main_grad`, and upstream's `linear_with_grad_accumulation_and_async_allreduce` with the
tensor-parallel communication around it."""

import torch
import torch.nn.functional as F

from megatron.core import parallel_state
from megatron.core.fused_weight_grad import weight_grad_after_main_grad
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
)


class LinearWithGradAccumulation(torch.autograd.Function):
    """`input @ weight.T + bias` whose weight gradient is added straight into `weight.main_grad`.

    Used when `gradient_accumulation_fusion` is on and the data-parallel wrapper gave the weight a
    `main_grad` buffer. If the weight also has a `grad_added_to_main_grad` flag it is set and a zero
    gradient is returned (so gradient hooks still run); otherwise the weight gradient is None.
    """

    @staticmethod
    def forward(ctx, input_, weight, bias):
        ctx.save_for_backward(input_, weight)
        ctx.has_bias = bias is not None
        return F.linear(input_, weight, bias)

    @staticmethod
    def backward(ctx, grad_output):
        input_, weight = ctx.saved_tensors
        grad_input = grad_output.matmul(weight)
        grad_output_2d = grad_output.reshape(-1, grad_output.size(-1))
        input_2d = input_.reshape(-1, input_.size(-1))
        grad_weight = grad_output_2d.t().matmul(input_2d)
        if hasattr(weight, "main_grad"):
            weight.main_grad.add_(grad_weight.to(weight.main_grad.dtype))
            grad_weight = weight_grad_after_main_grad(weight)
        grad_bias = grad_output_2d.sum(dim=0) if ctx.has_bias else None
        return grad_input, grad_weight, grad_bias


def linear_with_grad_accumulation(input_, weight, bias, gradient_accumulation_fusion):
    """`F.linear`, or `LinearWithGradAccumulation` when `gradient_accumulation_fusion` and a weight gradient is
    due."""
    if gradient_accumulation_fusion and torch.is_grad_enabled() and weight.requires_grad:
        return LinearWithGradAccumulation.apply(input_, weight, bias)
    return F.linear(input_, weight, bias)


def linear_with_grad_accumulation_and_async_allreduce(input, weight, bias, gradient_accumulation_fusion,
                                                      allreduce_dgrad, sequence_parallel, grad_output_buffer=None,
                                                      wgrad_deferral_limit=None, async_grad_allreduce=None,
                                                      tp_group=None):
    """The GEMM of the tensor-parallel linear layers outside FP8 regions, with the communication upstream's
    function of this name does around it: under `sequence_parallel` the input (split along the sequence, dim 0)
    is all-gathered over the tensor-parallel group first (its gradient reduce-scattered back); with
    `allreduce_dgrad` the input gradient is all-reduced over the group. The weight gradient goes into
    `weight.main_grad` with `gradient_accumulation_fusion` (see `LinearWithGradAccumulation`).

    The layers look this function up in `megatron.core.tensor_parallel.layers` on every call, so a tool can wrap
    it there (modelopt's Megatron plugin quantizes the input and weight it receives). Deferred weight gradients
    (`grad_output_buffer`, `wgrad_deferral_limit`) and groups other than this rank's tensor-parallel group are not
    supported.
    """
    if grad_output_buffer is not None or wgrad_deferral_limit:
        raise NotImplementedError("deferred weight-gradient computation (grad_output_buffer) is not supported")
    if tp_group is not None and parallel_state.model_parallel_is_initialized() and \
            tp_group is not parallel_state.get_tensor_model_parallel_group():
        raise NotImplementedError("linear_with_grad_accumulation_and_async_allreduce runs over the tensor-parallel "
                                  "group of parallel_state only")
    if async_grad_allreduce is not None:  # upstream's older name of allreduce_dgrad
        allreduce_dgrad = allreduce_dgrad or async_grad_allreduce
    if sequence_parallel:
        input = gather_from_sequence_parallel_region(input, tensor_parallel_output_grad=True)
    elif allreduce_dgrad:
        input = copy_to_tensor_model_parallel_region(input)
    return linear_with_grad_accumulation(input, weight, bias, gradient_accumulation_fusion)
