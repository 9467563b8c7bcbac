"""Start-up of the benchmark programs that train only under torchrun: their usage lines parse, a wrong arm name
stops before any training, and a launch without torchrun says how to launch."""

import shlex
import sys

import pytest

from examples.checkpointing import benchmark_checkpoint
from examples.megatron_fsdp import pipeline_gather_cost


def _usage_flags(docstring, program):
    """The flags of the usage line of `program` in a module docstring, bracketed options unbracketed."""
    text = docstring.split(program, 1)[1].split("\n\n", 1)[0]
    return shlex.split(text.replace("[", " ").replace("]", " "))


def test_checkpoint_benchmark_usage_line_parses():
    argv = _usage_flags(benchmark_checkpoint.__doc__, "benchmark_checkpoint.py")
    options = benchmark_checkpoint.parse_args(argv)
    assert (options.model, options.repeats, options.steps, options.out) == ("small", 3, 3, "results.json")
    assert options.arms == ["Megatron-FSDP z3", "distributed optimizer"]


def test_checkpoint_benchmark_arms():
    assert benchmark_checkpoint.parse_args([]).arms == list(benchmark_checkpoint.ARMS)
    assert benchmark_checkpoint.parse_args(["--arms", " FSDP2 (logical format) ,torch FSDP2 native DCP"]).arms == [
        "FSDP2 (logical format)", "torch FSDP2 native DCP"]
    with pytest.raises(SystemExit):
        benchmark_checkpoint.parse_args(["--arms", "Megatron-FSDP z3,FSDP2"])


def test_pipeline_gather_cost_without_torchrun_says_how_to_launch(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setattr(sys, "argv", ["pipeline_gather_cost.py", "--steps", "1"])
    with pytest.raises(SystemExit, match="torchrun --nproc-per-node 4"):
        pipeline_gather_cost.main()


def test_pipeline_gather_cost_help_shows_the_launch(capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["pipeline_gather_cost.py", "--help"])
    with pytest.raises(SystemExit):
        pipeline_gather_cost.main()
    assert "torchrun --nproc-per-node 4 -m examples.megatron_fsdp.pipeline_gather_cost" in capsys.readouterr().out


def test_vpp_table_row_is_the_slower_ranks():
    from examples.pipeline_parallel import benchmark_vpp

    # rank 0 is the slower one (2.0 s a step, 10% bubble); rank 1 is faster with a larger bubble (40%)
    per_rank = {0: {1: (2.0, 1.8), 2: (1.0, 0.75)}, 1: {1: (1.5, 0.9), 2: (0.8, 0.7)}}
    rows = [row.split(" | ") for row in benchmark_vpp._table(per_rank, 4).splitlines()[2:]]
    assert [row[1:4] for row in rows] == [["2.000", "1.800", "10.0%"], ["1.000", "0.750", "25.0%"]]
    assert [row[-1] for row in rows] == ["1.00x |", "0.50x |"]


def test_vpp_write_replaces_its_section_only(tmp_path):
    """--write replaces the VPP section up to the next heading of its level or above, "# " parts included."""
    from examples.pipeline_parallel import benchmark_vpp

    doc = tmp_path / "benchmarks.md"
    doc.write_text("# Part A\n\n## Interleaved pipeline (VPP)\n\nold table\n\nold reading\n\n# Part B\n\nkept\n\n"
                   "## Section C\n\nkept too\n")
    benchmark_vpp._write_section(str(doc), "| new table |")
    text = doc.read_text()
    assert "old table" not in text and "| new table |" in text
    assert text.endswith("\n# Part B\n\nkept\n\n## Section C\n\nkept too\n") and text.startswith("# Part A\n\n## ")
