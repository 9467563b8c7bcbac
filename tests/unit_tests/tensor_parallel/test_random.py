"""RNG tracker streams, their seeds per tensor-parallel rank, and recomputation under replayed streams."""

import pytest
import torch

from megatron.core.tensor_parallel import checkpoint, get_cuda_rng_tracker, model_parallel_cuda_manual_seed
from tests.unit_tests.multiprocess_harness import run_on_ranks
from tests.unit_tests.tensor_parallel.tp_helpers import setup_tensor_parallel


def _draws(seed, n=5):
    return torch.rand(n, generator=torch.Generator().manual_seed(seed))


def test_seeding_and_fork_single_process():
    model_parallel_cuda_manual_seed(42)
    default_stream = _draws(42, 10)
    model_parallel_stream = _draws(42 + 2718, 10)
    tracker = get_cuda_rng_tracker()
    assert tracker.is_initialized()
    first = torch.rand(5)
    with tracker.fork():
        forked = torch.rand(5)
    second = torch.rand(5)
    with tracker.fork("model-parallel-rng"):
        forked_again = torch.rand(5)
    torch.testing.assert_close(first, default_stream[:5], atol=0, rtol=0)
    torch.testing.assert_close(second, default_stream[5:], atol=0, rtol=0)  # fork left the default alone
    torch.testing.assert_close(forked, model_parallel_stream[:5], atol=0, rtol=0)
    torch.testing.assert_close(forked_again, model_parallel_stream[5:], atol=0, rtol=0)  # stream advanced
    with pytest.raises(KeyError, match="not registered"):
        with tracker.fork("no-such-stream"):
            pass
    with pytest.raises(ValueError, match="already exists"):
        tracker.add("model-parallel-rng", 7)
    tracker.reset()


def _streams_per_rank(seed):
    _, rank, _ = setup_tensor_parallel()
    model_parallel_cuda_manual_seed(seed)
    default = torch.rand(4)
    with get_cuda_rng_tracker().fork():
        forked = torch.rand(4)
    get_cuda_rng_tracker().reset()
    return rank, default, forked


@pytest.mark.parametrize("world_size", [2])
def test_model_parallel_stream_differs_per_tensor_parallel_rank(world_size):
    results = run_on_ranks(world_size, _streams_per_rank, 5)
    for rank, default, forked in results:
        torch.testing.assert_close(default, _draws(5, 4), atol=0, rtol=0)
        torch.testing.assert_close(forked, _draws(5 + 2718 + rank, 4), atol=0, rtol=0)
    assert not torch.equal(results[0][2], results[1][2])


def _expert_stream_per_rank(seed):
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel(tensor_model_parallel_size=2, expert_model_parallel_size=2,
                                 expert_tensor_parallel_size=1)
    model_parallel_cuda_manual_seed(seed)
    with get_cuda_rng_tracker().fork("expert-parallel-rng"):
        draw = torch.rand(4)
    get_cuda_rng_tracker().reset()
    return ps.get_expert_model_parallel_rank(), ps.get_expert_tensor_parallel_rank(), draw


def test_expert_stream_is_seeded_from_the_expert_tensor_parallel_rank():
    """TP = 2 with --expert-tensor-parallel-size 1 and EP = 2: both ranks are expert-tensor-parallel rank 0, so
    the expert stream is seed + 1024 + 100 * ep_rank (not + the tensor-parallel rank), as upstream seeds it."""
    results = run_on_ranks(2, _expert_stream_per_rank, 5)
    assert [(ep, etp) for ep, etp, _ in results] == [(0, 0), (1, 0)]
    for ep_rank, etp_rank, draw in results:
        torch.testing.assert_close(draw, _draws(5 + 1024 + 100 * ep_rank + etp_rank, 4), atol=0, rtol=0)
    # Upstream's explicit-rank keywords replace parallel_state's ranks.
    model_parallel_cuda_manual_seed(5, tp_rank=1, ep_rank=2, etp_rank=3, force_reset_rng=True)
    tracker = get_cuda_rng_tracker()
    for name, seed in (("model-parallel-rng", 5 + 2718 + 1), ("expert-parallel-rng", 5 + 1024 + 200 + 3)):
        with tracker.fork(name):
            torch.testing.assert_close(torch.rand(4), _draws(seed, 4), atol=0, rtol=0, msg=name)
    tracker.reset()


def test_checkpoint_without_output_frees_outputs_and_matches_plain_gradients():
    """Upstream's output-discarding checkpoint: the activation's storage is freed after the consumer ran, the
    recompute replays the dropout of the tracker's stream, and every gradient equals the run without it."""
    from megatron.core.tensor_parallel import CheckpointWithoutOutput

    torch.manual_seed(0)
    fc1, fc2 = torch.nn.Linear(5, 6), torch.nn.Linear(6, 4)
    x = torch.randn(3, 5)

    def activation(hidden):
        with get_cuda_rng_tracker().fork():
            return torch.nn.functional.dropout(torch.nn.functional.gelu(hidden), p=0.5, training=True)

    results = []
    for discard_output in (False, True):
        model_parallel_cuda_manual_seed(7)
        fc1.zero_grad()
        fc2.zero_grad()
        inputs = x.clone().requires_grad_()
        hidden = fc1(inputs)
        if discard_output:
            recompute = CheckpointWithoutOutput()
            activated = recompute.checkpoint(activation, hidden)
            output = fc2(activated)
            recompute.discard_output_and_register_recompute(output)
            assert activated.untyped_storage().size() == 0
        else:
            output = fc2(activation(hidden))
        output.pow(2).sum().backward()
        after = torch.rand(3)  # the recompute must not move the default stream
        with get_cuda_rng_tracker().fork():
            after_forked = torch.rand(3)
        results.append((output.detach(), inputs.grad, fc1.weight.grad.clone(), fc2.weight.grad.clone(), after,
                        after_forked))
    for plain, recomputed in zip(*results):
        torch.testing.assert_close(recomputed, plain, atol=1e-6, rtol=1e-6)
    get_cuda_rng_tracker().reset()


def test_checkpoint_recomputes_with_same_dropout_and_gradients():
    torch.manual_seed(0)
    linear = torch.nn.Linear(6, 6)
    x = torch.randn(4, 6)

    def block(inputs):
        with get_cuda_rng_tracker().fork():
            dropped = torch.nn.functional.dropout(linear(inputs), p=0.5, training=True)
        return torch.nn.functional.dropout(dropped, p=0.3, training=True) * 2.0

    results = []
    for use_checkpoint in (False, True):
        model_parallel_cuda_manual_seed(11)
        linear.zero_grad()
        inputs = x.clone().requires_grad_()
        output = checkpoint(block, False, inputs) if use_checkpoint else block(inputs)
        output.sum().backward()
        after = torch.rand(3)  # recomputation must not disturb the stream seen afterwards
        results.append((output.detach(), inputs.grad, linear.weight.grad.clone(), after))
    for plain, recomputed in zip(*results):
        torch.testing.assert_close(recomputed, plain, atol=1e-6, rtol=1e-6)
    with pytest.raises(ValueError, match="distribute_saved_activations=True.*pass a tensor first"):
        checkpoint(lambda scale, inputs: block(inputs) * scale, True, 2.0, x)
    get_cuda_rng_tracker().reset()


def _distributed_checkpoint_per_rank():
    _, rank, tp = setup_tensor_parallel()
    linear = torch.nn.Linear(6, 6)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(6, 6, generator=torch.Generator().manual_seed(1)))
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(2))

    def block(inputs, scale):
        with get_cuda_rng_tracker().fork():
            return torch.nn.functional.dropout(linear(inputs), p=0.5, training=True) * scale

    results = []
    for distribute in (None, False, True):
        model_parallel_cuda_manual_seed(3)
        linear.zero_grad()
        inputs = x.clone().requires_grad_()
        output = block(inputs, 2.0) if distribute is None else checkpoint(block, distribute, inputs, 2.0)
        kept = [] if distribute is None else [saved.numel() for saved in output.grad_fn.saved_tensors]
        output.sum().backward()
        results.append((output.detach(), inputs.grad, linear.weight.grad.clone(), kept))
    with pytest.raises(ValueError, match="has 5 elements, not divisible by the tensor-parallel size 2"):
        checkpoint(block, True, torch.ones(5), 2.0)
    get_cuda_rng_tracker().reset()
    return rank, results


def test_checkpoint_distributes_its_saved_input_over_tensor_parallel_ranks():
    """Upstream's `checkpoint(function, True, hidden, ...)`: each rank keeps 1/TP of the input (here 24 / 2
    elements instead of 24), the recompute all-gathers it, and outputs and gradients equal a plain forward's."""
    for rank, (plain, undistributed, distributed) in run_on_ranks(2, _distributed_checkpoint_per_rank):
        assert undistributed[3] == [24] and distributed[3] == [12]
        for name, expected, kept_whole, kept_split in zip(("output", "input grad", "weight grad"), plain,
                                                           undistributed, distributed):
            torch.testing.assert_close(kept_whole, expected, atol=1e-6, rtol=1e-6, msg=f"rank {rank} {name}")
            torch.testing.assert_close(kept_split, expected, atol=1e-6, rtol=1e-6, msg=f"rank {rank} {name}")


def test_upstream_tracker_names_and_seed_switches():
    from megatron.core import tensor_parallel

    model_parallel_cuda_manual_seed(5, te_rng_tracker=False, inference_rng_tracker=False, use_cudagraphable_rng=False)
    tracker = get_cuda_rng_tracker()
    names = (tensor_parallel.get_data_parallel_rng_tracker_name(),
             tensor_parallel.get_expert_parallel_rng_tracker_name())
    assert names == ("data-parallel-rng", "expert-parallel-rng")
    # The expert stream at EP = TP = 1 is seeded with seed + 1024.
    with tracker.fork(names[1]):
        expert_draw = torch.rand(3)
    torch.testing.assert_close(expert_draw, torch.rand(3, generator=torch.Generator().manual_seed(5 + 1024)))
    with pytest.raises(ValueError, match=r"model_parallel_cuda_manual_seed\(te_rng_tracker=True\)"):
        model_parallel_cuda_manual_seed(5, te_rng_tracker=True)
    # Upstream's keywords of get_cuda_rng_tracker: the one tracker when left False.
    assert get_cuda_rng_tracker(use_te_rng_tracker=False, inference_rng_tracker=False,
                                use_cudagraphable_rng=False) is tracker
    with pytest.raises(ValueError, match=r"get_cuda_rng_tracker\(inference_rng_tracker=True\)"):
        get_cuda_rng_tracker(inference_rng_tracker=True)
    assert callable(tensor_parallel.linear_with_grad_accumulation_and_async_allreduce)
