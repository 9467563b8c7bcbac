"""The fp16 loss scalers against upstream's rules, step by step: the dynamic scale doubles after
`--loss-scale-window` clean steps in a row, halves on each overflow once `--hysteresis` overflows have been
tolerated (the allowance comes back only when the scale grows), and never drops below `--min-loss-scale`."""

import pytest

from megatron.core.optimizer.grad_scaler import ConstantGradScaler, DynamicGradScaler

OVERFLOW, CLEAN = True, False


def test_dynamic_scaler_follows_upstreams_rules_step_by_step():
    scaler = DynamicGradScaler(initial_scale=1024.0, min_scale=128.0, growth_interval=3, hysteresis=2)
    trace = [  # (found_inf, scale after the update)
        (OVERFLOW, 1024.0),  # first overflow: tolerated (hysteresis 2 -> 1)
        (CLEAN, 1024.0), (CLEAN, 1024.0),  # two clean steps: no growth yet, hysteresis stays spent
        (OVERFLOW, 512.0),  # second overflow: halved, and the clean-step count restarts
        (CLEAN, 512.0), (CLEAN, 512.0), (CLEAN, 1024.0),  # three clean in a row: doubled, hysteresis back to 2
        (OVERFLOW, 1024.0),  # tolerated again
        (OVERFLOW, 512.0), (OVERFLOW, 256.0), (OVERFLOW, 128.0),  # each further overflow halves ...
        (OVERFLOW, 128.0),  # ... down to the floor, not below
        (CLEAN, 128.0), (CLEAN, 128.0), (CLEAN, 256.0),
    ]
    for step, (found_inf, expected) in enumerate(trace):
        scaler.update(found_inf)
        assert scaler.scale.item() == expected, (step, found_inf, scaler.scale.item())
        assert scaler.inv_scale.item() == 1.0 / expected
    assert scaler.state_dict() == {"scale": 256.0, "growth_tracker": 0, "hysteresis_tracker": 2}


def test_constant_scaler_never_moves():
    scaler = ConstantGradScaler(4096.0)
    for found_inf in (OVERFLOW, OVERFLOW, CLEAN, OVERFLOW):
        scaler.update(found_inf)
        assert scaler.scale.item() == 4096.0


@pytest.mark.parametrize("settings, message", [
    (dict(initial_scale=4.0, min_scale=8.0), r"need 0 < min_scale \(8.0\) <= initial_scale \(4.0\)"),
    (dict(initial_scale=4.0, growth_interval=0), r"growth_interval \(--loss-scale-window\) must be at least 1, got 0"),
    (dict(initial_scale=4.0, hysteresis=0), r"hysteresis \(--hysteresis\) must be at least 1, got 0"),
])
def test_dynamic_scaler_rejects_settings_that_would_never_grow_or_start_below_the_floor(settings, message):
    with pytest.raises(ValueError, match=message):
        DynamicGradScaler(**settings)
