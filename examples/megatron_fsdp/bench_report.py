"""Formatting of the benchmark's results: markdown tables for docs/benchmarks.md and a hand-written SVG plot.

Pure functions of the summaries built by `bench_summary.summarise`; nothing here measures anything.
"""

import html

from examples.megatron_fsdp.bench_theory import MIB, POINT_TO_POINT, evaluate_targets

COMM_KINDS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "broadcast", POINT_TO_POINT)
COMM_KIND_HEADERS = {POINT_TO_POINT: "point-to-point sent MiB"}


def markdown_table(headers, rows):
    """A GitHub markdown table; cells are str()-ed and pipes inside cells are escaped."""

    def cell(value):
        return str(value).replace("|", "\\|").replace("\n", " ")

    lines = ["| " + " | ".join(cell(h) for h in headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def format_mib(num_bytes, digits=1):
    return "" if num_bytes is None else f"{num_bytes / MIB:.{digits}f}"


def format_seconds(seconds):
    if seconds is None:
        return ""
    return f"{seconds:.3f}" if seconds < 10 else f"{seconds:.2f}"


def format_ratio(value):
    return "" if value is None else f"{value:.2f}"


def format_spread(values):
    """Spread of repeated measurements: largest over smallest, minus one, in percent."""
    if not values or len(values) < 2 or min(values) <= 0:
        return ""
    return f"{max(values) / min(values) - 1:.0%}"


def format_loss_diff(value):
    if value is None:
        return ""
    return "0" if value == 0 else f"{value:.1e}"


def timing_and_memory_rows(summaries, memory_modes):
    rows = []
    for name, arm in summaries.items():
        if arm["error"] and "step_time" not in arm:
            rows.append([name, arm["label"], arm["error"]] + [""] * (4 + 2 * len(memory_modes)))
            continue
        rss_cells = []
        for mode in memory_modes:
            rss = arm["rss"].get(mode, {})
            rss_cells += [format_mib(rss.get("peak"), 0), format_mib(rss.get("growth"), 0)]
        rows.append(
            [name, arm["label"], format_seconds(arm.get("step_time")), format_spread(arm.get("step_time_reps")),
             format_ratio(arm.get("vs_ddp")), format_ratio(arm.get("vs_fsdp2"))]
            + rss_cells
            + [format_loss_diff(arm.get("loss_max_abs_diff"))]
        )
    return rows


def phase_time_rows(summaries):
    ddp_phases = summaries.get("ddp", {}).get("phase_times")
    ddp_sum = sum(ddp_phases) if ddp_phases else None
    rows = []
    for name, arm in summaries.items():
        phases = arm.get("phase_times")
        if not phases:
            continue
        total = sum(phases)
        ratio = format_ratio(total / ddp_sum) if ddp_sum else ""
        rows.append([name] + [format_seconds(value) for value in phases] + [format_seconds(total), ratio])
    return rows


def _triple(state):
    return " / ".join(format_mib(state[key]) for key in ("params", "grads", "optimizer"))


def state_rows(summaries):
    rows = []
    for name, arm in summaries.items():
        if "state" not in arm:
            rows.append([name, arm["error"] or "not run", "", "", "", ""])
            continue
        package = arm.get("package_memory")
        rows.append(
            [name, _triple(arm["state"]), _triple(arm["state_storages"]), _triple(arm["theory_state"]),
             f"ZeRO-{arm['theory_zero_strategy']}", format_mib(package.get("transient_peak")) if package else ""]
        )  # fmt: skip
    return rows


def comm_headers():
    kind_headers = [COMM_KIND_HEADERS.get(kind, f"{kind} MiB") for kind in COMM_KINDS]
    return ["arm"] + kind_headers + ["volume MiB", "theory MiB", "ratio", "wire MiB/rank", "package sent MiB/rank",
                                     "same every step"]


def comm_rows(summaries):
    rows = []
    for name, arm in summaries.items():
        if "comm_payloads" not in arm:
            rows.append([name] + [""] * len(COMM_KINDS) + ["", format_mib(arm["theory_volume"], 2), "", "", "", ""])
            continue
        payloads = arm["comm_payloads"]
        kind_cells = [
            f"{format_mib(payloads[kind], 2)} ({arm['comm_calls'][kind]})" if kind in payloads else ""
            for kind in COMM_KINDS
        ]
        volume_ratio = arm["volume"] / arm["theory_volume"] if arm["theory_volume"] else None
        rows.append(
            [name]
            + kind_cells
            + [format_mib(arm["volume"], 2), format_mib(arm["theory_volume"], 2), format_ratio(volume_ratio),
               format_mib(arm["wire_bytes"], 2), format_mib(arm.get("package_sent"), 2),
               "yes" if arm["comm_steady"] else "no"]
        )
    return rows


def render_markdown(meta, summaries, memory_modes, method_text):
    """The whole docs/benchmarks.md: header facts, the four tables, targets, raw package reports, method."""
    parts = [f"# Megatron-FSDP benchmark: `{meta['model']}` model", ""]
    if meta.get("provisional"):
        parts += [
            "> **Provisional numbers.** This run was taken while the machine was shared with other work; "
            "timings are noisy. Re-run on a quiet machine before quoting them.",
            "",
        ]
    parts += [
        f"- device: {meta['device']}",
        f"- torch: {meta['torch_version']}, backend {meta['backend']}, {meta['world_size']} ranks, "
        f"{meta['threads']} thread(s) per rank, fp32, AdamW",
        f"- date: {meta['date']}",
        f"- command: `{meta['command']}`",
        f"- launch: {meta['launch']}",
        f"- model: {meta['model_description']}",
        f"- steps per measurement: {meta['steps']} ({meta['warmup']} warm-up), repetitions: "
        + ", ".join(f"{mode} {count}" for mode, count in meta["repeats"].items())
        + " (interleaved: every arm once, then every arm again)",
        f"- wall time of the whole benchmark: {meta['wall_s']:.0f} s",
        "",
        "## Step time, peak RSS and loss",
        "",
        "Step time: median over repetitions of the median post-warm-up step (slowest rank per step), "
        f"memory mode `{meta['timing_mode']}`; rep spread: slowest over fastest repetition, minus one. "
        "RSS per rank, MiB: *peak* is the process high-water mark "
        "(`ru_maxrss`, one arm per process), *growth* is the high-water mark above the RSS at the start of the arm "
        "(the kernel's, reset at that start, where Linux allows it; else sampled every 2 ms). dloss: max abs difference of the global loss from DDP's over all steps.",
        "",
    ]
    rss_headers = []
    for mode in memory_modes:
        rss_headers += [f"peak RSS ({mode})", f"growth ({mode})"]
    parts.append(
        markdown_table(
            ["arm", "config", "step s", "rep spread", "vs DDP", "vs FSDP2"] + rss_headers + ["max abs dloss vs DDP"],
            timing_and_memory_rows(summaries, memory_modes),
        )
    )
    phase_rows = phase_time_rows(summaries)
    if phase_rows:
        parts += [
            "",
            "## Where the step time goes",
            "",
            "Seconds per phase, same runs as above: *forward* includes `zero_grad`, *optimizer step* includes "
            "Megatron-FSDP's `finish_grad_sync` and weight install; per phase the slowest rank per step, median "
            "over post-warm-up steps, then over repetitions (so the phases need not add up to the step time exactly).",
            "",
            markdown_table(["arm", "forward s", "backward s", "optimizer step s", "sum s", "sum vs DDP"], phase_rows),
        ]
    parts += [
        "",
        "## State bytes per rank",
        "",
        "MiB held per rank after the last step: parameters / gradients / optimizer state. *held*: Megatron-FSDP's "
        "own `memory_report()` where the arm has one (parameters = compute + main weights), else the storages. "
        "*storages*: the storages of the tensors the model and optimizer expose, each counted once (shard padding "
        "included). Theory: ZeRO formulas without padding. Transient peak: the package's largest gathered-weight "
        "and in-flight gradient bytes.",
        "",
        markdown_table(
            ["arm", "held p / g / opt", "storages p / g / opt", "theory p / g / opt", "theory", "transient peak"],
            state_rows(summaries),
        ),
        "",
        "## Communication per step",
        "",
        "MiB of payload per collective kind in the last step (number of calls in parentheses), counted by "
        "wrapping `torch.distributed` collectives and point-to-point sends (`isend`, `send`) in the rank "
        "processes; point-to-point is the bytes this rank sent (Megatron-FSDP builds its all-gathers and "
        "reduce-scatters from such messages on gloo). Volume = all-reduce payload x 2 + other collective "
        "payloads + point-to-point bytes x g / (g - 1), g the size of the group each message went through, so "
        "that exchanging shards with every peer counts as much as the collective it replaces; ZeRO theory: 2 psi "
        "for ZeRO-0/1/2, 3 psi for ZeRO-3 (2 psi without resharding after forward), "
        f"psi = {format_mib(meta['param_bytes'], 2)} MiB of parameters. Wire: bytes one rank sends, "
        "collectives on a ring (volume x (g - 1) / g), point-to-point messages as sent. Package sent: "
        "Megatron-FSDP's own `communication_report()` for the same step.",
        "",
        markdown_table(comm_headers(), comm_rows(summaries)),
        "",
        "## Targets",
        "",
        markdown_table(["target", "result", "detail"], evaluate_targets(summaries)),
        "",
    ]
    reports = {name: arm["reports"] for name, arm in summaries.items() if arm.get("reports")}
    if reports:
        parts += ["## Megatron-FSDP's own reports (rank 0, bytes)", ""]
        for name, arm_reports in reports.items():
            parts.append(f"- `{name}`:")
            parts += [f"  - `{method}`: `{value}`" for method, value in arm_reports.items()]
        parts.append("")
    if meta.get("plot"):
        parts += [f"![step time and peak RSS per arm]({meta['plot']})", ""]
    parts += [method_text.strip(), ""]
    return "\n".join(parts)


def render_svg(summaries, memory_modes, title, rss_heading="peak RSS per rank, MiB"):
    """Two horizontal bar charts side by side: step time, and peak RSS (or its growth) per memory mode."""
    names = list(summaries)
    row_height, label_width, chart_width, gap = 22, 150, 260, 40
    top = 50
    height = top + row_height * len(names) + 40
    width = label_width + 2 * chart_width + gap + 40
    colours = ["#4a78b5", "#d08a2e", "#5aa469"]
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" '
        'font-size="11">',
        f'<text x="10" y="18" font-size="13" font-weight="bold">{html.escape(title)}</text>',
    ]

    def panel(x0, heading, values_by_series, unit):
        out.append(f'<text x="{x0}" y="{top - 10}" font-weight="bold">{html.escape(heading)}</text>')
        largest = max((v for series in values_by_series for v in series if v), default=0) or 1
        bar = (row_height - 6) / max(1, len(values_by_series))
        for row, name in enumerate(names):
            y = top + row * row_height
            for index, series in enumerate(values_by_series):
                value = series[row]
                if not value:
                    continue
                length = chart_width * value / largest
                out.append(
                    f'<rect x="{x0}" y="{y + index * bar:.1f}" width="{length:.1f}" height="{bar - 1:.1f}" '
                    f'fill="{colours[index % len(colours)]}"/>'
                )
                out.append(
                    f'<text x="{x0 + length + 3:.1f}" y="{y + (index + 1) * bar - 2:.1f}" font-size="9">'
                    f"{value:.3g}{unit}</text>"
                )

    for row, name in enumerate(names):
        out.append(f'<text x="10" y="{top + row * row_height + 14}">{html.escape(name)}</text>')
    panel(label_width, "median step time (s)", [[summaries[n].get("step_time") for n in names]], " s")
    rss_series = []
    for mode in memory_modes:
        values = []
        for name in names:
            rss = summaries[name]["rss"].get(mode, {})
            value = rss.get("peak") or rss.get("growth")
            values.append(value / MIB if value else None)
        rss_series.append(values)
    legend = ", ".join(f"{mode} ({colour})" for mode, colour in zip(memory_modes, ("blue", "orange", "green")))
    panel(label_width + chart_width + gap, f"{rss_heading}: {legend}", rss_series, "")
    out.append("</svg>")
    return "\n".join(out) + "\n"
