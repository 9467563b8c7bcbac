"""Point-to-point transfers between adjacent pipeline stages: activations forward, their gradients backward.

Every exchange posts all of its sends and receives at once with `torch.distributed.batch_isend_irecv` and
waits for all of them before returning, so two stages that call matching functions (`send_forward` here,
`recv_forward` on the next stage; `send_forward_recv_backward` here, `send_backward_recv_forward` there)
never wait on each other in the wrong order, on gloo as on NCCL. Receive buffers are allocated from the shape
known up front (`[seq_length, micro_batch_size, hidden_size]`, the sequence split over context-parallel ranks
and, with sequence parallelism, over tensor-parallel ranks); with `variable_seq_lengths` the shapes are
exchanged first (also around the interleaved pipeline's ring). Peers are the global ranks of the next and
previous pipeline stage.
"""

import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.device_utils import get_device_for_group
from megatron.core.pipeline_parallel.model_access import schedule_setting
from megatron.core.timers import timed

SHAPE_RANK = 3  # activations between stages are [sequence, batch, hidden]


def pipeline_dtype(config):
    """The dtype of tensors sent between stages: `pipeline_dtype`, else `params_dtype`, else float32."""
    dtype = schedule_setting(config, "pipeline_dtype")
    if dtype is None:
        dtype = schedule_setting(config, "params_dtype") or torch.float32
    return dtype


def activation_shape(*, seq_length, micro_batch_size, config):
    """The shape of one microbatch's activation (and its gradient) as it travels between stages."""
    hidden_size = schedule_setting(config, "hidden_size")
    if hidden_size is None:
        raise ValueError(
            "pipeline parallelism needs the activation shape: give the model a config with hidden_size "
            "(model.config.hidden_size)"
        )
    local_seq_length = seq_length
    context_parallel_size = parallel_state.get_context_parallel_world_size()
    if schedule_setting(config, "sequence_parallel"):
        local_seq_length_divisor = context_parallel_size * parallel_state.get_tensor_model_parallel_world_size()
    else:
        local_seq_length_divisor = context_parallel_size
    if seq_length % local_seq_length_divisor != 0:
        raise ValueError(
            f"seq_length {seq_length} must be divisible by {local_seq_length_divisor} (the context-parallel size, "
            "times the tensor-parallel size with --sequence-parallel)"
        )
    local_seq_length //= local_seq_length_divisor
    return (local_seq_length, micro_batch_size, hidden_size)


def _check_outgoing(tensor, expected_shape, dtype, what):
    if tensor.dtype != dtype:
        raise TypeError(
            f"{what} has dtype {tensor.dtype} but pipeline stages exchange {dtype}; set the config's "
            "pipeline_dtype to the dtype the stages produce"
        )
    if expected_shape is not None and tuple(tensor.shape) != tuple(expected_shape):
        raise ValueError(
            f"{what} has shape {tuple(tensor.shape)} but the receiving stage expects {tuple(expected_shape)} "
            "([seq_length, micro_batch_size, hidden_size]); set variable_seq_lengths=True in the config if "
            "shapes change between microbatches"
        )


def _run_batched_p2p(*, send_prev, recv_prev, send_next, recv_next):
    """Post every given send/receive at once on the pipeline group, then wait for all of them."""
    group = parallel_state.get_pipeline_model_parallel_group()
    prev_rank = parallel_state.get_pipeline_model_parallel_prev_rank()
    next_rank = parallel_state.get_pipeline_model_parallel_next_rank()
    operations = []
    if send_prev is not None:
        operations.append(dist.P2POp(dist.isend, send_prev, prev_rank, group))
    if recv_prev is not None:
        operations.append(dist.P2POp(dist.irecv, recv_prev, prev_rank, group))
    if send_next is not None:
        operations.append(dist.P2POp(dist.isend, send_next, next_rank, group))
    if recv_next is not None:
        operations.append(dist.P2POp(dist.irecv, recv_next, next_rank, group))
    if not operations:
        return
    for request in dist.batch_isend_irecv(operations):
        request.wait()


def _exchange_shapes(*, tensor_send_next, tensor_send_prev, recv_prev, recv_next, device):
    """With variable sequence lengths the receiver learns each tensor's shape in a first, small exchange."""

    def shape_of(tensor):
        return None if tensor is None else torch.tensor(tensor.shape, dtype=torch.int64, device=device)

    def shape_buffer(wanted):
        return torch.empty(SHAPE_RANK, dtype=torch.int64, device=device) if wanted else None

    recv_prev_shape, recv_next_shape = shape_buffer(recv_prev), shape_buffer(recv_next)
    _run_batched_p2p(
        send_prev=shape_of(tensor_send_prev),
        recv_prev=recv_prev_shape,
        send_next=shape_of(tensor_send_next),
        recv_next=recv_next_shape,
    )
    as_shape = lambda shape: None if shape is None else tuple(shape.tolist())  # noqa: E731
    return as_shape(recv_prev_shape), as_shape(recv_next_shape)


def _outgoing(activation_to_next, grad_to_prev, tensor_shape, config):
    """(device, dtype, variable shapes?, the activation and gradient to send, checked, detached, contiguous)."""
    device = get_device_for_group(parallel_state.get_pipeline_model_parallel_group())
    dtype = pipeline_dtype(config)
    variable_shapes = schedule_setting(config, "variable_seq_lengths")
    expected_shape = None if variable_shapes else tensor_shape
    if activation_to_next is not None:
        _check_outgoing(activation_to_next, expected_shape, dtype, "the activation sent to the next stage")
        activation_to_next = activation_to_next.detach().contiguous()
    if grad_to_prev is not None:
        _check_outgoing(grad_to_prev, expected_shape, dtype, "the gradient sent to the previous stage")
        grad_to_prev = grad_to_prev.detach().contiguous()
    return device, dtype, variable_shapes, activation_to_next, grad_to_prev


def _communicate(*, tensor_send_next, tensor_send_prev, recv_prev, recv_next, tensor_shape, config):
    """One exchange with the neighbouring stages; returns (tensor from prev, tensor from next), None if not asked.

    The tensor received from the previous stage is an activation the local backward differentiates with
    respect to, so it comes back as a leaf with requires_grad=True; gradients from the next stage do not.
    """
    device, dtype, variable_shapes, tensor_send_next, tensor_send_prev = _outgoing(
        tensor_send_next, tensor_send_prev, tensor_shape, config)

    if variable_shapes:
        recv_prev_shape, recv_next_shape = _exchange_shapes(
            tensor_send_next=tensor_send_next,
            tensor_send_prev=tensor_send_prev,
            recv_prev=recv_prev,
            recv_next=recv_next,
            device=device,
        )
    else:
        recv_prev_shape = recv_next_shape = tensor_shape
    tensor_recv_prev = torch.empty(recv_prev_shape, dtype=dtype, device=device) if recv_prev else None
    tensor_recv_next = torch.empty(recv_next_shape, dtype=dtype, device=device) if recv_next else None

    _run_batched_p2p(
        send_prev=tensor_send_prev, recv_prev=tensor_recv_prev, send_next=tensor_send_next, recv_next=tensor_recv_next
    )
    if tensor_recv_prev is not None:
        tensor_recv_prev.requires_grad_()
    return tensor_recv_prev, tensor_recv_next


def recv_forward(tensor_shape, config):
    """The activation from the previous stage (None on the first stage)."""
    if parallel_state.is_pipeline_first_stage():
        return None
    with timed(schedule_setting(config, "timers"), "forward-recv", log_level=2):
        received, _ = _communicate(
            tensor_send_next=None,
            tensor_send_prev=None,
            recv_prev=True,
            recv_next=False,
            tensor_shape=tensor_shape,
            config=config,
        )
    return received


def recv_backward(tensor_shape, config):
    """The gradient of this stage's output from the next stage (None on the last stage)."""
    if parallel_state.is_pipeline_last_stage():
        return None
    with timed(schedule_setting(config, "timers"), "backward-recv", log_level=2):
        _, received = _communicate(
            tensor_send_next=None,
            tensor_send_prev=None,
            recv_prev=False,
            recv_next=True,
            tensor_shape=tensor_shape,
            config=config,
        )
    return received


def send_forward(output_tensor, config, tensor_shape=None):
    """Send this stage's activation to the next stage (nothing on the last stage)."""
    if parallel_state.is_pipeline_last_stage():
        return
    with timed(schedule_setting(config, "timers"), "forward-send", log_level=2):
        _communicate(
            tensor_send_next=output_tensor,
            tensor_send_prev=None,
            recv_prev=False,
            recv_next=False,
            tensor_shape=tensor_shape,
            config=config,
        )


def send_backward(input_tensor_grad, config, tensor_shape=None):
    """Send the gradient of this stage's input to the previous stage (nothing on the first stage)."""
    if parallel_state.is_pipeline_first_stage():
        return
    with timed(schedule_setting(config, "timers"), "backward-send", log_level=2):
        _communicate(
            tensor_send_next=None,
            tensor_send_prev=input_tensor_grad,
            recv_prev=False,
            recv_next=False,
            tensor_shape=tensor_shape,
            config=config,
        )


def send_forward_recv_backward(output_tensor, tensor_shape, config):
    """Send the activation to the next stage and receive its gradient in the same exchange."""
    if parallel_state.is_pipeline_last_stage():
        return None
    with timed(schedule_setting(config, "timers"), "forward-send-backward-recv", log_level=2):
        _, output_tensor_grad = _communicate(
            tensor_send_next=output_tensor,
            tensor_send_prev=None,
            recv_prev=False,
            recv_next=True,
            tensor_shape=tensor_shape,
            config=config,
        )
    return output_tensor_grad


def send_backward_recv_forward(input_tensor_grad, tensor_shape, config):
    """Send the input gradient to the previous stage and receive its next activation in the same exchange."""
    if parallel_state.is_pipeline_first_stage():
        return None
    with timed(schedule_setting(config, "timers"), "backward-send-forward-recv", log_level=2):
        input_tensor, _ = _communicate(
            tensor_send_next=None,
            tensor_send_prev=input_tensor_grad,
            recv_prev=True,
            recv_next=False,
            tensor_shape=tensor_shape,
            config=config,
        )
    return input_tensor


# ---------------------------------------------------------------------------------------------------------
# Interleaved pipeline: one exchange around the ring per step, sends completed later
# ---------------------------------------------------------------------------------------------------------

# Activations and gradients travel with their own tags, so a receive matches the next transfer of its kind even
# when an earlier send of the other kind to the same rank (two ranks: next == prev) is still pending. With
# variable_seq_lengths each transfer is preceded by one of its shape, under tags of its own.
ACTIVATION_TAG = 1
GRADIENT_TAG = 2
ACTIVATION_SHAPE_TAG = 3
GRADIENT_SHAPE_TAG = 4


def ring_exchange(*, activation_to_next, grad_to_prev, recv_activation, recv_grad, tensor_shape, config,
                  pending_sends):
    """One exchange of an interleaved pipeline with the next and previous rank of the ring (the last rank's
    next is the first); returns (activation from prev or None, gradient from next or None).

    Everything is posted at once, in the order send next, receive prev, send prev, receive next, so that
    exchanges that pair up match in posting order. Only the receives are waited for here: the send requests
    are appended to `pending_sends` (call `wait_for_sends` with it before the tensors are reused or the
    schedule returns), so a rank never waits for a neighbour to reach the step that consumes what it sent.
    With `variable_seq_lengths` the shapes go first, in an exchange of the same form.
    """
    device, dtype, variable_shapes, activation_to_next, grad_to_prev = _outgoing(
        activation_to_next, grad_to_prev, tensor_shape, config)
    activation_shape_in = grad_shape_in = tensor_shape
    if variable_shapes:
        def shape_of(tensor):
            return None if tensor is None else torch.tensor(tensor.shape, dtype=torch.int64, device=device)

        activation_shape_in, grad_shape_in = _post_ring_exchange(
            shape_of(activation_to_next), shape_of(grad_to_prev),
            torch.empty(SHAPE_RANK, dtype=torch.int64, device=device) if recv_activation else None,
            torch.empty(SHAPE_RANK, dtype=torch.int64, device=device) if recv_grad else None,
            (ACTIVATION_SHAPE_TAG, GRADIENT_SHAPE_TAG), pending_sends,
        )
        activation_shape_in, grad_shape_in = (None if shape is None else tuple(shape.tolist())
                                              for shape in (activation_shape_in, grad_shape_in))
    received_activation, received_grad = _post_ring_exchange(
        activation_to_next, grad_to_prev,
        torch.empty(activation_shape_in, dtype=dtype, device=device) if recv_activation else None,
        torch.empty(grad_shape_in, dtype=dtype, device=device) if recv_grad else None,
        (ACTIVATION_TAG, GRADIENT_TAG), pending_sends,
    )
    _drop_completed(pending_sends)
    if received_activation is not None:
        received_activation.requires_grad_()
    return received_activation, received_grad


def _post_ring_exchange(activation_to_next, grad_to_prev, activation_buffer, grad_buffer, tags, pending_sends):
    """Post the given sends and receives (None: not in this exchange) under (activation tag, gradient tag); wait
    for the receives, append the sends to `pending_sends`; returns the two receive buffers."""
    group = parallel_state.get_pipeline_model_parallel_group()
    next_rank = parallel_state.get_pipeline_model_parallel_next_rank()
    prev_rank = parallel_state.get_pipeline_model_parallel_prev_rank()
    activation_tag, gradient_tag = tags
    sends, receives = [], []
    if activation_to_next is not None:
        sends.append(dist.P2POp(dist.isend, activation_to_next, next_rank, group, activation_tag))
    if activation_buffer is not None:
        receives.append(dist.P2POp(dist.irecv, activation_buffer, prev_rank, group, activation_tag))
    if grad_to_prev is not None:
        sends.append(dist.P2POp(dist.isend, grad_to_prev, prev_rank, group, gradient_tag))
    if grad_buffer is not None:
        receives.append(dist.P2POp(dist.irecv, grad_buffer, next_rank, group, gradient_tag))
    operations = _posting_order(activation_to_next is not None, activation_buffer is not None,
                                grad_to_prev is not None, grad_buffer is not None, sends, receives)
    if operations:
        requests = dist.batch_isend_irecv(operations)
        for operation, request in zip(operations, requests):
            if operation.op is dist.isend:
                pending_sends.append((request, operation.tensor))
            else:
                request.wait()
    return activation_buffer, grad_buffer


def _posting_order(send_next, recv_prev, send_prev, recv_next, sends, receives):
    sends, receives = list(sends), list(receives)
    ordered = []
    for wanted, pool in ((send_next, sends), (recv_prev, receives), (send_prev, sends), (recv_next, receives)):
        if wanted:
            ordered.append(pool.pop(0))
    return ordered


def _drop_completed(pending_sends):
    pending_sends[:] = [(request, tensor) for request, tensor in pending_sends if not request.is_completed()]


def wait_for_sends(pending_sends):
    """Wait for every send `ring_exchange` left pending."""
    for request, _ in pending_sends:
        request.wait()
    pending_sends.clear()
