"""One microbatch of a pipeline schedule: its forward (with the loss on the last stage), its backward, and
releasing an activation once it was sent. Every schedule (`schedules.py`, `interleaved_schedule.py`) runs its
microbatches through these."""

import torch
import torch.distributed as dist

from megatron.core.device_utils import get_current_device
from megatron.core.pipeline_parallel.model_access import schedule_setting, set_input_tensor
from megatron.core.timers import timed
from megatron.core.transformer.context_parallel.loss import context_parallel_loss
from megatron.core.transformer.moe.moe_utils import set_aux_loss_backward_scale


def _context_parallel_group():
    """The context-parallel group when there is one of more than one rank, else None."""
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized() or parallel_state.get_context_parallel_world_size() == 1:
        return None
    return parallel_state.get_context_parallel_group()


def _unpack_loss(outputs):
    """(loss, num_tokens or None, reported) from a loss_func's 2-tuple or per-token 3-tuple."""
    if not isinstance(outputs, (tuple, list)) or len(outputs) not in (2, 3):
        got = type(outputs).__name__
        if isinstance(outputs, (tuple, list)):
            got += f" of length {len(outputs)}"
        raise ValueError(
            "loss_func must return (loss, {'lm loss': value}) or (loss_sum, num_tokens, {'lm loss': tensor([sum, "
            f"count])}}), got {got}"
        )
    if len(outputs) == 3:
        return outputs[0], outputs[1], outputs[2]
    return outputs[0], None, outputs[1]


def check_collect_non_loss_data(collect_non_loss_data, forward_only):
    """`collect_non_loss_data=True` keeps the loss function's non-loss outputs, which have no backward."""
    if collect_non_loss_data and not forward_only:
        raise ValueError("collect_non_loss_data=True keeps what loss_func(output_tensor, non_loss_data=True) returns "
                         "instead of a loss, so there is nothing to back-propagate: pass forward_only=True with it")


def forward_step(forward_step_func, data_iterator, model, num_microbatches, input_tensor, forward_data_store, config,
                 collect_non_loss_data=False, is_last_stage=True, forward_only=False):
    """One microbatch forward, timed as `forward-compute` (level 2) when the config carries timers; see
    `_forward_step`."""
    with timed(schedule_setting(config, "timers"), "forward-compute", log_level=2):
        return _forward_step(forward_step_func, data_iterator, model, num_microbatches, input_tensor,
                             forward_data_store, config, collect_non_loss_data, is_last_stage, forward_only)


def _forward_step(
    forward_step_func,
    data_iterator,
    model,
    num_microbatches,
    input_tensor,
    forward_data_store,
    config,
    collect_non_loss_data=False,
    is_last_stage=True,
    forward_only=False,
):
    """Run one microbatch forward; returns (output tensor or scaled loss, number of tokens in its loss or 0).

    On the last stage the loss function runs here: its report goes to `forward_data_store`, and the returned
    tensor is the loss ready for backward (divided by `num_microbatches`, and by the token count, at least 1, for
    a 3-tuple loss, unless `calculate_per_token_loss`). Elsewhere the stage's output activation is returned.
    """
    set_input_tensor(model, input_tensor)
    set_aux_loss_backward_scale(config, num_microbatches)  # MoE auxiliary losses: scaled like this loss
    output_tensor, loss_func = forward_step_func(data_iterator, model)
    num_tokens = 0
    if not is_last_stage:
        return output_tensor, num_tokens
    if collect_non_loss_data:
        forward_data_store.append(loss_func(output_tensor, non_loss_data=True))
        return output_tensor, num_tokens

    loss, loss_num_tokens, reported = _unpack_loss(loss_func(output_tensor))
    per_token_loss = schedule_setting(config, "calculate_per_token_loss")
    if per_token_loss and loss_num_tokens is None and not forward_only:
        raise ValueError(
            "calculate_per_token_loss (--calculate-per-token-loss) divides the gradients by the tokens the losses "
            "counted, so loss_func must return the 3-tuple (loss_sum, num_tokens, {'lm loss': tensor([sum, "
            "count])}), got a (loss, report) 2-tuple; return the 3-tuple or drop the flag"
        )
    cp_group = _context_parallel_group()
    if loss_num_tokens is not None:
        # Under context parallelism this rank's sum and count cover its part of each sequence: the loss becomes
        # the mean over the whole sequence (context_parallel_loss; with per-token loss they go out as they are).
        loss, loss_num_tokens = context_parallel_loss(loss, torch.as_tensor(loss_num_tokens, device=loss.device),
                                                      cp_group, per_token_loss)
        # int64 on every stage, so that stages without a loss (count 0) can exchange counts with the last one.
        num_tokens = loss_num_tokens.detach().round().to(torch.int64)
        if not per_token_loss:
            # As upstream, a microbatch whose tokens are all masked gives a zero loss, not 0 / 0.
            loss = loss / loss_num_tokens.clamp(min=1)
    elif cp_group is not None:
        # A (loss, report) loss function gives this rank's loss of the whole sequence, as upstream's
        # does by all-reducing its sum and count over the CP ranks: the gradient reduction averages over DP x CP,
        # so each rank back-propagates CP times it (upstream's scaling), and the average is that loss's gradient.
        loss = loss * dist.get_world_size(cp_group)
    if not per_token_loss:
        loss = loss / num_microbatches
    forward_data_store.append(reported)
    return loss, num_tokens


def backward_step(input_tensor, output_tensor, output_tensor_grad, config):
    """Back-propagate one microbatch; returns the gradient of its input activation (None on the first stage).

    On the last stage `output_tensor` is the loss and `output_tensor_grad` is None; the config's
    `grad_scale_func` (fp16 loss scaling) is applied to the loss first.
    """
    with timed(schedule_setting(config, "timers"), "backward-compute", log_level=2):
        return _backward_step(input_tensor, output_tensor, output_tensor_grad, config)


def _backward_step(input_tensor, output_tensor, output_tensor_grad, config):
    if input_tensor is not None:
        input_tensor.retain_grad()
    if output_tensor_grad is None:
        grad_scale_func = schedule_setting(config, "grad_scale_func")
        if grad_scale_func is not None:
            output_tensor = grad_scale_func(output_tensor)
    if output_tensor.requires_grad:
        if schedule_setting(config, "deallocate_pipeline_outputs"):
            _backward_from_released_output(output_tensor, output_tensor_grad)
        else:
            torch.autograd.backward(output_tensor, grad_tensors=output_tensor_grad)
    elif output_tensor_grad is not None:
        raise RuntimeError(
            "this stage's output does not require grad, so the gradient from the next stage cannot flow back; "
            "the stage must compute its output from its parameters or its input tensor"
        )
    if input_tensor is None:
        return None
    if input_tensor.grad is None:
        # The stage ignored its input: its gradient is zero.
        return torch.zeros_like(input_tensor)
    return input_tensor.grad


# ---------------------------------------------------------------------------------------------------------
# Releasing activations that were already sent
# ---------------------------------------------------------------------------------------------------------


def deallocate_output_tensor(output_tensor, deallocate_pipeline_outputs):
    """Free the data of an activation that was sent to the next stage, keeping its autograd graph.

    Only the graph is needed for this stage's backward, so the tensor's storage is swapped for a one-element
    placeholder; `_backward_from_released_output` then runs the backward without torch's output-shape check.
    Views are left alone because their storage belongs to another tensor.
    """
    if not deallocate_pipeline_outputs or output_tensor is None or output_tensor._base is not None:
        return
    output_tensor.data = torch.empty((1,), device=output_tensor.device, dtype=output_tensor.dtype)


def _backward_from_released_output(output_tensor, output_tensor_grad):
    """`torch.autograd.backward` for an output whose data may have been released after sending.

    The autograd engine only needs the graph and the incoming gradient; the shape comparison between output
    and gradient is a Python-side check that a released output would fail, so the engine is called directly.
    """
    if output_tensor_grad is None:  # the last stage's loss, never released
        torch.autograd.backward(output_tensor)
        return
    torch.autograd.Variable._execution_engine.run_backward(
        tensors=(output_tensor,),
        grad_tensors=(output_tensor_grad,),
        keep_graph=False,
        create_graph=False,
        inputs=(),
        allow_unreachable=True,
        accumulate_grad=True,
    )


def zero_token_count():
    """Token counts live on the compute device so that `finalize_model_grads_func` can reduce them."""
    return torch.zeros((), dtype=torch.int64, device=get_current_device())
