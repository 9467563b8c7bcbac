"""The offloading benchmark's CPU path: every arm trains the tiny GPT, the offload arms give their reference's
losses, and the table has one row per arm (the GPU figures come from running it on a GPU)."""

import pytest

from tests.unit_tests.multiprocess_harness import run_on_ranks


def _tiny_run():
    from examples.offloading import benchmark

    results = benchmark.main(["--tiny", "--steps", "2", "--warmup", "1", "--arms", ",".join(
        arm.name for arm in benchmark.ARMS)])
    return [(result.arm.name, result.arm.reference, result.peak_bytes, result.losses, len(result.step_seconds))
            for result in results], benchmark.format_table(results)


@pytest.mark.parametrize("world_size", [1])
def test_cpu_path_runs_every_arm_and_offload_keeps_the_losses(world_size):
    rows, table = run_on_ranks(world_size, _tiny_run)[0]
    losses = {name: arm_losses for name, _, _, arm_losses, _ in rows}
    assert list(losses) == ["no offload", "optimizer offload 1.0", "FSDP2", "FSDP2 parameter offload",
                            "Megatron-FSDP ZeRO-3", "Megatron-FSDP parameter offload"]
    for name, reference, peak, arm_losses, timed_steps in rows:
        assert peak is None and timed_steps == 1 and len(arm_losses) == 2  # no device memory to read on a CPU
        assert arm_losses == pytest.approx(losses[reference], rel=1e-6, abs=0), name
    assert losses["no offload"][-1] < losses["no offload"][0]  # it trains
    # Same weights and batches under both wrappers: the first loss (before any step) is the same.
    assert losses["FSDP2"][0] == pytest.approx(losses["no offload"][0], rel=1e-6)
    lines = table.splitlines()
    assert len(lines) == 2 + 6 and all(line.count("|") == 7 for line in lines)
    assert lines[3].startswith("| optimizer offload 1.0 | n/a | n/a |")


def test_default_model_without_a_gpu_stops_naming_tiny(monkeypatch, capsys):
    from examples.offloading import benchmark

    def must_not_start(*args, **kwargs):
        raise AssertionError("the 1.34B-parameter model must not be set up without a GPU")

    monkeypatch.setattr(benchmark.torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(benchmark, "_setup", must_not_start)
    monkeypatch.setattr(benchmark, "build_model", must_not_start)
    with pytest.raises(SystemExit) as stop:  # a usage error, not a traceback
        benchmark.main(["--steps", "2", "--warmup", "1"])
    assert stop.value.code == 2 and "pass --tiny" in capsys.readouterr().err


def _live_tensor_bytes():
    """Bytes of the distinct storages of every tensor the garbage collector tracks."""
    import gc

    import torch

    gc.collect()
    storages = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and not obj.is_meta:
            try:
                storage = obj.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
            except (RuntimeError, NotImplementedError):  # fake / functional tensors left by compiled code
                continue
    return sum(storages.values())


def _bytes_left_by_arms(arm_names):
    from examples.offloading import benchmark

    benchmark._setup(benchmark.torch.device("cpu"))
    cpu_model = benchmark.build_model(benchmark.TINY, bf16=False)
    arms = {arm.name: arm for arm in benchmark.ARMS}
    benchmark.run_arm(arms[arm_names[0]], cpu_model, benchmark.TINY, benchmark.torch.device("cpu"), 2, 1, False)
    left = {}
    for name in arm_names:
        before = _live_tensor_bytes()
        result = benchmark.run_arm(arms[name], cpu_model, benchmark.TINY, benchmark.torch.device("cpu"), 2, 1, False)
        left[name] = (_live_tensor_bytes() - before, result.num_params)
    return left


@pytest.mark.parametrize("world_size", [1])
def test_an_arm_leaves_no_tensor_behind(world_size):
    """An arm's buffers must be freed before the next arm starts, or the next arm's peak counts them (under the
    distributed optimizer: its fp32 parameter and gradient buffers, 8 bytes per parameter of the tiny GPT)."""
    left = run_on_ranks(world_size, _bytes_left_by_arms, ["no offload", "optimizer offload 1.0"])[0]
    for name, (leftover_bytes, num_params) in left.items():
        assert num_params > 100_000 and leftover_bytes == 0, (name, leftover_bytes / num_params)


def test_table_leaves_the_comparison_out_when_the_reference_did_not_run():
    from examples.offloading import benchmark

    arms = {arm.name: arm for arm in benchmark.ARMS}
    gib = 1 << 30
    results = [benchmark.ArmResult(arms["FSDP2 parameter offload"], 2 * gib, [0.3, 0.5], [4.0, 3.5], 1 << 28),
               benchmark.ArmResult(arms["no offload"], 4 * gib, [0.2], [4.0, 3.25], 1 << 28),
               benchmark.ArmResult(arms["optimizer offload 1.0"], 3 * gib, [0.8], [4.0, 3.25], 1 << 28)]
    rows = [row.split(" | ") for row in benchmark.format_table(results).splitlines()[2:]]
    assert [row[1:5] for row in rows] == [["2.00", "-", "0.400", "-"], ["4.00", "0.0", "0.200", "1.00"],
                                          ["3.00", "4.0", "0.800", "4.00"]]
