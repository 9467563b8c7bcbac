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


def test_static_scale_on_resume_is_this_runs_flag_not_the_checkpoints():
    saved = ConstantGradScaler(1024.0).state_dict()
    resumed = ConstantGradScaler(4096.0)  # --loss-scale changed on resume
    resumed.load_state_dict(saved)
    assert resumed.scale.item() == 4096.0
    from_dynamic = ConstantGradScaler(8.0)  # resuming a dynamically scaled run with a static scale
    from_dynamic.load_state_dict(DynamicGradScaler(initial_scale=2.0**20).state_dict())
    assert from_dynamic.scale.item() == 8.0


def test_dynamic_scaler_resumes_a_dynamic_checkpoint_and_starts_afresh_from_a_static_one():
    saved = DynamicGradScaler(initial_scale=1024.0, growth_interval=3, hysteresis=2)
    for found_inf in (OVERFLOW, OVERFLOW, CLEAN):
        saved.update(found_inf)
    resumed = DynamicGradScaler(initial_scale=2.0**16, growth_interval=3, hysteresis=2)
    resumed.load_state_dict(saved.state_dict())
    assert resumed.state_dict() == {"scale": 512.0, "growth_tracker": 1, "hysteresis_tracker": 0}

    from_static = DynamicGradScaler(initial_scale=2.0**16, growth_interval=3, hysteresis=2)
    from_static.load_state_dict(ConstantGradScaler(1024.0).state_dict())
    assert from_static.state_dict() == {"scale": 2.0**16, "growth_tracker": 0, "hysteresis_tracker": 2}
    for found_inf, expected in ((OVERFLOW, 2.0**16), (OVERFLOW, 2.0**15), (CLEAN, 2.0**15)):
        from_static.update(found_inf)
        assert from_static.scale.item() == expected
