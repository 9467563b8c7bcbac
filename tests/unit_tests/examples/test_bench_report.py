"""Markdown and SVG formatting of the Megatron-FSDP benchmark, and the model's parameter-count formula."""

import dataclasses

from examples.megatron_fsdp import bench_report
from examples.megatron_fsdp.bench_model import MODEL_PRESETS, BenchGPT, count_parameters
from examples.megatron_fsdp.bench_theory import MIB


def test_markdown_table_escapes_pipes():
    table = bench_report.markdown_table(["arm", "step s"], [["ddp", 0.25], ["a|b", ""]])
    assert table == "| arm | step s |\n|---|---|\n| ddp | 0.25 |\n| a\\|b |  |"


def test_number_formats():
    assert bench_report.format_mib(3 * MIB / 2) == "1.5"
    assert bench_report.format_mib(None) == ""
    assert bench_report.format_seconds(0.12345) == "0.123"
    assert bench_report.format_seconds(12.345) == "12.35"
    assert bench_report.format_ratio(1.234) == "1.23"
    assert bench_report.format_spread([0.2, 0.25, 0.22]) == "25%"
    assert bench_report.format_spread([0.2]) == ""
    assert bench_report.format_loss_diff(0.0) == "0"
    assert bench_report.format_loss_diff(1.5e-6) == "1.5e-06"


def test_comm_table_has_a_point_to_point_column_with_calls():
    arm = {
        "comm_payloads": {"point_to_point": 3 * MIB, "all_reduce": MIB / 2},
        "comm_calls": {"point_to_point": 12, "all_reduce": 1},
        "volume": 7 * MIB,  # 3 MiB sent on 2 ranks count 6 MiB, the all-reduce 2 x 0.5 MiB
        "theory_volume": 7 * MIB,
        "wire_bytes": 3.5 * MIB,
        "package_sent": 3 * MIB,
        "comm_steady": True,
    }
    headers = bench_report.comm_headers()
    (row,) = bench_report.comm_rows({"mfsdp3": arm})
    cells = dict(zip(headers, row))
    assert len(row) == len(headers)
    assert cells["point-to-point sent MiB"] == "3.00 (12)"
    assert cells["all_reduce MiB"] == "0.50 (1)"
    assert cells["all_gather MiB"] == ""
    assert (cells["volume MiB"], cells["ratio"], cells["wire MiB/rank"]) == ("7.00", "1.00", "3.50")
    (not_run,) = bench_report.comm_rows({"mfsdp3": {"theory_volume": 7 * MIB}})
    assert len(not_run) == len(headers) and not_run[len(headers) - 5] == "7.00"


def test_svg_has_one_bar_per_measured_value():
    summaries = {
        "ddp": {"step_time": 0.2, "rss": {"default": {"peak": 400 * MIB}, "neutral": {"peak": 300 * MIB}}},
        "mfsdp3": {"step_time": None, "rss": {}},
    }
    svg = bench_report.render_svg(summaries, ["default", "neutral"], "tiny & co")
    assert svg.startswith("<svg") and svg.rstrip().endswith("</svg>")
    assert svg.count("<rect") == 3  # one step-time bar, two RSS bars; the failed arm draws none
    assert "tiny &amp; co" in svg


def test_parameter_count_formula_matches_the_module():
    tiny = MODEL_PRESETS["tiny"]
    # 4 blocks x 789_760 + 294_912 embeddings + 512 final norm + 262_144 head
    assert count_parameters(tiny) == sum(p.numel() for p in BenchGPT(tiny).parameters()) == 3_716_608
    odd = dataclasses.replace(tiny, num_layers=1, hidden_size=24, num_attention_heads=3, seq_length=5, vocab_size=7)
    assert count_parameters(odd) == sum(p.numel() for p in BenchGPT(odd).parameters())
    # small by formula only (building it costs ~400 MiB): 97.8 M as in the peer baseline
    assert round(count_parameters(MODEL_PRESETS["small"]) / 1e6, 1) == 97.8
