"""Pipelined runs of a toy Linear stack must equal the whole model on one rank with gradient accumulation."""

import contextlib

import pytest
import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.pipeline_parallel.schedules import (
    forward_backward_no_pipelining,
    forward_backward_pipelining_without_interleaving,
)
from tests.unit_tests.multiprocess_harness import run_on_ranks
from tests.unit_tests.pipeline_parallel import toy_stages
from tests.unit_tests.pipeline_parallel.toy_stages import (
    MICRO_BATCH_SIZE,
    SEQ_LENGTH,
    ToyConfig,
    Wrapper,
    build_stage,
    make_batches,
    max_grad_error,
    reference_losses_and_grads,
)

TOLERANCE = 1e-6

LOSS_KINDS = {
    # loss kind -> (forward_step_func, calculate_per_token_loss)
    "mean": (toy_stages.forward_step_mean_loss, False),
    "token_mean_per_microbatch": (toy_stages.forward_step_token_loss, False),
    "token_mean_global": (toy_stages.forward_step_token_loss, True),
}


def _reported_loss(loss_kind, reported):
    value = reported["lm loss"]
    if loss_kind == "token_mean_per_microbatch":
        return (value[0] / value[1]).item()
    if loss_kind == "token_mean_global":
        return value[0].item()
    return value.item()


def _run_schedule_against_reference(pipeline_size, num_microbatches, options):
    """Run the schedule for this rank's stage; returns what the test compares with the reference."""
    loss_kind = options.get("loss_kind", "mean")
    forward_only = options.get("forward_only", False)
    grad_scale = options.get("grad_scale", 1.0)
    seq_lengths = options.get("seq_lengths")
    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=pipeline_size)
    stage = parallel_state.get_pipeline_model_parallel_rank()
    data_parallel_rank = parallel_state.get_data_parallel_rank()
    data_parallel_size = parallel_state.get_data_parallel_world_size()
    forward_step_func, per_token_loss = LOSS_KINDS[loss_kind]

    events = {"no_sync_enters": 0, "backwards_in_no_sync": 0, "backwards_outside_no_sync": 0, "finalize_calls": []}
    in_no_sync = [False]

    @contextlib.contextmanager
    def no_sync():
        events["no_sync_enters"] += 1
        in_no_sync[0] = True
        try:
            yield
        finally:
            in_no_sync[0] = False

    def finalize_model_grads(model_chunks, num_tokens):
        events["finalize_calls"].append(None if num_tokens is None else num_tokens.item())
        parameters = [p for chunk in model_chunks for p in chunk.parameters()]
        data_parallel_group = parallel_state.get_data_parallel_group()
        if num_tokens is not None:
            # Only the last stage counted tokens: share its count with the other stages, sum over replicas.
            num_tokens = num_tokens.clone()
            dist.broadcast(
                num_tokens,
                src=parallel_state.get_pipeline_model_parallel_last_rank(),
                group=parallel_state.get_pipeline_model_parallel_group(),
            )
            dist.all_reduce(num_tokens, group=data_parallel_group)
        for parameter in parameters:
            dist.all_reduce(parameter.grad, group=data_parallel_group)
            parameter.grad /= data_parallel_size if num_tokens is None else num_tokens

    config = ToyConfig(
        no_sync_func=no_sync,
        finalize_model_grads_func=finalize_model_grads,
        calculate_per_token_loss=per_token_loss,
        deallocate_pipeline_outputs=options.get("deallocate", False),
        variable_seq_lengths=seq_lengths is not None,
        grad_scale_func=(lambda loss: loss * grad_scale) if grad_scale != 1.0 else None,
    )
    stage_module = build_stage(stage, pipeline_size, config)

    def count_backward(grad):
        events["backwards_in_no_sync" if in_no_sync[0] else "backwards_outside_no_sync"] += 1

    stage_module.layers[0].weight.register_hook(count_backward)
    model = Wrapper(stage_module) if options.get("wrap") else stage_module

    sent_outputs = []

    def recording_forward_step(data_iterator, model):
        output, loss_func = forward_step_func(data_iterator, model)
        sent_outputs.append(output)
        return output, loss_func

    all_batches = make_batches(num_microbatches * data_parallel_size, seq_lengths=seq_lengths)
    first = data_parallel_rank * num_microbatches
    local_batches = all_batches[first : first + num_microbatches]
    schedule = get_forward_backward_func()
    reported = schedule(
        forward_step_func=recording_forward_step,
        data_iterator=iter(local_batches),
        model=[model],
        num_microbatches=num_microbatches,
        seq_length=SEQ_LENGTH,
        micro_batch_size=MICRO_BATCH_SIZE,
        forward_only=forward_only,
    )

    reference_losses, reference_grads = reference_losses_and_grads(all_batches, loss_kind)
    if not forward_only and grad_scale != 1.0:
        for parameter in stage_module.parameters():
            parameter.grad /= grad_scale
    return {
        "stage": stage,
        "schedule": schedule.__name__,
        "losses": [_reported_loss(loss_kind, item) for item in reported],
        "reference_losses": reference_losses[first : first + num_microbatches],
        "grad_error": None if forward_only else max_grad_error(stage_module, reference_grads, stage, pipeline_size),
        "has_grads": any(p.grad is not None for p in stage_module.parameters()),
        "sent_output_numels": [output.numel() for output in sent_outputs],
        **events,
    }


def _check_against_reference(results, pipeline_size, num_microbatches, forward_only=False):
    for result in results:
        is_last_stage = result["stage"] == pipeline_size - 1
        assert result["schedule"] == "forward_backward_pipelining_without_interleaving"
        if is_last_stage:
            assert len(result["losses"]) == num_microbatches
            assert result["losses"] == pytest.approx(result["reference_losses"], abs=TOLERANCE, rel=TOLERANCE)
        else:
            assert result["losses"] == []
        if forward_only:
            assert not result["has_grads"]
            assert result["no_sync_enters"] == 0 and result["finalize_calls"] == []
        else:
            assert result["grad_error"] < TOLERANCE, result
            assert result["no_sync_enters"] == 1
            assert result["backwards_in_no_sync"] == num_microbatches - 1
            assert result["backwards_outside_no_sync"] == 1
            assert len(result["finalize_calls"]) == 1


@pytest.mark.parametrize(
    "world_size, pipeline_size, num_microbatches, loss_kind",
    [
        (2, 2, 4, "mean"),
        (2, 2, 5, "token_mean_per_microbatch"),
        (2, 2, 6, "token_mean_global"),
        (2, 2, 1, "mean"),
        (4, 4, 8, "mean"),
        (4, 4, 2, "mean"),  # fewer microbatches than stages: warm-up and cool-down only
        (4, 4, 5, "token_mean_global"),
        (4, 2, 4, "mean"),  # PP=2 x DP=2
        (4, 2, 5, "token_mean_global"),
    ],
)
def test_pipelined_losses_and_grads_equal_single_rank(world_size, pipeline_size, num_microbatches, loss_kind):
    results = run_on_ranks(
        world_size, _run_schedule_against_reference, pipeline_size, num_microbatches, {"loss_kind": loss_kind}
    )
    _check_against_reference(results, pipeline_size, num_microbatches)
    for result in results:
        (num_tokens_passed,) = result["finalize_calls"]
        if loss_kind != "token_mean_global":
            assert num_tokens_passed is None
        elif result["stage"] == pipeline_size - 1:
            assert num_tokens_passed > 0  # the last stage counted the tokens of its losses
        else:
            assert num_tokens_passed == 0


@pytest.mark.parametrize("world_size, pipeline_size", [(2, 2), (4, 4)])
def test_forward_only_returns_losses_and_leaves_no_grads(world_size, pipeline_size):
    results = run_on_ranks(world_size, _run_schedule_against_reference, pipeline_size, 5, {"forward_only": True})
    _check_against_reference(results, pipeline_size, 5, forward_only=True)


@pytest.mark.parametrize("world_size", [2])
def test_deallocated_outputs_through_a_wrapper_give_the_same_grads(world_size):
    results = run_on_ranks(world_size, _run_schedule_against_reference, 2, 4, {"deallocate": True, "wrap": True})
    _check_against_reference(results, 2, 4)
    first_stage = next(result for result in results if result["stage"] == 0)
    assert first_stage["sent_output_numels"] == [1] * 4  # every sent activation's storage was released
    last_stage = next(result for result in results if result["stage"] == 1)
    assert last_stage["sent_output_numels"] == [SEQ_LENGTH * MICRO_BATCH_SIZE * toy_stages.HIDDEN_SIZE] * 4


@pytest.mark.parametrize("world_size", [2])
def test_variable_sequence_lengths(world_size):
    options = {"seq_lengths": [4, 2, 5, 3]}
    results = run_on_ranks(world_size, _run_schedule_against_reference, 2, 4, options)
    _check_against_reference(results, 2, 4)


def _interleaved_variable_lengths(seq_lengths):
    """Two ranks of two chunks, one toy layer each (chunk c of rank r holds layer 2c + r), microbatches of
    different sequence lengths: (losses, reference losses, max gradient error)."""
    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2)
    try:
        rank = parallel_state.get_pipeline_model_parallel_rank()
        layers = toy_stages.build_layers()
        config = ToyConfig(variable_seq_lengths=True)
        chunks = [toy_stages.ToyStage([layers[2 * chunk + rank]], chunk == 0 and rank == 0, config)
                  for chunk in range(2)]
        batches = make_batches(len(seq_lengths), seq_lengths=seq_lengths)
        reported = get_forward_backward_func()(
            forward_step_func=toy_stages.forward_step_mean_loss, data_iterator=iter(batches), model=chunks,
            num_microbatches=len(batches), seq_length=SEQ_LENGTH, micro_batch_size=MICRO_BATCH_SIZE,
        )
        reference_losses, reference_grads = reference_losses_and_grads(batches)
        grad_error = max((parameter.grad - expected).abs().max().item() for chunk in range(2)
                         for parameter, expected in zip(layers[2 * chunk + rank].parameters(),
                                                        reference_grads[2 * chunk + rank]))
        return [item["lm loss"].item() for item in reported], reference_losses, grad_error
    finally:
        parallel_state.destroy_model_parallel()


@pytest.mark.parametrize("world_size", [2])
def test_interleaved_pipeline_with_variable_sequence_lengths(world_size):
    """As upstream, --variable-seq-lengths also works with virtual pipeline stages: the shapes travel first."""
    (first_losses, _, first_error), (losses, reference, last_error) = run_on_ranks(
        world_size, _interleaved_variable_lengths, [4, 2, 5, 3])
    assert first_losses == [] and losses == pytest.approx(reference, abs=TOLERANCE, rel=TOLERANCE)
    assert first_error < TOLERANCE and last_error < TOLERANCE


@pytest.mark.parametrize("world_size", [2])
def test_grad_scale_func_scales_the_backward(world_size):
    results = run_on_ranks(world_size, _run_schedule_against_reference, 2, 3, {"grad_scale": 8.0})
    _check_against_reference(results, 2, 3)  # grads are divided back by the scale before comparing


def _schedule_names_for_layouts():
    names = []
    for pipeline_size in (1, 2):
        parallel_state.initialize_model_parallel(pipeline_model_parallel_size=pipeline_size)
        names.append(get_forward_backward_func().__name__)
        parallel_state.destroy_model_parallel()
    return names


@pytest.mark.parametrize("world_size", [2])
def test_get_forward_backward_func_follows_pipeline_size(world_size):
    results = run_on_ranks(world_size, _schedule_names_for_layouts)
    expected = [forward_backward_no_pipelining.__name__, forward_backward_pipelining_without_interleaving.__name__]
    assert results == [expected] * world_size


# ---------------------------------------------------------------------------------------------------------
# Single stage (no process group needed)
# ---------------------------------------------------------------------------------------------------------


def test_get_forward_backward_func_takes_upstreams_size_keywords():
    from megatron.core.pipeline_parallel.interleaved_schedule import forward_backward_pipelining_with_interleaving

    assert get_forward_backward_func(pp_size=1) is forward_backward_no_pipelining
    assert get_forward_backward_func(pp_size=2) is forward_backward_pipelining_without_interleaving
    assert get_forward_backward_func(pp_size=2, vp_size=1) is forward_backward_pipelining_without_interleaving
    assert get_forward_backward_func(pp_size=4, vp_size=2) is forward_backward_pipelining_with_interleaving


def _single_stage_model(config=None):
    return build_stage(0, 1, config)


def test_no_pipelining_equals_one_big_batch():
    num_microbatches = 4
    batches = make_batches(num_microbatches)
    no_sync_enters, finalize_calls = [], []

    @contextlib.contextmanager
    def no_sync():
        no_sync_enters.append(1)
        yield

    def finalize(model_chunks, num_tokens):
        finalize_calls.append(num_tokens)

    config = ToyConfig(no_sync_func=no_sync, finalize_model_grads_func=finalize)
    model = _single_stage_model(config)
    assert get_forward_backward_func() is forward_backward_no_pipelining
    reported = get_forward_backward_func()(
        forward_step_func=toy_stages.forward_step_mean_loss,
        data_iterator=iter(batches),
        model=model,
        num_microbatches=num_microbatches,
        seq_length=SEQ_LENGTH,
        micro_batch_size=MICRO_BATCH_SIZE,
    )

    big_model = _single_stage_model()
    big_batch = {key: torch.cat([batch[key] for batch in batches], dim=1) for key in ("x", "target")}
    big_loss = toy_stages.mean_loss(big_model(big_batch["x"]), big_batch)
    big_loss.backward()

    per_microbatch = [item["lm loss"].item() for item in reported]
    assert sum(per_microbatch) / num_microbatches == pytest.approx(big_loss.item(), abs=1e-6)
    expected_losses = [toy_stages.mean_loss(big_model(batch["x"]), batch).item() for batch in batches]
    assert per_microbatch == pytest.approx(expected_losses, abs=1e-6)
    for parameter, expected in zip(model.parameters(), big_model.parameters()):
        torch.testing.assert_close(parameter.grad, expected.grad, atol=1e-6, rtol=1e-6)
    assert no_sync_enters == [1] and finalize_calls == [None]


def test_no_pipelining_forward_only_and_model_without_config():
    model = _single_stage_model()  # no .config: schedule defaults apply
    assert not hasattr(model, "config")
    batches = make_batches(3)
    reported = forward_backward_no_pipelining(
        forward_step_func=toy_stages.forward_step_mean_loss,
        data_iterator=[iter(batches)],
        model=[model],
        num_microbatches=3,
        seq_length=SEQ_LENGTH,
        micro_batch_size=MICRO_BATCH_SIZE,
        forward_only=True,
    )
    expected, _ = reference_losses_and_grads(batches)
    assert [item["lm loss"].item() for item in reported] == pytest.approx(expected, abs=1e-6)
    assert all(parameter.grad is None for parameter in model.parameters())


def test_no_pipelining_per_token_loss_hands_token_count_to_finalize():
    batches = make_batches(3)
    finalize_calls = []

    def finalize(model_chunks, num_tokens):
        finalize_calls.append(num_tokens.item())
        for parameter in model_chunks[0].parameters():
            parameter.grad /= num_tokens

    model = _single_stage_model(ToyConfig(calculate_per_token_loss=True, finalize_model_grads_func=finalize))
    forward_backward_no_pipelining(
        forward_step_func=toy_stages.forward_step_token_loss,
        data_iterator=iter(batches),
        model=model,
        num_microbatches=3,
        seq_length=SEQ_LENGTH,
        micro_batch_size=MICRO_BATCH_SIZE,
    )
    _, reference_grads = reference_losses_and_grads(batches, "token_mean_global")
    assert finalize_calls == [sum(batch["loss_mask"].sum().item() for batch in batches)]
    assert max_grad_error(model, reference_grads, 0, 1) < TOLERANCE


def test_fully_masked_microbatch_adds_zero_loss_not_nan():
    """As upstream, a 3-tuple loss divides by max(num_tokens, 1): a microbatch with every token masked contributes
    nothing, and the others keep their gradients."""
    batches = make_batches(2)
    batches[1]["loss_mask"] = torch.zeros_like(batches[1]["loss_mask"])
    model = _single_stage_model()
    reported = forward_backward_no_pipelining(
        forward_step_func=toy_stages.forward_step_token_loss, data_iterator=iter(batches), model=model,
        num_microbatches=2, seq_length=SEQ_LENGTH, micro_batch_size=MICRO_BATCH_SIZE,
    )
    assert reported[1]["lm loss"].tolist() == [0.0, 0.0]
    reference = _single_stage_model()
    reference_loss = toy_stages.forward_step_token_loss(iter(batches[:1]), reference)
    loss_sum, num_tokens, _ = reference_loss[1](reference_loss[0])
    (loss_sum / num_tokens / 2).backward()
    for parameter, expected in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(parameter.grad, expected.grad, atol=1e-6, rtol=1e-6)


def test_per_token_loss_refuses_a_two_tuple_loss_func():
    """A (loss, report) loss counts no tokens: the gradients would be divided by zero tokens at the step's end."""
    model = _single_stage_model(ToyConfig(calculate_per_token_loss=True))
    with pytest.raises(ValueError, match=r"calculate_per_token_loss \(--calculate-per-token-loss\) .* loss_func must "
                                         r"return the 3-tuple .* got a \(loss, report\) 2-tuple"):
        forward_backward_no_pipelining(
            forward_step_func=toy_stages.forward_step_mean_loss, data_iterator=iter(make_batches(1)), model=model,
            num_microbatches=1, seq_length=SEQ_LENGTH, micro_batch_size=MICRO_BATCH_SIZE,
        )
    reported = forward_backward_no_pipelining(  # forward only: no gradients to divide, the reports come back
        forward_step_func=toy_stages.forward_step_mean_loss, data_iterator=iter(make_batches(1)), model=model,
        num_microbatches=1, seq_length=SEQ_LENGTH, micro_batch_size=MICRO_BATCH_SIZE, forward_only=True,
    )
    assert [item["lm loss"].item() for item in reported] == pytest.approx(reference_losses_and_grads(
        make_batches(1))[0], abs=1e-6)


def test_schedule_rejects_several_model_chunks_and_bad_loss_func():
    model = _single_stage_model()
    common = dict(data_iterator=iter(make_batches(2)), num_microbatches=2, seq_length=SEQ_LENGTH, micro_batch_size=2)
    with pytest.raises(ValueError, match="one model chunk"):
        forward_backward_no_pipelining(
            forward_step_func=toy_stages.forward_step_mean_loss, model=[model, model], **common
        )

    def forward_step_bad_loss(data_iterator, model):
        output = model(next(data_iterator)["x"])
        return output, lambda output_tensor: output_tensor.sum()

    with pytest.raises(ValueError, match="loss_func must return"):
        forward_backward_no_pipelining(forward_step_func=forward_step_bad_loss, model=model, **common)


def _two_tuple_loss_gradient_under_context_parallelism():
    """Each CP rank holds its share of a sequence's per-token values; the loss function is upstream's legacy
    (loss, report) one, which all-reduces its sum and count over the CP ranks into the sequence mean."""
    parallel_state.initialize_model_parallel(context_parallel_size=2)
    cp_group = parallel_state.get_context_parallel_group()
    rank = parallel_state.get_context_parallel_rank()
    values = [torch.tensor([1.0, 2.0, 3.0]), torch.tensor([4.0, 5.0, 6.0])][rank]
    loss_mask = [torch.tensor([1.0, 1.0, 0.0]), torch.tensor([1.0, 1.0, 1.0])][rank]
    model = torch.nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(1.0)

    def forward_step_func(data_iterator, model):
        output = model(next(data_iterator).unsqueeze(-1)).squeeze(-1)

        def loss_func(output_tensor):
            local_sum = (output_tensor * loss_mask).sum()
            totals = torch.stack([local_sum.detach(), loss_mask.sum()])
            dist.all_reduce(totals, group=cp_group)
            loss = local_sum / totals[1]  # the sequence mean; its gradient flows through this rank's share
            return loss, {"lm loss": loss.detach()}

        return output, loss_func

    forward_backward_no_pipelining(forward_step_func=forward_step_func, data_iterator=iter([values]), model=model,
                                   num_microbatches=1, seq_length=3, micro_batch_size=1)
    grad = model.weight.grad.clone()
    dist.all_reduce(grad, group=cp_group)  # what the gradient reduction over DP x CP does, before its 1 / (DP x CP)
    parallel_state.destroy_model_parallel()
    return (grad / 2).item()


@pytest.mark.parametrize("world_size", [2])
def test_two_tuple_loss_under_context_parallelism_scales_as_upstream(world_size):
    # d(sequence mean)/dw over the unmasked values 1, 2, 4, 5, 6: their mean, 18 / 5.
    for averaged_grad in run_on_ranks(world_size, _two_tuple_loss_gradient_under_context_parallelism):
        assert abs(averaged_grad - 18 / 5) < 1e-6


def test_schedules_take_upstream_keywords_and_refuse_what_they_cannot_honour():
    from megatron.core.pipeline_parallel.interleaved_schedule import forward_backward_pipelining_with_interleaving

    batches = make_batches(2)
    model = _single_stage_model()
    reported = forward_backward_no_pipelining(
        forward_step_func=toy_stages.forward_step_mean_loss, data_iterator=iter(batches), model=model,
        num_microbatches=2, seq_length=SEQ_LENGTH, micro_batch_size=MICRO_BATCH_SIZE, forward_only=True,
        adjust_tensor_shapes_fn=lambda recv, send: (recv, send), pg_collection=None,
    )
    expected, _ = reference_losses_and_grads(batches)
    assert [item["lm loss"].item() for item in reported] == pytest.approx(expected, abs=1e-6)

    common = dict(forward_step_func=toy_stages.forward_step_mean_loss, data_iterator=iter(batches), model=model,
                  num_microbatches=2, seq_length=SEQ_LENGTH, micro_batch_size=MICRO_BATCH_SIZE)
    with pytest.raises(ValueError, match=r"forward_backward_no_pipelining\(pg_collection=...\) is not supported"
                                         r".*initialize_model_parallel\); pass None"):
        forward_backward_no_pipelining(pg_collection=object(), **common)
    for schedule in (forward_backward_pipelining_without_interleaving, forward_backward_pipelining_with_interleaving):
        for keyword in ("adjust_tensor_shapes_fn", "p2p_communicator", "pg_collection"):
            with pytest.raises(ValueError, match=rf"{schedule.__name__}\({keyword}=...\) is not supported here: "
                                                 r".*pass None"):
                schedule(**common, **{keyword: object()})
