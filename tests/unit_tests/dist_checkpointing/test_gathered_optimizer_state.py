"""DistributedOptimizer.load_gathered_state_dict (the load of `gathered_state_dict()`, at any data-parallel size)
restores hyperparameters as the checkpoint loads do: the saved ones, except the settings this run's flags give
(Muon's `settings_from_flags`) and the parameter lists."""

import pytest

from tests.unit_tests.multiprocess_harness import run_on_ranks


def _load_gathered_state_saved_under_other_flags():
    """Muon at DP2: the gathered state, its groups edited as a run with --muon-momentum 0.5 and another learning
    rate would have saved them, loaded back. Returns (the groups' momentum and lr after the load, the saved lr)."""
    from tests.unit_tests.dist_checkpointing.pretrain_helpers import TrainingState

    state = TrainingState("--use-distributed-optimizer --optimizer muon --muon-momentum 0.95")
    try:
        state.train_steps(1)
        gathered = state.optimizer.gathered_state_dict()
        for group in gathered["param_groups"]:
            group.update(momentum=0.5, lr=1.25e-3, params=[])  # `params`: indices of the saving process's own
        state.optimizer.load_gathered_state_dict(gathered)
        groups = state.optimizer.optimizer.param_groups
        return ([group.get("momentum") for group in groups if group.get("use_muon")],
                [group["lr"] for group in groups], all(group["params"] for group in groups))
    finally:
        state.close()


@pytest.mark.world_size(2)
def test_load_gathered_state_keeps_the_settings_of_this_runs_flags():
    momentum, lr, params_kept = run_on_ranks(2, _load_gathered_state_saved_under_other_flags)[0]
    assert momentum and set(momentum) == {0.95}  # --muon-momentum of this run
    assert set(lr) == {1.25e-3}  # the checkpoint's, as the scheduler's load then sets it anew
    assert params_kept
