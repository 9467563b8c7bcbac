"""`forward_backward_pipelining_with_interleaving`: the interleaved 1F1B schedule over a rank's model chunks.

The order of forwards, backwards and transfers is `interleaved_plan.InterleavedPlan` (pure arithmetic, see there);
this module runs it: each step's forward and backward on their model chunk (the virtual pipeline rank is set to
the chunk meanwhile, so `is_pipeline_first_stage()` / `is_pipeline_last_stage()` answer for the virtual stage),
then the step's exchange around the ring (`p2p_communication.ring_exchange`). Received activations and output
gradients queue per chunk, first in first out, as do the inputs and outputs awaiting their backward.

Data: `data_iterator` is one iterator per chunk (Megatron's convention) or a single iterator, which is then
shared: every chunk draws the same microbatches in the same order, each fetched once.

Gradient synchronisation is per chunk. `no_sync_func` may be one context manager per chunk (a list, as the
training loop installs) or one for all chunks; each chunk's context is left just before that chunk's last
backward, so a wrapper that overlaps its reduction with the backward (DDP / Megatron-FSDP with
`overlap_grad_reduce`) starts reducing that chunk while the other chunks still compute. `finalize_model_grads_func`
receives every chunk once all backwards are done, which finishes every chunk's reduction before the optimizer
step. Losses are reported (and returned) by the last virtual stage only: chunk v-1 of the last pipeline rank.

Upstream's explicit hooks (each one function for all chunks or a list of one per chunk, called with the chunk's
parameters): with `grad_sync_func`, every backward runs inside `no_sync_func` and a chunk's reduction is started
by `grad_sync_func` `r` backwards after that chunk's last one on pipeline rank `r` (so that the ranks start
reducing together), the chunks not reached by then after the last backward. `param_sync_func` (parameter
all-gathers) is called for chunks 0 and 1 before the first forward and for chunk `c + 1 > 1` `r` forwards
before chunk `c` runs its first microbatch.
"""

import collections
import contextlib

from megatron.core import parallel_state
from megatron.core.pipeline_parallel import microbatch, p2p_communication
from megatron.core.pipeline_parallel.interleaved_plan import InterleavedPlan
from megatron.core.pipeline_parallel.model_access import (
    get_model_config,
    refuse_upstream_schedule_options,
    schedule_setting,
)
from megatron.core.timers import timed


class SharedMicrobatches:
    """One iterator seen by every chunk as its own: chunk c's k-th `next()` is the source's k-th item."""

    def __init__(self, source, num_chunks):
        self._source = source
        self._queues = [collections.deque() for _ in range(num_chunks)]

    def view(self, chunk):
        return _ChunkView(self, chunk)

    def _next_for(self, chunk):
        if not self._queues[chunk]:
            item = next(self._source)
            for queue in self._queues:
                queue.append(item)
        return self._queues[chunk].popleft()


class _ChunkView:
    def __init__(self, shared, chunk):
        self._shared, self._chunk = shared, chunk

    def __iter__(self):
        return self

    def __next__(self):
        return self._shared._next_for(self._chunk)


def _per_chunk_iterators(data_iterator, num_chunks):
    if isinstance(data_iterator, (list, tuple)):
        if len(data_iterator) != num_chunks:
            raise ValueError(f"one data iterator per model chunk: got {len(data_iterator)} for {num_chunks} chunks")
        return list(data_iterator)
    if data_iterator is None:
        return [None] * num_chunks
    shared = SharedMicrobatches(data_iterator, num_chunks)
    return [shared.view(chunk) for chunk in range(num_chunks)]


def _per_chunk_hooks(config, name, num_chunks):
    """`config.<name>` as one function per chunk (None when unset)."""
    hook = schedule_setting(config, name)
    if hook is None:
        return None
    if isinstance(hook, (list, tuple)):
        if len(hook) != num_chunks:
            raise ValueError(f"{name}: one per model chunk, got {len(hook)} for {num_chunks} chunks")
        return list(hook)
    return [hook] * num_chunks


class _ChunkGradSync:
    """Holds gradient synchronisation back per chunk until the chunk's last backward."""

    def __init__(self, config, num_chunks):
        no_sync = schedule_setting(config, "no_sync_func")
        if isinstance(no_sync, (list, tuple)):
            if len(no_sync) != num_chunks:
                raise ValueError(f"no_sync_func: one per model chunk, got {len(no_sync)} for {num_chunks} chunks")
            self._funcs, self._shared = list(no_sync), False
        else:
            self._funcs, self._shared = [no_sync or contextlib.nullcontext] * num_chunks, True
        self._contexts = [None] * num_chunks

    def disable_all(self):
        for chunk in range(len(self._funcs) if not self._shared else 1):
            self._contexts[chunk] = self._funcs[chunk]()
            self._contexts[chunk].__enter__()

    def enable(self, chunk, remaining_chunks):
        """Before `chunk`'s last backward; with one shared context, only before the very last backward."""
        index = 0 if self._shared else chunk
        if self._shared and remaining_chunks > 1:
            return
        if self._contexts[index] is not None:
            self._contexts[index].__exit__(None, None, None)
            self._contexts[index] = None

    def enable_all(self):
        for index, context in enumerate(self._contexts):
            if context is not None:
                context.__exit__(None, None, None)
                self._contexts[index] = None

    @contextlib.contextmanager
    def opened_for(self, chunk, backwards_left):
        """Gradient synchronisation of `chunk` enabled while its `grad_sync_func` runs; a context shared by all
        chunks is entered again afterwards while backwards are left."""
        index = 0 if self._shared else chunk
        if self._contexts[index] is not None:
            self._contexts[index].__exit__(None, None, None)
            self._contexts[index] = None
        yield
        if self._shared and backwards_left:
            self._contexts[0] = self._funcs[0]()
            self._contexts[0].__enter__()


def forward_backward_pipelining_with_interleaving(
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
    """The interleaved 1F1B schedule over `model` (a list of this rank's chunks); returns the loss dicts on the
    last pipeline rank, else []."""
    refuse_upstream_schedule_options(
        "forward_backward_pipelining_with_interleaving", adjust_tensor_shapes_fn=adjust_tensor_shapes_fn,
        p2p_communicator=p2p_communicator, pg_collection=pg_collection,
    )
    if not isinstance(model, (list, tuple)) or len(model) < 2:
        raise ValueError("the interleaved schedule runs a list of at least two model chunks per pipeline rank")
    microbatch.check_collect_non_loss_data(collect_non_loss_data, forward_only)
    num_chunks = len(model)
    config = get_model_config(model[0])
    pipeline_size = parallel_state.get_pipeline_model_parallel_world_size()
    rank = parallel_state.get_pipeline_model_parallel_rank()
    plan = InterleavedPlan(pipeline_size, rank, num_chunks, num_microbatches,
                           getattr(config, "microbatch_group_size_per_vp_stage", None), forward_only)
    tensor_shape = p2p_communication.activation_shape(
        seq_length=seq_length, micro_batch_size=micro_batch_size, config=config
    )
    deallocate = schedule_setting(config, "deallocate_pipeline_outputs")
    iterators = _per_chunk_iterators(data_iterator, num_chunks)
    received_inputs = [collections.deque() for _ in range(num_chunks)]
    received_grads = [collections.deque() for _ in range(num_chunks)]
    awaiting_backward = [collections.deque() for _ in range(num_chunks)]
    pending_sends = []
    forward_data_store = []
    total_num_tokens = microbatch.zero_token_count()
    grad_sync = _ChunkGradSync(config, num_chunks)
    grad_sync_funcs = _per_chunk_hooks(config, "grad_sync_func", num_chunks)
    param_sync_funcs = _per_chunk_hooks(config, "param_sync_func", num_chunks)
    if not forward_only:
        grad_sync.disable_all()
    chunks_left = set(range(num_chunks))
    chunks_synced = set()  # chunks whose grad_sync_func was called
    previous_virtual_rank = parallel_state.get_virtual_pipeline_model_parallel_rank()
    if param_sync_funcs is not None:
        for chunk in (0, 1):
            param_sync_funcs[chunk](model[chunk].parameters())

    def sync_params_ahead(k):
        # Forward k + rank runs a chunk's first microbatch: gather the next chunk's parameters now.
        ahead = k + rank
        if param_sync_funcs is None or ahead >= plan.total or plan.forward_of(ahead)[0] != 0:
            return
        next_chunk = plan.forward_of(ahead)[1] + 1
        if 1 < next_chunk < num_chunks:
            param_sync_funcs[next_chunk](model[next_chunk].parameters())

    def sync_grads_behind(k):
        # Backward k - rank was a chunk's last microbatch: start that chunk's reduction now.
        behind = k - rank
        if grad_sync_funcs is None or behind < 0 or plan.backward_of(behind)[0] != num_microbatches - 1:
            return
        chunk = plan.backward_of(behind)[1]
        with grad_sync.opened_for(chunk, backwards_left=k + 1 < plan.total):
            grad_sync_funcs[chunk](model[chunk].parameters())
        chunks_synced.add(chunk)

    def run_forward(k):
        nonlocal total_num_tokens
        sync_params_ahead(k)
        _, chunk = plan.forward_of(k)
        parallel_state.set_virtual_pipeline_model_parallel_rank(chunk)
        input_tensor = None if plan.is_first_virtual_stage(chunk) else received_inputs[chunk].popleft()
        is_last_stage = plan.is_last_virtual_stage(chunk)
        output_tensor, num_tokens = microbatch.forward_step(
            forward_step_func, iterators[chunk], model[chunk], num_microbatches, input_tensor, forward_data_store,
            config, collect_non_loss_data, is_last_stage=is_last_stage, forward_only=forward_only,
        )  # fmt: skip
        total_num_tokens = total_num_tokens + num_tokens
        if not forward_only:
            awaiting_backward[chunk].append((input_tensor, output_tensor))
        return output_tensor, is_last_stage

    def run_backward(k):
        _, chunk = plan.backward_of(k)
        parallel_state.set_virtual_pipeline_model_parallel_rank(chunk)
        if plan.is_last_backward_of_chunk(k) and grad_sync_funcs is None:
            chunks_left.discard(chunk)
            grad_sync.enable(chunk, remaining_chunks=len(chunks_left) + 1)
        input_tensor, output_tensor = awaiting_backward[chunk].popleft()
        output_tensor_grad = None if plan.is_last_virtual_stage(chunk) else received_grads[chunk].popleft()
        input_tensor_grad = microbatch.backward_step(input_tensor, output_tensor, output_tensor_grad, config)
        sync_grads_behind(k)
        return input_tensor_grad

    try:
        for step in plan.steps:
            activation_to_next = grad_to_prev = None
            if step.forward is not None:
                output_tensor, is_last_stage = run_forward(step.forward)
                if step.send_forward:
                    activation_to_next = output_tensor
            if step.backward is not None:
                input_tensor_grad = run_backward(step.backward)
                if step.send_backward:
                    grad_to_prev = input_tensor_grad
            with timed(schedule_setting(config, "timers"), "forward-backward-send-forward-backward-recv", log_level=2):
                received_activation, received_grad = p2p_communication.ring_exchange(
                    activation_to_next=activation_to_next,
                    grad_to_prev=grad_to_prev,
                    recv_activation=step.recv_forward_chunk is not None,
                    recv_grad=step.recv_backward_chunk is not None,
                    tensor_shape=tensor_shape,
                    config=config,
                    pending_sends=pending_sends,
                )
            if activation_to_next is not None and not forward_only:
                microbatch.deallocate_output_tensor(activation_to_next, deallocate)
            if received_activation is not None:
                received_inputs[step.recv_forward_chunk].append(received_activation)
            if received_grad is not None:
                received_grads[step.recv_backward_chunk].append(received_grad)
        p2p_communication.wait_for_sends(pending_sends)
    finally:
        parallel_state.set_virtual_pipeline_model_parallel_rank(previous_virtual_rank)
    if not forward_only:
        grad_sync.enable_all()
        for chunk in range(num_chunks):
            if grad_sync_funcs is not None and chunk not in chunks_synced:
                grad_sync_funcs[chunk](model[chunk].parameters())
        finalize = schedule_setting(config, "finalize_model_grads_func")
        if finalize is not None:
            per_token_loss = schedule_setting(config, "calculate_per_token_loss")
            finalize(list(model), total_num_tokens if per_token_loss else None)
    return forward_data_store if plan.is_last_rank else []
