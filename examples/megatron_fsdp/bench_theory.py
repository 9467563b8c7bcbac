"""Pure arithmetic of the benchmark: ZeRO theory for state and communication bytes, summaries, targets.

No torch and no processes here, so every formula is checked by a unit test on hand-computed numbers.

Communication is counted as *payload* bytes per collective: the size of the whole logical tensor (the gathered
output of an all-gather, the input of a reduce-scatter, the all-reduced tensor). The *volume* of a step weights
each payload by how many times a bandwidth-optimal algorithm moves it: an all-reduce is a reduce-scatter plus
an all-gather, so it counts twice; the others count once. In those units the ZeRO paper's per-step volumes are
2 psi for DDP, ZeRO-1 and ZeRO-2 and 3 psi for ZeRO-3 (psi = parameter bytes). Bytes actually sent by one rank
on a ring are volume * (g - 1) / g for a group of g ranks.

Point-to-point messages (`isend`/`send`, which Megatron-FSDP uses to build its collectives on gloo) are counted
by the sender as the bytes it sends. Those bytes are already on the wire, so their volume runs the ring formula
backwards: bytes sent * g / (g - 1), g being the size of the group the message went through. A rank that sends
its n-byte shard to each of its g - 1 peers has then moved the volume of an all-gather of the g * n-byte output.
Because that needs g, the counter records the volume of every call as it happens (`volume_bytes`).
"""

import statistics

COLLECTIVE_VOLUME_FACTOR = {
    "all_reduce": 2,
    "all_gather": 1,
    "reduce_scatter": 1,
    "all_to_all": 1,
    "broadcast": 1,
    "reduce": 1,
}

ZERO_STRATEGY_NAMES = {0: "no_shard", 1: "optim", 2: "optim_grads", 3: "optim_grads_params"}

POINT_TO_POINT = "point_to_point"

MIB = 1024 * 1024


def wire_bytes_per_rank(kind, payload_bytes, group_size):
    """Bytes one rank sends for one call: on a ring of `group_size` ranks for a collective, the message itself for
    a point-to-point send."""
    if group_size <= 1:
        return 0.0
    if kind == POINT_TO_POINT:
        return float(payload_bytes)
    return COLLECTIVE_VOLUME_FACTOR[kind] * payload_bytes * (group_size - 1) / group_size


def volume_bytes(kind, payload_bytes, group_size):
    """Volume of one call (see module docstring): a collective's weighted payload whatever the group size, a
    point-to-point send's bytes * g / (g - 1); a message within a one-rank group moves nothing."""
    if kind == POINT_TO_POINT:
        return payload_bytes * group_size / (group_size - 1) if group_size > 1 else 0.0
    return COLLECTIVE_VOLUME_FACTOR[kind] * payload_bytes


def zero_state_bytes(strategy, param_bytes, world_size, optimizer_bytes_per_param_byte=2):
    """Per-rank bytes of (params, grads, optimizer state) under ZeRO-`strategy`, ignoring shard padding.

    AdamW keeps two fp32 moments per fp32 parameter, hence `optimizer_bytes_per_param_byte=2`.
    """
    if strategy not in ZERO_STRATEGY_NAMES:
        raise ValueError(f"zero strategy must be one of 0, 1, 2, 3, got {strategy!r}")
    optimizer = optimizer_bytes_per_param_byte * param_bytes
    params = param_bytes / world_size if strategy >= 3 else param_bytes
    grads = param_bytes / world_size if strategy >= 2 else param_bytes
    optimizer = optimizer / world_size if strategy >= 1 else optimizer
    return {"params": params, "grads": grads, "optimizer": optimizer}


def zero_comm_payloads(strategy, param_bytes, regathered_param_bytes=None):
    """Per-step payload bytes by collective kind under ZeRO-`strategy` (one micro-batch per step).

    ZeRO-0 all-reduces the gradients. ZeRO-1 and ZeRO-2 reduce-scatter the gradients and all-gather the
    updated parameters. ZeRO-3 all-gathers the parameters for forward, again for backward those that were
    released after forward (`regathered_param_bytes`, all of them by default), and reduce-scatters gradients.
    """
    if strategy == 0:
        return {"all_reduce": param_bytes}
    if strategy in (1, 2):
        return {"reduce_scatter": param_bytes, "all_gather": param_bytes}
    if strategy == 3:
        regathered = param_bytes if regathered_param_bytes is None else regathered_param_bytes
        return {"reduce_scatter": param_bytes, "all_gather": param_bytes + regathered}
    raise ValueError(f"zero strategy must be one of 0, 1, 2, 3, got {strategy!r}")


def comm_volume(payloads):
    """Volume of a step from collective payloads by kind: all-reduce payloads count twice (see module docstring).

    Point-to-point bytes need the group size they were sent in, which payloads by kind do not keep: take the
    counter's `volume_bytes` instead (see `counted_step_volume`).
    """
    if POINT_TO_POINT in payloads:
        raise ValueError("point-to-point payloads have no volume without their group size; use volume_bytes")
    return sum(COLLECTIVE_VOLUME_FACTOR[kind] * size for kind, size in payloads.items())


def counted_step_volume(step_snapshot):
    """Volume of one counted step: the counter's own `volume_bytes`, or, for results recorded before the counter
    kept it (collectives only), the volume of the step's payloads."""
    if "volume_bytes" in step_snapshot:
        return step_snapshot["volume_bytes"]
    return comm_volume(step_snapshot["payload_bytes"])


def median_after_warmup(step_times, warmup_steps):
    """Median of the steps after the first `warmup_steps`; all steps if none are left after warm-up."""
    measured = list(step_times[warmup_steps:]) or list(step_times)
    if not measured:
        raise ValueError("no step times to summarise")
    return statistics.median(measured)


def slowest_rank_step_times(per_rank_step_times):
    """A step ends when its slowest rank ends: element-wise max over ranks."""
    return [max(times) for times in zip(*per_rank_step_times)]


def max_abs_difference(values, reference):
    if len(values) != len(reference):
        raise ValueError(f"loss curves differ in length: {len(values)} vs {len(reference)}")
    return max((abs(a - b) for a, b in zip(values, reference)), default=0.0)


def ratio(value, reference):
    if value is None or not reference:
        return None
    return value / reference


# Targets the benchmark checks for Megatron-FSDP (strategy 3 against the torch peers on the same model).
LOSS_TOLERANCE = 1e-5
COMM_VOLUME_TOLERANCE = 0.02
"""Bytes communicated per step may exceed the ZeRO theory by at most this fraction (less is allowed: groups
that stay gathered for the whole step are not gathered again for backward)."""
STATE_BYTES_TOLERANCE = 0.05
STEP_TIME_VS_FSDP2_LIMIT = 0.80
STEP_TIME_VS_DDP_LIMIT = 1.15
NEUTRAL_RSS_VS_FSDP2_LIMIT = 0.90


def _ratio_row(target, numerator, denominator, limit, unit_divisor=None):
    if not numerator or not denominator:
        return (target, "n/a", "an arm has no value")
    value = numerator / denominator
    detail = f"{value:.2f} x"
    if unit_divisor:
        detail += f" ({numerator / unit_divisor:.0f} vs {denominator / unit_divisor:.0f} MiB)"
    return (target, "pass" if value <= limit else "FAIL", detail)


def evaluate_targets(arms):
    """Pass/fail rows from per-arm summaries.

    `arms` maps arm name -> summary dict with keys `zero_strategy` (None for torch arms), `step_time`,
    `loss_max_abs_diff`, `volume`, `theory_volume`, `state` and `theory_state` (dicts of bytes), `rss_neutral`.
    Returns a list of (target, verdict, detail) where verdict is "pass", "FAIL" or "n/a".
    """
    rows = []
    megatron = {name: arm for name, arm in arms.items() if arm.get("zero_strategy") is not None}

    def verdict(condition):
        return "pass" if condition else "FAIL"

    for name, arm in sorted(megatron.items()):
        if arm.get("error"):
            rows.append((f"{name} runs", "FAIL", arm["error"]))
            continue
        diff = arm.get("loss_max_abs_diff")
        if diff is not None:
            target = f"{name} loss equals DDP within {LOSS_TOLERANCE:g}"
            rows.append((target, verdict(diff <= LOSS_TOLERANCE), f"{diff:.2e}"))
        volume, theory_volume = arm.get("volume"), arm.get("theory_volume")
        if volume is not None and theory_volume:
            rows.append(
                (
                    f"{name} comm volume at most ZeRO theory + {COMM_VOLUME_TOLERANCE:.0%}",
                    verdict(volume <= theory_volume * (1.0 + COMM_VOLUME_TOLERANCE)),
                    f"{volume / MIB:.2f} MiB vs {theory_volume / MIB:.2f} MiB ({volume / theory_volume:.3f} x)",
                )
            )
        state, theory_state = arm.get("state"), arm.get("theory_state")
        if state and theory_state:
            worst = max(abs(state[key] / theory_state[key] - 1.0) for key in theory_state if theory_state[key])
            rows.append(
                (
                    f"{name} state bytes within {STATE_BYTES_TOLERANCE:.0%} of ZeRO theory",
                    verdict(worst <= STATE_BYTES_TOLERANCE),
                    f"worst deviation {worst:.1%}",
                )
            )
    zero3, fsdp2, ddp = arms.get("mfsdp3", {}), arms.get("fsdp2", {}), arms.get("ddp", {})
    rows.append(
        _ratio_row(
            f"mfsdp3 step time <= {STEP_TIME_VS_FSDP2_LIMIT:.2f} x FSDP2",
            zero3.get("step_time"), fsdp2.get("step_time"), STEP_TIME_VS_FSDP2_LIMIT,
        )
    )
    rows.append(
        _ratio_row(
            f"mfsdp3 step time <= {STEP_TIME_VS_DDP_LIMIT:.2f} x DDP",
            zero3.get("step_time"), ddp.get("step_time"), STEP_TIME_VS_DDP_LIMIT,
        )
    )
    rows.append(
        _ratio_row(
            f"mfsdp3 allocator-neutral peak RSS <= {NEUTRAL_RSS_VS_FSDP2_LIMIT:.2f} x FSDP2",
            zero3.get("rss_neutral"), fsdp2.get("rss_neutral"), NEUTRAL_RSS_VS_FSDP2_LIMIT, MIB,
        )
    )
    return rows
