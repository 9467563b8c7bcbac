"""Amax histories saved with another `--fp8-amax-history-len` load fitted to this run's length.

Histories are newest first: a fitted history must equal the history this run's length would have recorded from
the same amaxes (a longer one keeps them all and is zero past them, a shorter one keeps the newest), and the
scale after the load must be the one that history gives.
"""

import pytest
import torch

from megatron.core.fp8.tensor import scale_from_amax

AMAXES = (3.0, 40.0, 7.0, 0.5, 2.0)  # recorded oldest to newest; the largest is neither the newest nor the oldest


def _recorded_histories(length):
    """The history of a delayed-scaling state of `length` after recording AMAXES in order."""
    from megatron.core import fp8_utils
    from megatron.core.fp8.scaling import ScalingState

    recipe = fp8_utils.Fp8RecipeSettings(fp8_utils.get_fp8_format("hybrid"), "delayed", amax_history_len=length)
    state = ScalingState(recipe, torch.float8_e4m3fn, sharded_over_tensor_parallel=False)
    for value in AMAXES:
        state._record_pending(torch.tensor(value))
        fp8_utils.reduce_and_record_amaxes([state], [])
    return state.amax_history.clone()


@pytest.mark.parametrize("saved_length,length", [(3, 6), (4, 2), (5, 1)])
def test_fitting_a_history_gives_the_history_the_new_length_records(saved_length, length):
    from megatron.core.fp8.checkpoint import fit_amax_history

    saved = _recorded_histories(saved_length)
    assert saved[0] == AMAXES[-1]  # newest first
    fitted = fit_amax_history(saved, length)
    want = _recorded_histories(length)
    if length > saved_length:  # amaxes older than the saved ones were never kept: zeros there
        want[saved_length:] = 0.0
    assert torch.equal(fitted, want)


def _delayed_layer(history_len):
    from megatron.core.extensions.transformer_engine import layer_classes
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2, fp8="hybrid",
                               fp8_recipe="delayed", fp8_amax_history_len=history_len, fp8_amax_compute_algo="max")
    torch.manual_seed(0)
    return layer_classes(config)[0](16, 32, config=config, init_method=torch.nn.init.normal_, bias=True), config


def _trained_state_dict(history_len, steps):
    from megatron.core import fp8_utils

    layer, config = _delayed_layer(history_len)
    generator = torch.Generator().manual_seed(1)
    for step in range(steps):
        x = torch.randn(4, 16, generator=generator) * (1 + (step * 7) % 5)  # amaxes that rise and fall
        with fp8_utils.get_fp8_context(config, layer_no=0):
            out, _ = layer(x)
        out.square().sum().backward()
        fp8_utils.reduce_fp8_amaxes([layer])
    return {name: value.clone() for name, value in layer.state_dict().items()}


@pytest.mark.parametrize("saved_length,length", [(4, 8), (4, 2)])
def test_layer_load_fits_the_histories_and_scales_by_them(saved_length, length):
    """`load_state_dict` (the `--ckpt-format torch` path) into a layer of another history length."""
    saved = _trained_state_dict(saved_length, steps=5)
    history = saved["fp8_amax_history"]
    assert history.shape == (3, saved_length) and history.min() > 0  # five amaxes recorded into each history

    layer, _ = _delayed_layer(length)
    layer.load_state_dict(saved)
    kept = min(saved_length, length)
    assert torch.equal(layer.fp8_amax_history[:, :kept], history[:, :kept])  # the newest amaxes
    assert torch.equal(layer.fp8_amax_history[:, kept:], torch.zeros(3, length - kept))
    assert torch.equal(layer.fp8_amax_recorded_count, saved["fp8_amax_recorded_count"])

    # `max` of the history: a shorter length forgets the older amaxes, a longer one scales as before.
    if length < saved_length:
        assert (history[:, :kept].amax(dim=1) < history.amax(dim=1)).any()  # the forgotten amaxes matter
    scaling = layer.fp8_scaling(layer._fp8_history_recipe)
    x = torch.randn(4, 16)
    for index, state in enumerate(scaling.states()):
        want = scale_from_amax(history[index, :kept].max(), state.dtype)
        assert torch.equal(state.scale_for(x), want), scaling.ROLES[index]
