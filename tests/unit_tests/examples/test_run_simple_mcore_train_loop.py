"""examples/run_simple_mcore_train_loop.py on 2 gloo ranks: the loss falls, TP2 and PP2 losses equal TP1's, the
checkpoint round trip restores every tensor exactly, and a TP2 checkpoint loads at TP1."""

import importlib.util
import pathlib

import torch

from megatron.core import parallel_state
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from tests.unit_tests.multiprocess_harness import run_on_ranks

EXAMPLE = pathlib.Path(__file__).resolve().parents[3] / "examples" / "run_simple_mcore_train_loop.py"
ITERATIONS = 6
MICRO_BATCH_SIZE = 4
LR = 1e-2


def _example():
    spec = importlib.util.spec_from_file_location("run_simple_mcore_train_loop", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(example, tp, pp, num_microbatches=1):
    """(model, losses) of a short run at this layout, on the same data and initial weights as every other."""
    example.initialize_distributed(tp, pp)
    model_parallel_cuda_manual_seed(123)
    model = example.model_provider(tp, pp)
    data = example.get_train_data_iterator(MICRO_BATCH_SIZE // num_microbatches, num_samples=64)
    losses = example.train(model, data, ITERATIONS, MICRO_BATCH_SIZE // num_microbatches, num_microbatches, LR)
    return model, losses


def _pieces(model):
    """key -> (offsets in the logical tensor, a copy of this rank's piece)."""
    return {key: (value.pieces[0][0], value.pieces[0][1].detach().clone())
            for key, value in model.sharded_state_dict(prefix="").items()}


def _tp2_checkpoint_then_tp1(checkpoint_dir):
    example = _example()
    try:
        model, tp2_losses = _run(example, tp=2, pp=1)
        saved = _pieces(model)
        example.save_distributed_checkpoint(checkpoint_dir, model)
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.fill_(7.0)
        example.load_distributed_checkpoint(checkpoint_dir, model)
        restored = model.state_dict()
        round_trip_exact = set(restored) == set(saved) and all(
            torch.equal(restored[key], piece) for key, (_, piece) in saved.items())

        _, tp1_losses = _run(example, tp=1, pp=1)

        example.initialize_distributed(1, 1)
        tp1_model = example.load_distributed_checkpoint(checkpoint_dir, example.model_provider(1, 1))
        whole = tp1_model.state_dict()
        resharded_exact = set(whole) == set(saved) and all(
            torch.equal(whole[key][tuple(slice(o, o + n) for o, n in zip(offsets, piece.shape))], piece)
            for key, (offsets, piece) in saved.items())
        return tp2_losses, tp1_losses, round_trip_exact, resharded_exact
    finally:
        parallel_state.destroy_model_parallel()


def _pp2_and_tp1():
    example = _example()
    try:
        _, pp2_losses = _run(example, tp=1, pp=2, num_microbatches=2)
        is_last_stage = parallel_state.is_pipeline_last_stage()
        _, tp1_losses = _run(example, tp=1, pp=1, num_microbatches=2)
        return pp2_losses if is_last_stage else None, tp1_losses
    finally:
        parallel_state.destroy_model_parallel()


def test_tp2_trains_like_tp1_and_its_checkpoint_round_trips_and_reshards(tmp_path):
    results = run_on_ranks(2, _tp2_checkpoint_then_tp1, str(tmp_path / "checkpoint"))
    for tp2_losses, tp1_losses, round_trip_exact, resharded_exact in results:
        assert len(tp2_losses) == ITERATIONS
        assert tp2_losses[-1] < tp2_losses[0] - 0.05, tp2_losses
        torch.testing.assert_close(tp2_losses, tp1_losses, rtol=0, atol=1e-5)
        assert round_trip_exact
        assert resharded_exact
    assert results[0][0] == results[1][0]  # both tensor-parallel ranks report the same losses


def test_pp2_trains_like_tp1():
    (first_stage, tp1_rank0), (last_stage, tp1_rank1) = run_on_ranks(2, _pp2_and_tp1)
    assert first_stage is None and len(last_stage) == ITERATIONS
    assert last_stage[-1] < last_stage[0] - 0.05, last_stage
    torch.testing.assert_close(last_stage, tp1_rank1, rtol=0, atol=1e-5)
    assert tp1_rank0 == tp1_rank1
