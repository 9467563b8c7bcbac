"""pretrain() with an interleaved pipeline (PP2 x VPP2: two ranks, two model chunks each, one layer per chunk)
equals the same model without pipelining under every data-parallel wrapper, and its checkpoints load at other
layouts (global layer numbers; one of them an uneven `--pipeline-model-parallel-layout`) and resume to the
uninterrupted run.

fp32 on the CPU: the runs differ only in the order of floating-point reductions, so losses agree to 1e-5
relative (measured: about 1e-7).
"""

import os

import pytest
import torch

from tests.unit_tests.dist_checkpointing.pretrain_helpers import run_pretrain
from tests.unit_tests.multiprocess_harness import run_on_ranks

ITERATIONS = "--train-iters 4 --lr-decay-iters 4"
VPP = "--pipeline-model-parallel-size 2 --num-virtual-stages-per-pipeline-rank 2"
PP2 = "--pipeline-model-parallel-size 2"
WRAPPERS = {
    "ddp": "",
    "distributed_optimizer": "--use-distributed-optimizer",
    "distributed_optimizer_overlap": "--use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather",
    "fsdp2": "--use-torch-fsdp2",
    "tied_distributed_optimizer": "TIED --use-distributed-optimizer",
    "megatron_fsdp_z3": "--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params",
    "megatron_fsdp_z1": "--use-megatron-fsdp --data-parallel-sharding-strategy optim",
}
REL_TOLERANCE = 1e-5


def _losses_against_reference(workdir, names):
    results = {}
    for name in names:
        tied = "TIED " if WRAPPERS[name].startswith("TIED") else ""
        results[("reference", tied)] = results.get(("reference", tied)) or run_pretrain(
            workdir, f"{tied}{ITERATIONS}")
        results[name] = run_pretrain(workdir, f"{WRAPPERS[name]} {VPP} {ITERATIONS}")
    return {name: (results[name], results[("reference", "TIED " if WRAPPERS[name].startswith("TIED") else "")])
            for name in names}


@pytest.mark.world_size(2)
def test_pp2_vpp2_equals_no_pipeline_under_each_wrapper(tmp_path):
    compared = run_on_ranks(2, _losses_against_reference, str(tmp_path), list(WRAPPERS))[0]
    for name, (losses, reference) in compared.items():
        assert sorted(losses) == [1, 2, 3, 4], name
        assert len(set(losses.values())) == 4, name  # every iteration updates the model
        for iteration, loss in losses.items():
            assert loss == pytest.approx(reference[iteration], rel=REL_TOLERANCE, abs=0), (name, iteration)


def _save_and_resume(workdir, resume_layouts, wrapper="--use-distributed-optimizer", saving_layout=VPP):
    from megatron.training.checkpointing import write_tracker

    root = os.path.join(workdir, "ckpt")
    uninterrupted = run_pretrain(workdir, f"{saving_layout} {ITERATIONS} --save {root} --save-interval 2 "
                                          f"--ckpt-format torch_dist {wrapper}")
    if torch.distributed.get_rank() == 0:
        write_tracker(root, 2)  # resume from the middle: iteration 3 tests the loaded model, 4 the optimizer state
    torch.distributed.barrier()
    resumed = {layout: run_pretrain(workdir, f"{layout} {ITERATIONS} --load {root} --ckpt-format torch_dist "
                                             f"{wrapper}")
               for layout in resume_layouts}
    return uninterrupted, resumed


UNEVEN_VPP = "--pipeline-model-parallel-size 2 --pipeline-model-parallel-layout Et|tt|t|L"  # 1, 2, 1, 0 layers


@pytest.mark.world_size(2)
def test_checkpoint_saved_at_pp2_vpp2_resumes_at_pp1_pp2_and_vpp(tmp_path):
    # PP1 (two data-parallel ranks), PP2 without VPP, an uneven layout of PP2 x VPP2, the saving layout
    layouts = ["", PP2, UNEVEN_VPP, VPP]
    uninterrupted, resumed = run_on_ranks(2, _save_and_resume, str(tmp_path), layouts)[0]
    assert sorted(uninterrupted) == list(range(1, 5))
    assert resumed[VPP] == {i: uninterrupted[i] for i in range(3, 5)}  # same layout: identical
    for layout in ("", PP2, UNEVEN_VPP):
        assert sorted(resumed[layout]) == [3, 4], layout
        for iteration in range(3, 5):
            assert resumed[layout][iteration] == pytest.approx(uninterrupted[iteration], rel=REL_TOLERANCE, abs=0)


MEGATRON_FSDP_Z3 = WRAPPERS["megatron_fsdp_z3"]


def _megatron_fsdp_both_ways(workdir):
    """A PP2 x VPP2 checkpoint resumed at PP1 (and at its own layout), and a PP1 checkpoint resumed at PP2 x VPP2,
    all under Megatron-FSDP ZeRO-3 (model and optimizer state resharded from two chunks per rank to one stage on
    two data-parallel ranks and back)."""
    from_vpp = _save_and_resume(os.path.join(workdir, "from_vpp"), ["", VPP], MEGATRON_FSDP_Z3, VPP)
    from_pp1 = _save_and_resume(os.path.join(workdir, "from_pp1"), [VPP], MEGATRON_FSDP_Z3, "")
    return from_vpp, from_pp1


@pytest.mark.world_size(2)
def test_megatron_fsdp_checkpoint_saved_at_pp2_vpp2_resumes_at_pp1_and_back(tmp_path):
    from_vpp, from_pp1 = run_on_ranks(2, _megatron_fsdp_both_ways, str(tmp_path))[0]
    uninterrupted, resumed = from_vpp
    assert sorted(uninterrupted) == list(range(1, 5))
    assert len(set(uninterrupted.values())) == 4  # every iteration updates the model
    assert resumed[VPP] == {i: uninterrupted[i] for i in range(3, 5)}  # same layout: identical
    assert sorted(resumed[""]) == [3, 4]
    for iteration in range(3, 5):
        assert resumed[""][iteration] == pytest.approx(uninterrupted[iteration], rel=REL_TOLERANCE, abs=0)
    uninterrupted, resumed = from_pp1
    assert sorted(resumed[VPP]) == [3, 4]
    for iteration in range(3, 5):
        assert resumed[VPP][iteration] == pytest.approx(uninterrupted[iteration], rel=REL_TOLERANCE, abs=0)
