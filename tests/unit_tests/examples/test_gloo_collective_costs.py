"""The gloo collective-cost program runs end to end and checks every implementation's result against torch's.
`measure` starts its ranks from the rank pools' fork server (conftest.py) instead of spawning interpreters."""

from examples.megatron_fsdp import gloo_collective_costs


def test_measures_every_implementation_and_renders_a_row_each(processes_from_the_fork_server):
    table = gloo_collective_costs.measure(nproc=2, shard_numel=1000, calls=2, repeats=1)
    assert sorted(kind for kind, _ in table) == ["all-gather", "all-gather", "all-reduce", "reduce-scatter",
                                                 "reduce-scatter"]
    assert all(wall > 0 and cpu >= 0 for wall, cpu in table.values())
    text = gloo_collective_costs.render(table, 2, 1000, 2, 1)
    assert text.count("| megatron_fsdp (point-to-point) |") == 2
    assert text.count("| torch (gloo ") == 3
