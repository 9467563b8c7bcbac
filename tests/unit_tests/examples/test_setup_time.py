"""The set-up time program: every arm wraps, trains the same model to the same loss, and gets a row."""

import pytest

from examples.megatron_fsdp import setup_time
from tests.unit_tests.multiprocess_harness import run_on_ranks


def _measure_tiny():
    import torch

    from examples.megatron_fsdp.bench_model import GPTBenchConfig

    config = GPTBenchConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16, vocab_size=64)
    results = setup_time.measure(config, setup_time.ARM_NAMES, steps=2, repeats=1, device=torch.device("cpu"),
                                  uncounted_rounds=0)
    construction = setup_time.measure_parameter_construction(3, torch.device("cpu"))
    return results, setup_time.render(results, config, 2, 2, 1), construction


@pytest.mark.world_size(2)
def test_every_arm_trains_the_same_model_and_renders_a_row():
    results, table, construction = run_on_ranks(2, _measure_tiny)[0]
    assert sorted(construction) == ["dtensor_parameter", "nn.Parameter"] and min(construction.values()) > 0
    assert sorted(results) == sorted(setup_time.ARM_NAMES)
    losses = {arm: runs[0][4] for arm, runs in results.items()}
    for arm, runs in results.items():
        wrap, first, later, parameters, _ = runs[0]
        assert wrap > 0 and first > 0 and later > 0, arm
        assert parameters == results["ddp"][0][3] == 29  # 2 blocks x 12 + 2 embeddings + final norm (2) + head
        assert losses[arm] == pytest.approx(losses["ddp"], rel=1e-5), losses  # the same weights after two steps
    rows = [line for line in table.splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert [row.split(" | ")[0][2:] for row in rows] == [setup_time.LABELS[arm] for arm in setup_time.ARM_NAMES]
    assert rows[0].endswith("| 1.00 |")


def test_needs_two_steps():
    with pytest.raises(SystemExit):
        setup_time.parse_args(["--steps", "1"])
