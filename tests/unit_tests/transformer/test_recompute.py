"""Activation recompute (full/uniform, full/block, selective) gives the loss and gradients of a run without it,
with dropout on: the recomputed forward must replay the default and the tracker's random streams."""

import pytest
import torch

from megatron.core import parallel_state, tensor_parallel
from tests.unit_tests.models.gpt.gpt_test_utils import fixed_batch, loss_and_grads, max_abs_diff, seeded_model, tiny_config
from tests.unit_tests.multiprocess_harness import run_on_ranks

NUM_LAYERS = 4
DROPOUT = 0.2

RECOMPUTE_SETTINGS = {
    "full_uniform_2": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=2),
    "full_uniform_3": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=3),
    "full_block_1": dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=1),
    "selective": dict(recompute_granularity="selective"),
    # --distribute-saved-activations: each tensor-parallel rank keeps 1/TP of the chunks' inputs (TP > 1).
    "full_uniform_2_distributed": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=2,
                                       distribute_saved_activations=True),
}
# How many times each layer (or core attention, for selective) runs in one forward + backward.
EXPECTED_CALLS = {
    "full_uniform_2": [2, 2, 2, 2],
    "full_uniform_3": [2, 2, 2, 2],
    "full_block_1": [2, 1, 1, 1],
    "selective": [2, 2, 2, 2],
    "full_uniform_2_distributed": [2, 2, 2, 2],
}


def _count_calls(model, setting):
    counts = [0] * len(model.decoder.layers)
    for index, layer in enumerate(model.decoder.layers):
        if setting == "selective":
            attention = layer.self_attention
            original = attention.core_attention

            def counted(*args, _index=index, _original=original):
                counts[_index] += 1
                return _original(*args)

            attention.core_attention = counted
        else:

            # A pre-hook: a recompute stops early once the tensors backward needs exist, before a forward
            # hook would fire.
            def hook(module, inputs, _index=index):
                counts[_index] += 1

            layer.register_forward_pre_hook(hook)
    return counts


def _rng_snapshot():
    tracker_states = tensor_parallel.get_cuda_rng_tracker().get_states()
    return [torch.get_rng_state()] + [tracker_states[name] for name in sorted(tracker_states)]


def _recompute_matches_plain(tp, sequence_parallel, setting):
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    common = dict(
        tp=tp,
        sequence_parallel=sequence_parallel,
        num_layers=NUM_LAYERS,
        hidden_dropout=DROPOUT,
        attention_dropout=DROPOUT,
    )
    batch = fixed_batch()

    plain = seeded_model(tiny_config(**common))
    plain_loss, plain_grads = loss_and_grads(plain, batch)
    plain_rng_after = _rng_snapshot()
    plain.eval()
    with torch.no_grad():
        eval_loss = plain(batch[0], batch[2], labels=batch[1])

    recomputed = seeded_model(tiny_config(**common, **RECOMPUTE_SETTINGS[setting]))
    counts = _count_calls(recomputed, setting)
    recomputed_loss, recomputed_grads = loss_and_grads(recomputed, batch)
    rng_after = _rng_snapshot()
    return {
        "dropout_effect": (plain_loss - eval_loss).abs().max().item(),
        "loss_diff": (plain_loss - recomputed_loss).abs().max().item(),
        "grad_diff": max_abs_diff(plain_grads, recomputed_grads),
        "rng_streams_equal_after": all(torch.equal(a, b) for a, b in zip(plain_rng_after, rng_after)),
        "calls": counts,
    }


def _check(result, setting):
    assert result["dropout_effect"] > 1e-3, "dropout must change the loss for this test to check RNG replay"
    assert result["loss_diff"] < 1e-6, result
    assert result["grad_diff"] < 1e-6, result
    assert result["rng_streams_equal_after"], "recompute must leave the random streams where a plain run leaves them"
    assert result["calls"] == EXPECTED_CALLS[setting]


@pytest.mark.parametrize("setting", sorted(RECOMPUTE_SETTINGS))
@pytest.mark.parametrize("world_size", [1])  # at TP1 the distributed variant is the plain one
def test_recompute_matches_no_recompute_with_dropout(world_size, setting):
    (result,) = run_on_ranks(world_size, _recompute_matches_plain, 1, False, setting)
    _check(result, setting)


@pytest.mark.parametrize("setting", ["full_uniform_2", "selective"])
@pytest.mark.parametrize("world_size", [2])
def test_recompute_with_tensor_and_sequence_parallel(world_size, setting):
    for result in run_on_ranks(world_size, _recompute_matches_plain, 2, True, setting):
        _check(result, setting)


@pytest.mark.parametrize("world_size", [2])
def test_distributed_saved_activations_with_tensor_parallel(world_size):
    for result in run_on_ranks(world_size, _recompute_matches_plain, 2, False, "full_uniform_2_distributed"):
        _check(result, "full_uniform_2_distributed")


def _kept_input_and_gradients(distributed):
    """A checkpointed chunk on a TP2 group whose input (3 x 5: 15 elements, 8 per rank after padding) is computed
    from a leaf: (whether the input stays alive after the forward, the leaf's gradient, the output)."""
    import weakref

    from megatron.core.transformer.recompute import checkpointed, distributed_checkpointed

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    try:
        leaf = torch.linspace(-1, 1, 15).view(3, 5).requires_grad_()
        weight = torch.linspace(0.5, 2, 5)
        hidden = leaf * 1.5  # its node keeps no output: only a checkpoint can keep it alive
        alive = weakref.ref(hidden)
        run = distributed_checkpointed if distributed else checkpointed
        output = run(lambda x, w: (x * w).tanh() * x, hidden, weight)
        del hidden
        kept = alive() is not None
        output.sum().backward()
        return kept, leaf.grad, output.detach()
    finally:
        parallel_state.destroy_model_parallel()


@pytest.mark.parametrize("world_size", [2])
def test_distributed_checkpoint_keeps_a_slice_and_gives_the_same_gradient(world_size):
    plain, distributed = (run_on_ranks(world_size, _kept_input_and_gradients, flag) for flag in (False, True))
    for (plain_kept, plain_grad, plain_out), (kept, grad, out) in zip(plain, distributed):
        assert plain_kept and not kept  # the plain checkpoint holds the whole input; the distributed one a slice
        assert torch.equal(plain_grad, grad) and torch.equal(plain_out, out)


def _backward_twice_through_a_checkpoint():
    """Gradients of a checkpointed dropout (default stream and the tracker's), back-propagated twice over a
    retained graph, and of the same computation without the checkpoint."""
    from megatron.core.transformer.recompute import checkpointed

    parallel_state.initialize_model_parallel()
    try:
        def function(x):
            with tensor_parallel.get_cuda_rng_tracker().fork():
                x = torch.nn.functional.dropout(x, p=0.5)
            return torch.nn.functional.dropout(x.sin(), p=0.5) * x

        grads = {}
        for name, run in (("plain", function), ("checkpointed", lambda x: checkpointed(function, x))):
            tensor_parallel.model_parallel_cuda_manual_seed(123)
            leaf = torch.linspace(-2, 2, 64).requires_grad_()
            output = run(leaf * 1.0).sum()
            output.backward(retain_graph=True)
            first = leaf.grad.clone()
            output.backward()  # a second recompute of the same chunk
            grads[name] = (first, leaf.grad.clone())
        return grads
    finally:
        parallel_state.destroy_model_parallel()


@pytest.mark.parametrize("world_size", [1])
def test_a_checkpointed_chunk_can_be_recomputed_again(world_size):
    (grads,) = run_on_ranks(world_size, _backward_twice_through_a_checkpoint)
    plain_first, plain_twice = grads["plain"]
    first, twice = grads["checkpointed"]
    assert plain_first.abs().sum() > 0 and (plain_first == 0).any()  # dropout kept some elements, dropped others
    assert torch.equal(first, plain_first)
    assert torch.equal(twice, plain_twice)  # the second recompute replayed the same dropout masks
