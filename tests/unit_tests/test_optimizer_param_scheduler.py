"""Learning-rate and weight-decay curves against closed forms, and the scheduler's checkpoint checks."""

import math

import pytest
import torch

from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler


def _optimizer(lr_mult=1.0, wd_mult=1.0):
    params = [torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))]
    return torch.optim.SGD(
        [{"params": params[:1]}, {"params": params[1:], "lr_mult": lr_mult, "wd_mult": wd_mult}], lr=1.0
    )


def _scheduler(optimizer, style, warmup=10, decay=110, init_lr=0.0, max_lr=1.0, min_lr=0.1, **kwargs):
    arguments = dict(init_lr=init_lr, max_lr=max_lr, min_lr=min_lr, lr_warmup_steps=warmup, lr_decay_steps=decay,
                     lr_decay_style=style, start_wd=0.01, end_wd=0.01, wd_incr_steps=100, wd_incr_style="constant")
    arguments.update(kwargs)
    return OptimizerParamScheduler(optimizer, **arguments)


def _expected_lr(style, step, warmup=10, decay=110, init_lr=0.0, max_lr=1.0, min_lr=0.1):
    if step <= warmup:
        return init_lr + (max_lr - init_lr) * step / warmup
    if style == "constant":
        return max_lr
    if step > decay:
        return min_lr
    ratio = (step - warmup) / (decay - warmup)
    coeff = 1 - ratio if style == "linear" else 0.5 * (1 + math.cos(math.pi * ratio))
    return min_lr + coeff * (max_lr - min_lr)


@pytest.mark.parametrize("style", ["constant", "linear", "cosine"])
def test_lr_curve_matches_closed_form(style):
    optimizer = _optimizer(lr_mult=0.5)
    scheduler = _scheduler(optimizer, style, init_lr=0.05)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.05)  # step 0 is applied at construction
    for step in range(1, 131):
        scheduler.step()
        expected = _expected_lr(style, step, init_lr=0.05)
        assert optimizer.param_groups[0]["lr"] == pytest.approx(expected, abs=1e-12), step
        assert optimizer.param_groups[1]["lr"] == pytest.approx(0.5 * expected, abs=1e-12), step
    # Spot values: end of warmup is max_lr, the cosine midpoint is halfway, after decay it is min_lr.
    if style == "cosine":
        assert _expected_lr(style, 60) == pytest.approx(0.55)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(1.0 if style == "constant" else 0.1)


def test_step_increment_skips_ahead():
    optimizer = _optimizer()
    scheduler = _scheduler(optimizer, "linear")
    scheduler.step(increment=35)
    assert scheduler.num_steps == 35
    assert optimizer.param_groups[0]["lr"] == pytest.approx(1.0 - 0.9 * 25 / 100)


@pytest.mark.parametrize("style", ["linear", "cosine"])
def test_weight_decay_increment(style):
    optimizer = _optimizer(wd_mult=0.0)
    scheduler = _scheduler(optimizer, "constant", start_wd=0.0, end_wd=0.1, wd_incr_steps=20, wd_incr_style=style)
    for step in range(1, 26):
        scheduler.step()
        ratio = min(step / 20, 1.0)
        coeff = ratio if style == "linear" else 0.5 * (math.cos(math.pi * (1 - ratio)) + 1)
        assert optimizer.param_groups[0]["weight_decay"] == pytest.approx(0.1 * coeff, abs=1e-12)
        assert optimizer.param_groups[1]["weight_decay"] == 0.0


def test_groups_with_weight_decay_bounds_of_their_own_follow_them():
    """As upstream's `get_wd(param_group)`: a group's `start_wd` / `end_wd` replace the scheduler's."""
    optimizer = _optimizer()
    optimizer.param_groups[1].update(start_wd=0.0, end_wd=0.4)
    scheduler = _scheduler(optimizer, "constant", start_wd=0.1, end_wd=0.2, wd_incr_steps=20, wd_incr_style="linear")
    scheduler.step(increment=5)  # a quarter of the way
    assert scheduler.get_wd() == pytest.approx(0.125)
    assert scheduler.get_wd(optimizer.param_groups[1]) == pytest.approx(0.1)
    assert [group["weight_decay"] for group in optimizer.param_groups] == pytest.approx([0.125, 0.1])
    scheduler.step(increment=30)
    assert [group["weight_decay"] for group in optimizer.param_groups] == [0.2, 0.4]


def test_state_dict_round_trip_and_mismatch_checks():
    scheduler = _scheduler(_optimizer(), "cosine")
    scheduler.step(increment=42)
    state = scheduler.state_dict()

    restored_optimizer = _optimizer()
    restored = _scheduler(restored_optimizer, "cosine")
    restored.load_state_dict(state)
    assert restored.num_steps == 42
    assert restored_optimizer.param_groups[0]["lr"] == pytest.approx(_expected_lr("cosine", 42))

    strict = _scheduler(_optimizer(), "cosine", max_lr=2.0, use_checkpoint_opt_param_scheduler=False)
    with pytest.raises(ValueError) as mismatch:
        strict.load_state_dict(state)
    assert "max_lr (from --lr) is 2.0 in this run but 1.0 in the checkpoint" in str(mismatch.value)
    assert "--override-opt_param-scheduler" in str(mismatch.value)
    assert "--use-checkpoint-opt_param-scheduler" in str(mismatch.value)

    overriding_optimizer = _optimizer()
    overriding = _scheduler(overriding_optimizer, "cosine", max_lr=2.0, override_opt_param_scheduler=True)
    overriding.load_state_dict(state)
    assert overriding.max_lr == 2.0 and overriding.num_steps == 42
    assert overriding_optimizer.param_groups[0]["lr"] == pytest.approx(_expected_lr("cosine", 42, max_lr=2.0))

    trusting = _scheduler(_optimizer(), "cosine", max_lr=2.0)
    trusting.load_state_dict(state)
    assert trusting.max_lr == 1.0  # the checkpoint's value wins by default


def test_invalid_arguments_are_rejected():
    with pytest.raises(ValueError, match="lr_warmup_steps"):
        _scheduler(_optimizer(), "linear", warmup=200, decay=100)
    with pytest.raises(ValueError, match="min_lr"):
        _scheduler(_optimizer(), "linear", min_lr=2.0)
    with pytest.raises(ValueError, match="lr_decay_style"):
        _scheduler(_optimizer(), "exponential")


def test_fractional_warmup_is_not_rounded():
    # --lr-warmup-fraction 0.13 of 4 iterations x 2 samples: a warm-up of 1.04 samples, as upstream.
    optimizer = _optimizer()
    scheduler = _scheduler(optimizer, "linear", warmup=0.13 * 8, decay=8, max_lr=1e-3, min_lr=0.0)
    scheduler.step(increment=1)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(1e-3 / 1.04, rel=1e-12)
    scheduler.step(increment=1)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(1e-3 * (1 - (2 - 1.04) / (8 - 1.04)), rel=1e-12)


def test_inverse_square_root_ends_at_min_lr_after_decay():
    optimizer = _optimizer()
    scheduler = _scheduler(optimizer, "inverse-square-root", warmup=4, decay=16, max_lr=1.0, min_lr=0.1)
    scheduler.step(increment=9)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(2.0 / 3.0)  # sqrt(4) / sqrt(9)
    scheduler.step(increment=7)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.5)  # step 16 = decay end: sqrt(4) / sqrt(16)
    scheduler.step()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.1)  # past --lr-decay-iters: min_lr


def _decoupled_optimizer(decoupled_lr=None, decoupled_min_lr=0.0):
    """A plain group and, with `decoupled_lr`, an embedding group with its own peak and final learning rate."""
    embedding_group = {"params": [torch.nn.Parameter(torch.zeros(2))]}
    if decoupled_lr is not None:
        embedding_group.update(max_lr=decoupled_lr, min_lr=decoupled_min_lr)
    return torch.optim.AdamW([{"params": [torch.nn.Parameter(torch.zeros(2))]}, embedding_group], lr=1.0)


def _resumed(saved_optimizer, saved_scheduler, decoupled_lr, **flags):
    """A run with `decoupled_lr` loading a checkpoint as training does: the optimizer (which restores the saved
    groups' hyperparameters), then the scheduler."""
    optimizer = _decoupled_optimizer(decoupled_lr)
    scheduler = _scheduler(optimizer, "linear", **flags)
    optimizer.load_state_dict(saved_optimizer.state_dict())
    scheduler.load_state_dict(saved_scheduler.state_dict())
    return optimizer, scheduler


def test_decoupled_lr_on_resume_follows_the_scheduler_flags():
    saved_optimizer = _decoupled_optimizer(decoupled_lr=5.0)
    saved_scheduler = _scheduler(saved_optimizer, "linear")
    saved_scheduler.step(increment=60)  # half-way through the decay: lr = min + 0.5 * (max - min)
    assert saved_optimizer.param_groups[1]["lr"] == pytest.approx(2.5)

    with pytest.raises(ValueError, match=r"decoupled_lr \(from --decoupled-lr\) is 8.0 in this run but 5.0"):
        _resumed(saved_optimizer, saved_scheduler, 8.0, use_checkpoint_opt_param_scheduler=False)

    optimizer, _ = _resumed(saved_optimizer, saved_scheduler, 8.0, override_opt_param_scheduler=True)
    assert optimizer.param_groups[1]["lr"] == pytest.approx(4.0)  # this run's --decoupled-lr
    assert optimizer.param_groups[0]["lr"] == pytest.approx(_expected_lr("linear", 60))

    optimizer, scheduler = _resumed(saved_optimizer, saved_scheduler, 8.0, use_checkpoint_opt_param_scheduler=True)
    scheduler.step(increment=10)
    assert optimizer.param_groups[1]["lr"] == pytest.approx(5.0 * 0.4)  # the checkpoint's, 70 of 110 steps


def test_resume_without_decoupled_lr_keeps_the_embedding_on_the_global_schedule():
    saved_optimizer = _decoupled_optimizer(decoupled_lr=5.0)
    saved_scheduler = _scheduler(saved_optimizer, "linear")
    saved_scheduler.step(increment=60)

    # The loaded optimizer state puts the saved group's max_lr on this run's (plain) second group; this run
    # (like a pipeline stage without embedding or output layer) has no decoupled group, so nothing is compared.
    for flags in ({}, {"use_checkpoint_opt_param_scheduler": False}, {"override_opt_param_scheduler": True}):
        optimizer, _ = _resumed(saved_optimizer, saved_scheduler, None, **flags)
        assert [group["lr"] for group in optimizer.param_groups] == pytest.approx([_expected_lr("linear", 60)] * 2)
        assert "max_lr" not in optimizer.param_groups[1]


def test_groups_with_rates_of_their_own_keep_them_on_resume():
    """Hand-built groups with differing `max_lr` / `min_lr` (upstream's per-group rates) are scheduled each on its
    own, before and after a resume."""
    def build():
        groups = [{"params": [torch.nn.Parameter(torch.zeros(2))], "max_lr": 1.0, "min_lr": 0.1},
                  {"params": [torch.nn.Parameter(torch.zeros(2))], "max_lr": 0.5, "min_lr": 0.05}]
        optimizer = torch.optim.AdamW(groups, lr=1.0)
        return optimizer, _scheduler(optimizer, "linear", use_checkpoint_opt_param_scheduler=False)

    saved_optimizer, saved_scheduler = build()
    saved_scheduler.step(increment=60)  # half-way through the decay
    expected = [0.1 + 0.5 * 0.9, 0.05 + 0.5 * 0.45]
    assert [group["lr"] for group in saved_optimizer.param_groups] == pytest.approx(expected)
    optimizer, scheduler = build()
    optimizer.load_state_dict(saved_optimizer.state_dict())
    scheduler.load_state_dict(saved_scheduler.state_dict())
    assert [group["lr"] for group in optimizer.param_groups] == pytest.approx(expected)
    assert [group["max_lr"] for group in optimizer.param_groups] == [1.0, 0.5]
