"""The resharding matrix: checkpoints written under Megatron-FSDP ZeRO-3 at DP4, TP2xDP2, PP2xDP2 and
TP2xPP2xDP2 and under HFSDP (two outer instances of ZeRO-3 over two ranks), under FSDP2 and under DDP with TP2,
each loaded at a data-parallel size of 3, at TP1, at PP1 and under another wrapper; the losses after loading
equal the uninterrupted run's.

Every saver trains 4 iterations (12 samples per step, so that DP 1 to 4 see the same global batches, in one
micro-batch per data-parallel rank; learning-rate warm-up over 2) and saves at iteration 2; loaders train 3-4 (3
tests the loaded weights, 4 the optimizer state and the learning-rate schedule too).
Across layouts and wrappers the fp32 losses agree to 1e-6 relative (only the order of floating-point reductions
differs; the measured maximum is printed). Exact resume at the saving layout is the functional tests' job
(`gpt/resume_*` cases, HSDP and HFSDP at DP4 included). One rank pool per world size: the savers of a world size
share it, and one pool of 3 ranks loads all their checkpoints.
"""

import os

import pytest
import torch

from tests.unit_tests.dist_checkpointing.pretrain_helpers import run_pretrain
from tests.unit_tests.dist_checkpointing.test_resume import FP32_REL_TOLERANCE
from tests.unit_tests.multiprocess_harness import run_on_ranks

SAMPLES_PER_STEP = 12
ITERATIONS = 4
SCHEDULE = f"--global-batch-size {SAMPLES_PER_STEP} --train-iters {ITERATIONS} --lr-decay-iters {ITERATIONS}"
SAVED_AT = 2
Z3 = "--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params"
TP2, PP2 = "--tensor-model-parallel-size 2", "--pipeline-model-parallel-size 2"
LAYOUTS = {  # the data-parallel size is what the world size leaves
    "mfsdp_z3": Z3,
    "mfsdp_z3_tp2": f"{Z3} {TP2}",
    "mfsdp_z3_pp2": f"{Z3} {PP2}",
    "mfsdp_z3_tp2_pp2": f"{Z3} {TP2} {PP2}",
    "mfsdp_z2": "--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads",
    "fsdp2": "--use-torch-fsdp2",
    "fsdp2_tp2": f"--use-torch-fsdp2 {TP2}",
    "ddp": "",
    "ddp_tp2": TP2,
    "distopt": "--use-distributed-optimizer",
    "distopt_tp2_pp2": f"--use-distributed-optimizer {TP2} {PP2}",
    "hfsdp": "--use-megatron-fsdp --num-distributed-optimizer-instances 2 --outer-dp-sharding-strategy optim",
}
# Saved at world 4 -> loaded at world 4 (each changes TP or PP and the wrapper) and at world 3 (DP3, TP1, PP1,
# another wrapper).
SAVED_AT_FOUR = {
    "mfsdp_z3": (["distopt_tp2_pp2"], "distopt"),
    "mfsdp_z3_tp2": (["fsdp2"], "ddp"),
    "mfsdp_z3_pp2": (["ddp_tp2"], "fsdp2"),
    "fsdp2_tp2": (["mfsdp_z3_pp2"], "mfsdp_z3"),
    "ddp_tp2": (["mfsdp_z3"], "mfsdp_z2"),
    "hfsdp": ([], "distopt"),
}
SAVED_AT_EIGHT = {"mfsdp_z3_tp2_pp2": ([], "distopt")}  # loaded at world 3 only


def _flags(layout):
    """The layout's flags and a schedule of one micro-batch per data-parallel rank and step (the global batch
    is the same at every data-parallel size; only the order of floating-point reductions differs)."""
    flags = LAYOUTS[layout]
    model_parallel = (2 if TP2 in flags else 1) * (2 if PP2 in flags else 1)
    data_parallel = torch.distributed.get_world_size() // model_parallel
    assert SAMPLES_PER_STEP % data_parallel == 0, (layout, data_parallel)
    return f"{SCHEDULE} --micro-batch-size {SAMPLES_PER_STEP // data_parallel} {flags}"


def _save_and_load(workdir, saver, loaders):
    from megatron.training.checkpointing import write_tracker

    root = os.path.join(workdir, saver)
    reference = run_pretrain(workdir, f"{_flags(saver)} --save {root} --save-interval {SAVED_AT} "
                                      "--ckpt-format torch_dist")
    if torch.distributed.get_rank() == 0:
        write_tracker(root, SAVED_AT)  # resume from the middle of the reference run
    torch.distributed.barrier()
    return reference, _load_each(workdir, root, loaders)


def _load_each(workdir, root, loaders, schedule=""):
    return {loader: run_pretrain(workdir, f"{_flags(loader)} {schedule} --load {root} --ckpt-format torch_dist")
            for loader in loaders}


def _save_all(workdir, savers):
    return {saver: _save_and_load(workdir, saver, loaders) for saver, (loaders, _) in savers.items()}


def _load_at_three(workdir, plan):
    """{checkpoint root name: (loader, schedule)} -> {root name: losses after loading}."""
    return {name: _load_each(workdir, os.path.join(workdir, name), [loader], schedule)[loader]
            for name, (loader, schedule) in plan.items()}


def _relative_differences(reference, resumed, first):
    assert sorted(resumed) == list(range(first, max(reference) + 1))
    return [abs(resumed[i] - reference[i]) / abs(reference[i]) for i in resumed]


def _check_matrix(saved, loaded_at_three, savers):
    """Every load's losses against its saver's; returns the largest relative difference."""
    largest = 0.0
    for saver, (loaders, at_three) in savers.items():
        reference, resumed = saved[saver]
        assert sorted(reference) == list(range(1, ITERATIONS + 1)), saver
        assert len(set(reference.values())) == ITERATIONS, saver
        if at_three is not None:
            resumed = {**resumed, f"{at_three} at DP3": loaded_at_three[saver]}
        for loader, losses in resumed.items():
            differences = _relative_differences(reference, losses, SAVED_AT + 1)
            assert max(differences) <= FP32_REL_TOLERANCE, (saver, loader, losses, reference)
            largest = max(largest, *differences)
    return largest


@pytest.mark.slow  # pools of 4 and 3 ranks, 17 training runs
@pytest.mark.world_size(4)
def test_checkpoints_of_four_ranks_load_at_other_layouts_and_wrappers(tmp_path):
    saved = run_on_ranks(4, _save_all, str(tmp_path), SAVED_AT_FOUR)[0]
    plan = {saver: (at_three, "") for saver, (_, at_three) in SAVED_AT_FOUR.items()}
    loaded = run_on_ranks(3, _load_at_three, str(tmp_path), plan)[0]
    largest = _check_matrix(saved, loaded, SAVED_AT_FOUR)
    assert largest <= FP32_REL_TOLERANCE
    print(f"largest relative loss difference after resharding: {largest:.2e}")


@pytest.mark.slow  # 8 ranks on the CPU cores, then a pool of 3
@pytest.mark.world_size(8)
def test_checkpoint_of_eight_ranks_loads_at_data_parallel_three(tmp_path):
    saved = run_on_ranks(8, _save_all, str(tmp_path), SAVED_AT_EIGHT)[0]
    plan = {saver: (at_three, "") for saver, (_, at_three) in SAVED_AT_EIGHT.items()}
    loaded = run_on_ranks(3, _load_at_three, str(tmp_path), plan)[0]
    largest = _check_matrix(saved, loaded, SAVED_AT_EIGHT)
    print(f"largest relative loss difference after resharding: {largest:.2e}")
