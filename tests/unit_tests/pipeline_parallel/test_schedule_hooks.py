"""Upstream's Core API around `get_forward_backward_func()`: the config's `grad_sync_func` / `param_sync_func` hooks
are called where upstream's schedules call them, `collect_non_loss_data=True` returns each microbatch's
`loss_func(output, non_loss_data=True)` as it is, and the single-stage schedule takes the full keyword set."""

import contextlib

import pytest
import torch

from megatron.core import parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func
from tests.unit_tests.multiprocess_harness import run_on_ranks
from tests.unit_tests.pipeline_parallel import toy_stages
from tests.unit_tests.pipeline_parallel.toy_stages import MICRO_BATCH_SIZE, SEQ_LENGTH, ToyConfig, make_batches

NUM_MICROBATCHES = 4


def forward_step_with_non_loss_data(data_iterator, model):
    batch = next(data_iterator)
    output = model(batch["x"])

    def loss_func(output_tensor, non_loss_data=False):
        if non_loss_data:
            return {"output": output_tensor.detach().clone(), "target": batch["target"]}
        loss = toy_stages.mean_loss(output_tensor, batch)
        return loss, {"lm loss": loss.detach()}

    return output, loss_func


def _layers(count):
    generator = torch.Generator().manual_seed(toy_stages.MODEL_SEED)
    layers = [torch.nn.Linear(toy_stages.HIDDEN_SIZE, toy_stages.HIDDEN_SIZE) for _ in range(count)]
    with torch.no_grad():
        for layer in layers:
            layer.weight.copy_(torch.randn(layer.weight.shape, generator=generator) * 0.5)
            layer.bias.copy_(torch.randn(layer.bias.shape, generator=generator) * 0.1)
    return layers


def _recording_config(events):
    @contextlib.contextmanager
    def no_sync():
        events.append("no_sync")
        yield
        events.append("sync")

    config = ToyConfig(no_sync_func=no_sync, finalize_model_grads_func=lambda chunks, num_tokens: events.append(
        "finalize"))
    config.grad_sync_func = lambda parameters: events.append(f"grad_sync {len(list(parameters))}")
    config.param_sync_func = lambda parameters: events.append(f"param_sync {len(list(parameters))}")
    return config


def _record_backwards(events, module, name):
    module.weight.register_hook(lambda grad: events.append(f"backward {name}"))


def _hooks_and_collected_data(num_chunks):
    """Pipeline of 2 ranks (one toy layer per chunk, `num_chunks` chunks per rank): (the hook calls and backwards
    of a training step in order, the collected non-loss data as (output, target) lists, their reference outputs)."""
    virtual_size = num_chunks if num_chunks > 1 else None
    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=2,
                                             virtual_pipeline_model_parallel_size=virtual_size)
    try:
        rank = parallel_state.get_pipeline_model_parallel_rank()
        layers = _layers(2 * num_chunks)
        events = []
        config = _recording_config(events)
        chunks = [toy_stages.ToyStage([layers[2 * chunk + rank]], chunk == 0 and rank == 0, config)
                  for chunk in range(num_chunks)]
        for chunk, module in enumerate(chunks):
            _record_backwards(events, module.layers[0], chunk)
        schedule = get_forward_backward_func()
        common = dict(model=chunks, num_microbatches=NUM_MICROBATCHES, seq_length=SEQ_LENGTH,
                      micro_batch_size=MICRO_BATCH_SIZE)
        schedule(forward_step_func=toy_stages.forward_step_mean_loss, data_iterator=iter(make_batches(4)), **common)
        training_events = list(events)
        events.clear()
        with torch.no_grad():
            collected = schedule(forward_step_func=forward_step_with_non_loss_data,
                                 data_iterator=iter(make_batches(4, seed=9)), forward_only=True,
                                 collect_non_loss_data=True, **common)
        reference = toy_stages.ToyStage(_layers(2 * num_chunks), pre_process=True)
        with torch.no_grad():
            expected = [reference(batch["x"]) for batch in make_batches(4, seed=9)]
        return (training_events, events, [(item["output"], item["target"]) for item in collected],
                [(output, batch["target"]) for output, batch in zip(expected, make_batches(4, seed=9))])
    finally:
        parallel_state.destroy_model_parallel()


@pytest.mark.parametrize("world_size", [2])
def test_one_f_one_b_calls_grad_sync_func_after_the_cool_down_on_later_stages(world_size):
    (first, first_eval, first_collected, _), (last, last_eval, last_collected, expected) = run_on_ranks(
        world_size, _hooks_and_collected_data, 1)
    # As upstream: the first stage leaves no_sync for its last backward (its wrapper starts the reduction) and
    # calls no grad_sync_func; the last stage stays inside for every backward and then calls grad_sync_func.
    assert first == ["no_sync"] + ["backward 0"] * 3 + ["sync", "backward 0", "finalize"]
    assert last == ["no_sync"] + ["backward 0"] * 4 + ["sync", "grad_sync 2", "finalize"]
    # Collecting non-loss data is forward only: no hook, and the last stage's loss_func outputs come back as they
    # are (the whole model's output for each microbatch), in microbatch order.
    assert first_eval == last_eval == [] and first_collected == []
    assert len(last_collected) == NUM_MICROBATCHES
    for (output, target), (expected_output, expected_target) in zip(last_collected, expected):
        torch.testing.assert_close(output, expected_output, atol=1e-6, rtol=1e-6)
        assert torch.equal(target, expected_target)


@pytest.mark.parametrize("world_size", [2])
def test_interleaved_schedule_calls_grad_and_param_sync_funcs_as_upstream(world_size):
    (first, first_eval, first_collected, _), (last, last_eval, last_collected, expected) = run_on_ranks(
        world_size, _hooks_and_collected_data, 3)
    # 3 chunks, 4 microbatches in groups of 2: the backwards run chunks 2, 1, 0 on microbatches 0-1, then 2-3.
    # param_sync_func: chunks 0 and 1 before the first forward, chunk 2 `rank` forwards before chunk 1 runs
    # microbatch 0 (still in the warm-up). grad_sync_func: a chunk's `rank` backwards after its last one
    # (microbatch 3), no_sync entered again while backwards are left; rank 1's chunk 0 after the last backward.
    warm_up = ["no_sync", "param_sync 2", "param_sync 2", "param_sync 2"]
    first_microbatches = ["backward 2"] * 2 + ["backward 1"] * 2 + ["backward 0"] * 2
    reenter = ["sync", "grad_sync 2", "no_sync"]
    assert first == (warm_up + first_microbatches + ["backward 2"] * 2 + reenter + ["backward 1"] * 2 + reenter
                     + ["backward 0"] * 2 + ["sync", "grad_sync 2", "finalize"])
    assert last == (warm_up + first_microbatches + ["backward 2"] * 2 + ["backward 1"] + reenter
                    + ["backward 1", "backward 0"] + reenter + ["backward 0", "sync", "grad_sync 2", "finalize"])
    assert first_eval == last_eval == ["param_sync 2", "param_sync 2", "param_sync 2"]
    assert first_collected == [] and len(last_collected) == NUM_MICROBATCHES
    for (output, target), (expected_output, expected_target) in zip(last_collected, expected):
        torch.testing.assert_close(output, expected_output, atol=1e-6, rtol=1e-6)
        assert torch.equal(target, expected_target)


def test_single_stage_takes_every_upstream_keyword_and_collects_non_loss_data():
    model = toy_stages.build_stage(0, 1, ToyConfig())
    batches = make_batches(2)
    collected = get_forward_backward_func()(
        forward_step_func=forward_step_with_non_loss_data, data_iterator=[iter(batches)], model=[model],
        num_microbatches=2, seq_length=SEQ_LENGTH, micro_batch_size=MICRO_BATCH_SIZE,
        decoder_seq_length=SEQ_LENGTH, forward_only=True, collect_non_loss_data=True, first_val_step=True,
        adjust_tensor_shapes_fn=None, p2p_communicator=None, pg_collection=None,
    )
    with torch.no_grad():
        expected = [model(batch["x"]) for batch in batches]
    assert [item["output"].tolist() for item in collected] == [output.tolist() for output in expected]
    assert all(parameter.grad is None for parameter in model.parameters())


def test_collecting_non_loss_data_needs_forward_only():
    model = toy_stages.build_stage(0, 1, ToyConfig())
    with pytest.raises(ValueError, match=r"collect_non_loss_data=True keeps what loss_func\(output_tensor, "
                                         r"non_loss_data=True\) returns .* pass forward_only=True with it"):
        get_forward_backward_func()(
            forward_step_func=forward_step_with_non_loss_data, data_iterator=iter(make_batches(1)), model=model,
            num_microbatches=1, seq_length=SEQ_LENGTH, micro_batch_size=MICRO_BATCH_SIZE,
            collect_non_loss_data=True,
        )
