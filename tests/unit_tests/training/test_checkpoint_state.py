"""The layout a checkpoint records (checkpoint_state.py `layout_of`) and the load report's first line: a MoE
model's checkpoint also names the expert-parallel size it was written with, since a load may reshard its experts
to another one; a dense model's layout has no such entry."""

from tests.unit_tests.dist_checkpointing.pretrain_helpers import TrainingState
from tests.unit_tests.multiprocess_harness import run_on_ranks

MOE = "--num-experts 4 --moe-router-topk 2 --moe-token-dispatcher-type alltoall"


def _save_then_load(root, saved_ep, loaded_ep, moe):
    from megatron.training import checkpointing, dist_checkpoint

    experts = f"{MOE} --expert-model-parallel-size {saved_ep}" if moe else ""
    state = TrainingState(f"--ckpt-format torch_dist --save {root} {experts}")
    checkpointing.save_checkpoint(1, state.model, state.optimizer, state.scheduler, state.args)
    state.close()
    experts = f"{MOE} --expert-model-parallel-size {loaded_ep}" if moe else ""
    state = TrainingState(f"--ckpt-format torch_dist --load {root} {experts}")
    _, report = dist_checkpoint.load_dist_checkpoint(state.model, state.optimizer, state.scheduler, state.args, 1)
    state.close()
    return report.lines()[0]


def test_a_moe_checkpoint_names_its_expert_parallel_size(tmp_path):
    for line in run_on_ranks(2, _save_then_load, str(tmp_path / "moe"), 2, 1, True):
        assert line == (f"loaded checkpoint {tmp_path / 'moe'}/iter_0000001 (written with "
                        "tensor_model_parallel_size=1, pipeline_model_parallel_size=1, data_parallel_size=2, "
                        "expert_model_parallel_size=2, world_size=2, wrapper=ddp, ckpt_format=torch_dist)")
    for line in run_on_ranks(2, _save_then_load, str(tmp_path / "dense"), 1, 1, False):
        assert "expert_model_parallel_size" not in line and "data_parallel_size=2, world_size=2" in line


def _save_then_load_layout(root, context_parallel_size):
    from megatron.training import checkpointing, dist_checkpoint

    flags = f"--ckpt-format torch_dist --context-parallel-size {context_parallel_size}"
    state = TrainingState(f"{flags} --save {root}")
    checkpointing.save_checkpoint(1, state.model, state.optimizer, state.scheduler, state.args)
    state.close()
    state = TrainingState(f"{flags} --load {root}")
    _, report = dist_checkpoint.load_dist_checkpoint(state.model, state.optimizer, state.scheduler, state.args, 1)
    state.close()
    return report.lines()[0], report.not_loaded


def test_a_context_parallel_checkpoint_names_its_cp_size_apart_from_dp(tmp_path):
    for line, not_loaded in run_on_ranks(2, _save_then_load_layout, str(tmp_path / "cp2"), 2):
        assert "data_parallel_size=1, context_parallel_size=2, world_size=2" in line, line
        assert not any("RNG" in item for item in not_loaded), not_loaded


def test_data_times_context_parallel_reads_layouts_of_either_form():
    from megatron.training.checkpoint_state import data_times_context_parallel

    assert data_times_context_parallel({"data_parallel_size": 1, "context_parallel_size": 2}) == 2
    # written before the CP size was recorded: DP x CP under the DP size
    assert data_times_context_parallel({"data_parallel_size": 2}) == 2
    assert data_times_context_parallel({}) is None
