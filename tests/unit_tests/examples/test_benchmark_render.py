"""`benchmark.py --render-raw-json`: a report re-rendered from saved results keeps the provisional mark of the
run that measured them."""

import json

import pytest

from examples.megatron_fsdp import benchmark


def _render(tmp_path, monkeypatch, meta, extra_flags=()):
    """Run render_main on a raw file holding `meta`; return the `provisional` setting write_report received."""
    raw_path = tmp_path / "raw.json"
    raw_path.write_text(json.dumps({"meta": meta, "results": {}}))
    received = {}
    monkeypatch.setattr(benchmark, "write_report", lambda args, meta, results: received.update(
        provisional=args.provisional, in_process=meta["in_process"]))
    benchmark.render_main(benchmark.parse_args(["--render-raw-json", str(raw_path), *extra_flags]))
    return received


@pytest.mark.parametrize("meta, expected", [
    ({"provisional": True, "command": "python examples/megatron_fsdp/benchmark.py --model tiny"}, True),
    ({"provisional": False, "command": "python examples/megatron_fsdp/benchmark.py --model tiny"}, False),
    # Raw files written before the mark was recorded: the measuring command line says it.
    ({"command": "python examples/megatron_fsdp/benchmark.py --model tiny --provisional"}, True),
    ({"command": "python examples/megatron_fsdp/benchmark.py --model tiny"}, False),
])
def test_rerendered_report_keeps_the_provisional_mark(tmp_path, monkeypatch, meta, expected):
    received = _render(tmp_path, monkeypatch, dict(meta, launch="fresh processes per measurement"))
    assert received == {"provisional": expected, "in_process": False}


def test_provisional_flag_at_render_time_marks_the_report(tmp_path, monkeypatch):
    meta = {"provisional": False, "command": "python benchmark.py", "launch": "torchrun --nproc-per-node 2"}
    assert _render(tmp_path, monkeypatch, meta, ["--provisional"]) == {"provisional": True, "in_process": True}
