"""Forward/backward schedules over the microbatches of one global batch.

`get_forward_backward_func()` picks the schedule for this rank's pipeline layout:
- `forward_backward_no_pipelining` (one stage): forward and backward each microbatch in turn, accumulating
  gradients;
- `forward_backward_pipelining_with_interleaving` (several model chunks per stage: virtual pipeline stages):
  interleaved 1F1B, in `interleaved_schedule.py`;
- `forward_backward_pipelining_without_interleaving` (several stages, one model chunk each): the 1F1B
  schedule. Stage `r` of `p` first runs `p - r - 1` warm-up forwards, then alternates one forward with one
  backward, then drains the remaining backwards, so at most `p - r` microbatches' activations are alive.

All take Megatron's keyword arguments and return the loss dicts of every microbatch on the last stage
(an empty list elsewhere). Each microbatch's loss is divided by `num_microbatches` before its backward, so the
accumulated gradients are those of the mean loss over the batch; with `calculate_per_token_loss` the loss
sums are back-propagated unscaled and `finalize_model_grads_func` receives the total token count to divide by.
With `collect_non_loss_data=True` (evaluation, `forward_only=True`) the last stage keeps what each
microbatch's `loss_func(output_tensor, non_loss_data=True)` returns, as it is, and returns that list instead.
`decoder_seq_length` and `first_val_step` are accepted for call-site compatibility and unused (there are no
encoder-decoder models here); upstream's `adjust_tensor_shapes_fn`, `p2p_communicator` and `pg_collection` are
accepted as None and refused by name otherwise (a single stage exchanges no activations, so
`forward_backward_no_pipelining` ignores the first two).

Hooks come from the model's config (see `model_access`): `no_sync_func` is a context manager that holds
back gradient synchronisation during every backward but the last microbatch's; `finalize_model_grads_func(
[model], num_tokens)` finishes the step's gradients (data-parallel reduction, shared embeddings, ...) when the
schedule computed gradients. As upstream, 1F1B with a `grad_sync_func(parameters)` keeps every stage but the
first inside `no_sync_func` for its last backward too and then calls `grad_sync_func(model.parameters())` to
start the reduction (the first stage's last backward starts it, as without the hook); the single-stage schedule
does not call it.
"""

import contextlib

from megatron.core import parallel_state
from megatron.core.pipeline_parallel import p2p_communication
from megatron.core.pipeline_parallel.microbatch import (
    zero_token_count,
    backward_step,
    check_collect_non_loss_data,
    deallocate_output_tensor,
    forward_step,
)
from megatron.core.pipeline_parallel.model_access import (
    get_model_config,
    refuse_upstream_schedule_options,
    schedule_setting,
    single_model_chunk,
)
from megatron.core.pipeline_parallel import tensor_shapes as _tensor_shapes


get_tensor_shapes = _tensor_shapes.get_tensor_shapes  # upstream's name in this module


def get_forward_backward_func(pp_size=None, vp_size=None):
    """The schedule for this rank: interleaved 1F1B with several model chunks per pipeline rank (virtual
    stages), 1F1B with several pipeline stages, else no pipelining. `pp_size` / `vp_size` (upstream's keywords)
    override the pipeline and virtual pipeline sizes read from parallel_state."""
    if pp_size is None:
        pp_size = parallel_state.get_pipeline_model_parallel_world_size()
    if vp_size is None:
        vp_size = parallel_state.get_virtual_pipeline_model_parallel_world_size()
    if pp_size > 1:
        if (vp_size or 1) > 1:
            from megatron.core.pipeline_parallel.interleaved_schedule import (
                forward_backward_pipelining_with_interleaving,
            )

            return forward_backward_pipelining_with_interleaving
        return forward_backward_pipelining_without_interleaving
    return forward_backward_no_pipelining


# ---------------------------------------------------------------------------------------------------------
# Gradient synchronisation around the backwards
# ---------------------------------------------------------------------------------------------------------


class _GradSyncControl:
    """Holds `no_sync_func()` open from the first backward until the last microbatch's backward."""

    def __init__(self, config):
        self._no_sync_func = schedule_setting(config, "no_sync_func") or contextlib.nullcontext
        self._context = None

    def disable(self):
        if self._context is None:
            self._context = self._no_sync_func()
            self._context.__enter__()

    def enable(self):
        if self._context is not None:
            self._context.__exit__(None, None, None)
            self._context = None


def _finalize(model, config, total_num_tokens):
    finalize_model_grads_func = schedule_setting(config, "finalize_model_grads_func")
    if finalize_model_grads_func is not None:
        per_token_loss = schedule_setting(config, "calculate_per_token_loss")
        finalize_model_grads_func([model], total_num_tokens if per_token_loss else None)


def _grad_sync_func(config):
    """`config.grad_sync_func` for one model chunk: the function, or the single entry of a one-element list."""
    grad_sync_func = schedule_setting(config, "grad_sync_func")
    if isinstance(grad_sync_func, (list, tuple)):
        if len(grad_sync_func) != 1:
            raise ValueError(f"grad_sync_func: one per model chunk, got {len(grad_sync_func)} for 1 chunk")
        grad_sync_func = grad_sync_func[0]
    return grad_sync_func


def _prepare(model, data_iterator, num_microbatches, collect_non_loss_data=False, forward_only=False):
    check_collect_non_loss_data(collect_non_loss_data, forward_only)
    model = single_model_chunk(model)
    if isinstance(data_iterator, (list, tuple)):
        if len(data_iterator) != 1:
            raise ValueError(f"one data iterator per model chunk: got {len(data_iterator)} for 1 chunk")
        data_iterator = data_iterator[0]
    if num_microbatches < 1:
        raise ValueError(f"num_microbatches must be at least 1, got {num_microbatches}")
    config = get_model_config(model)
    return model, data_iterator, config


# ---------------------------------------------------------------------------------------------------------
# Schedules
# ---------------------------------------------------------------------------------------------------------


def forward_backward_no_pipelining(
    *,
    forward_step_func,
    data_iterator,
    model,
    num_microbatches,
    seq_length=None,
    micro_batch_size=None,
    decoder_seq_length=None,
    forward_only=False,
    collect_non_loss_data=False,
    first_val_step=None,
    adjust_tensor_shapes_fn=None,
    p2p_communicator=None,
    pg_collection=None,
):
    """Forward and backward each microbatch in turn on a single stage; returns the loss dicts.
    `adjust_tensor_shapes_fn` and `p2p_communicator` are unused (a single stage exchanges no activations)."""
    refuse_upstream_schedule_options("forward_backward_no_pipelining", pg_collection=pg_collection)
    model, data_iterator, config = _prepare(model, data_iterator, num_microbatches, collect_non_loss_data,
                                            forward_only)
    forward_data_store = []
    total_num_tokens = zero_token_count()
    grad_sync = _GradSyncControl(config)
    if not forward_only:
        grad_sync.disable()
    for microbatch in range(num_microbatches):
        if not forward_only and microbatch == num_microbatches - 1:
            grad_sync.enable()
        output_tensor, num_tokens = forward_step(
            forward_step_func, data_iterator, model, num_microbatches, None, forward_data_store, config,
            collect_non_loss_data, is_last_stage=True, forward_only=forward_only,
        )  # fmt: skip
        total_num_tokens = total_num_tokens + num_tokens
        if not forward_only:
            backward_step(None, output_tensor, None, config)
    if not forward_only:
        _finalize(model, config, total_num_tokens)
    return forward_data_store


def forward_backward_pipelining_without_interleaving(
    *,
    forward_step_func,
    data_iterator,
    model,
    num_microbatches,
    seq_length,
    micro_batch_size,
    decoder_seq_length=None,
    forward_only=False,
    collect_non_loss_data=False,
    first_val_step=None,
    adjust_tensor_shapes_fn=None,
    p2p_communicator=None,
    pg_collection=None,
):
    """The 1F1B schedule for one model chunk per stage; returns the loss dicts on the last stage, else []."""
    refuse_upstream_schedule_options(
        "forward_backward_pipelining_without_interleaving", adjust_tensor_shapes_fn=adjust_tensor_shapes_fn,
        p2p_communicator=p2p_communicator, pg_collection=pg_collection,
    )
    model, data_iterator, config = _prepare(model, data_iterator, num_microbatches, collect_non_loss_data,
                                            forward_only)
    is_last_stage = parallel_state.is_pipeline_last_stage()
    deallocate = schedule_setting(config, "deallocate_pipeline_outputs")
    tensor_shape = p2p_communication.activation_shape(
        seq_length=seq_length, micro_batch_size=micro_batch_size, config=config
    )
    pipeline_rank = parallel_state.get_pipeline_model_parallel_rank()
    pipeline_size = parallel_state.get_pipeline_model_parallel_world_size()
    # As upstream: with a grad_sync_func, stages after the first start their reduction through it after the
    # cool-down (in the pipeline bubble), not from their last backward.
    grad_sync_func = _grad_sync_func(config)
    sync_in_last_backward = grad_sync_func is None or pipeline_rank == 0
    num_warmup_microbatches = min(pipeline_size - pipeline_rank - 1, num_microbatches)
    num_steady_microbatches = num_microbatches - num_warmup_microbatches

    forward_data_store = []
    total_num_tokens = zero_token_count()
    grad_sync = _GradSyncControl(config)
    if not forward_only:
        grad_sync.disable()
    # Inputs and outputs of microbatches whose backward is still to come, oldest first.
    pending_inputs, pending_outputs = [], []

    def run_forward(input_tensor):
        nonlocal total_num_tokens
        output_tensor, num_tokens = forward_step(
            forward_step_func, data_iterator, model, num_microbatches, input_tensor, forward_data_store, config,
            collect_non_loss_data, is_last_stage=is_last_stage, forward_only=forward_only,
        )  # fmt: skip
        total_num_tokens = total_num_tokens + num_tokens
        return output_tensor

    def remember(input_tensor, output_tensor):
        pending_inputs.append(input_tensor)
        pending_outputs.append(output_tensor)

    def run_oldest_backward(output_tensor_grad, is_last_backward):
        if is_last_backward and sync_in_last_backward:
            grad_sync.enable()
        return backward_step(pending_inputs.pop(0), pending_outputs.pop(0), output_tensor_grad, config)

    # Warm-up: forwards only, filling the pipeline.
    for _ in range(num_warmup_microbatches):
        input_tensor = p2p_communication.recv_forward(tensor_shape, config)
        output_tensor = run_forward(input_tensor)
        p2p_communication.send_forward(output_tensor, config, tensor_shape)
        if not forward_only:
            remember(input_tensor, output_tensor)
            if not is_last_stage:
                deallocate_output_tensor(output_tensor, deallocate)

    # Steady state: one forward, one backward.
    if num_steady_microbatches > 0:
        input_tensor = p2p_communication.recv_forward(tensor_shape, config)
    for step in range(num_steady_microbatches):
        is_last_steady_step = step == num_steady_microbatches - 1
        output_tensor = run_forward(input_tensor)
        if forward_only:
            p2p_communication.send_forward(output_tensor, config, tensor_shape)
            if not is_last_steady_step:
                input_tensor = p2p_communication.recv_forward(tensor_shape, config)
            continue
        output_tensor_grad = p2p_communication.send_forward_recv_backward(output_tensor, tensor_shape, config)
        remember(input_tensor, output_tensor)
        if not is_last_stage:
            deallocate_output_tensor(output_tensor, deallocate)
        input_tensor_grad = run_oldest_backward(
            output_tensor_grad, is_last_backward=is_last_steady_step and num_warmup_microbatches == 0
        )
        if is_last_steady_step:
            p2p_communication.send_backward(input_tensor_grad, config, tensor_shape)
        else:
            input_tensor = p2p_communication.send_backward_recv_forward(input_tensor_grad, tensor_shape, config)

    # Cool-down: the backwards of the warm-up microbatches.
    if not forward_only:
        for step in range(num_warmup_microbatches):
            output_tensor_grad = p2p_communication.recv_backward(tensor_shape, config)
            input_tensor_grad = run_oldest_backward(
                output_tensor_grad, is_last_backward=step == num_warmup_microbatches - 1
            )
            p2p_communication.send_backward(input_tensor_grad, config, tensor_shape)
        grad_sync.enable()
        if not sync_in_last_backward:
            grad_sync_func(model.parameters())
        _finalize(model, config, total_num_tokens)
    return forward_data_store if is_last_stage else []
