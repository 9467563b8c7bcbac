"""Turns raw per-rank, per-repetition results into one summary per arm (medians, ratios, theory, losses).

Input layout: `results[memory_mode][arm_name]` is a list of repetitions, each a list of per-rank result dicts
as returned by `bench_worker.run_arm`. Step times come from the `timing_mode` (default malloc) runs; peak RSS
is summarised separately for every memory mode.
"""

import statistics

from examples.megatron_fsdp import bench_theory
from examples.megatron_fsdp.bench_arms import ARMS, regathered_param_bytes, state_from_memory_report


def _first_error(repetitions):
    for ranks in repetitions:
        for rank_result in ranks:
            if rank_result.get("error"):
                return rank_result["error"]
    return None


def _global_losses(ranks):
    """Mean of the ranks' micro-batch losses per step: the global-batch loss (equal micro-batch sizes)."""
    return [statistics.fmean(values) for values in zip(*(r["losses"] for r in ranks))]


def _largest_rank(per_rank_dicts):
    """Key-wise maximum over ranks (shards can differ by padding)."""
    per_rank_dicts = list(per_rank_dicts)
    return {key: max(d[key] for d in per_rank_dicts) for key in per_rank_dicts[0]}


def _rss_summary(repetitions, in_process):
    """Median over repetitions of the largest rank's peak: lifetime peak, and growth over the arm's start."""
    lifetime = [max(r["rss_lifetime_peak"] for r in ranks) for ranks in repetitions]
    growth = [max(r["rss_arm_peak"] - r["rss_baseline"] for r in ranks) for ranks in repetitions]
    return {
        # In one process that runs many arms the lifetime peak belongs to the heaviest arm so far: not reported.
        "peak": None if in_process else statistics.median(lifetime),
        "growth": statistics.median(growth),
    }


def _phase_medians(repetitions):
    """(forward, backward, optimizer step) seconds: per phase, the slowest rank per step, the median over
    post-warm-up steps, then the median over repetitions."""
    per_phase = []
    for phase in range(3):
        per_rep = [
            bench_theory.median_after_warmup(
                bench_theory.slowest_rank_step_times([[step[phase] for step in r["phase_times"]] for r in ranks]),
                ranks[0]["warmup_steps"],
            )
            for ranks in repetitions
        ]
        per_phase.append(statistics.median(per_rep))
    return per_phase


def summarise(results, arm_names, param_bytes, world_size, timing_mode, in_process):
    summaries = {}
    reference_losses = None
    for mode_results in results.values():
        ddp_reps = mode_results.get("ddp")
        if ddp_reps and not _first_error(ddp_reps):
            reference_losses = _global_losses(ddp_reps[0])
            break
    for name in arm_names:
        spec = ARMS[name]
        summary = {
            "label": spec.label,
            "zero_strategy": spec.zero_strategy if spec.is_megatron_fsdp else None,
            "theory_zero_strategy": spec.zero_strategy,
            "error": None,
            "rss": {},
        }
        summaries[name] = summary
        for mode, mode_results in results.items():
            repetitions = mode_results.get(name, [])
            error = _first_error(repetitions)
            if error:
                summary["error"] = error
                continue
            if not repetitions:
                continue
            summary["rss"][mode] = _rss_summary(repetitions, in_process)
            if mode == timing_mode or "step_time" not in summary:
                per_rep = [
                    bench_theory.median_after_warmup(
                        bench_theory.slowest_rank_step_times([r["step_times"] for r in ranks]),
                        ranks[0]["warmup_steps"],
                    )
                    for ranks in repetitions
                ]
                summary["step_time"] = statistics.median(per_rep)
                summary["step_time_reps"] = per_rep
                if all("phase_times" in r for ranks in repetitions for r in ranks):
                    summary["phase_times"] = _phase_medians(repetitions)
            if reference_losses is not None:
                diffs = [
                    bench_theory.max_abs_difference(_global_losses(ranks), reference_losses) for ranks in repetitions
                ]
                summary["loss_max_abs_diff"] = max(diffs + [summary.get("loss_max_abs_diff", 0.0)])
            first = repetitions[0]
            summary["losses"] = _global_losses(first)
            summary["state_storages"] = _largest_rank(r["state_bytes"] for r in first)
            summary["state"] = summary["state_storages"]
            if all(r.get("package_memory") for r in first):
                summary["package_memory"] = _largest_rank(r["package_memory"] for r in first)
                summary["state"] = state_from_memory_report(summary["package_memory"])
            last_step = first[0]["comm_per_step"][-1]
            summary["comm_payloads"] = last_step["payload_bytes"]
            summary["comm_calls"] = last_step["calls"]
            summary["wire_bytes"] = last_step["wire_bytes"]
            summary["volume"] = bench_theory.counted_step_volume(last_step)
            summary["comm_steady"] = all(
                step["payload_bytes"] == last_step["payload_bytes"] for step in first[0]["comm_per_step"][1:]
            )
            package_comm = first[0].get("package_comm_last_step")
            if package_comm is not None:
                summary["package_sent"] = sum(v for kind, v in package_comm.items() if kind != "steps")
                summary["reports"] = {
                    "memory_report()": first[0]["package_memory"],
                    "communication_report(), last step": package_comm,
                }
        summary["theory_state"] = bench_theory.zero_state_bytes(spec.zero_strategy, param_bytes, world_size)
        theory_payloads = bench_theory.zero_comm_payloads(
            spec.zero_strategy, param_bytes, regathered_param_bytes(spec, param_bytes)
        )
        summary["theory_volume"] = bench_theory.comm_volume(theory_payloads)
        neutral = summary["rss"].get("neutral", {})
        summary["rss_neutral"] = neutral.get("peak") or neutral.get("growth")
    ddp_time = summaries.get("ddp", {}).get("step_time")
    fsdp2_time = summaries.get("fsdp2", {}).get("step_time")
    for summary in summaries.values():
        summary["vs_ddp"] = bench_theory.ratio(summary.get("step_time"), ddp_time)
        summary["vs_fsdp2"] = bench_theory.ratio(summary.get("step_time"), fsdp2_time)
    return summaries
