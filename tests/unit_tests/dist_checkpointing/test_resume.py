"""torch_dist checkpoints in training: exact resume, and resume at another layout or wrapper (resharding).

A reference run trains 8 iterations and saves at iteration 4; resumed runs load iteration 4 and train to 8.
Same layout: the losses of iterations 5-8 are identical. Another layout (TP, PP, DP, distributed optimizer
or not): equal to 1e-5 relative, the difference being only the order of floating-point reductions.
"""

import os

import pytest
import torch

from tests.unit_tests.dist_checkpointing.pretrain_helpers import run_pretrain
from tests.unit_tests.multiprocess_harness import run_on_ranks

LAYOUTS = {
    "dp2_distopt": "--use-distributed-optimizer",
    "dp2_ddp": "",
    "tp2": "--tensor-model-parallel-size 2",
    "pp2": "--pipeline-model-parallel-size 2",
    "mfsdp_z3": "--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params",
    "mfsdp_z1_tp2": "--use-megatron-fsdp --data-parallel-sharding-strategy optim --tensor-model-parallel-size 2",
    "mfsdp_z0_pp2": "--use-megatron-fsdp --data-parallel-sharding-strategy no_shard --pipeline-model-parallel-size 2",
    "fsdp2": "--use-torch-fsdp2",
    "fsdp2_tp2": "--use-torch-fsdp2 --tensor-model-parallel-size 2",
}


def _save_then_resume_everywhere(workdir, save_layout, resume_layouts):
    from megatron.training.checkpointing import write_tracker

    root = os.path.join(workdir, "ckpt")
    reference = run_pretrain(workdir, f"{LAYOUTS[save_layout]} --save {root} --save-interval 4 "
                                      "--ckpt-format torch_dist")
    if torch.distributed.get_rank() == 0:
        write_tracker(root, 4)  # resume from the middle of the reference run
    torch.distributed.barrier()
    resumed = {name: run_pretrain(workdir, f"{LAYOUTS[name]} --load {root} --ckpt-format torch_dist")
               for name in resume_layouts}
    return reference, resumed


def _check(reference, resumed, same_layout, other_layouts):
    assert sorted(reference) == list(range(1, 9))
    assert len(set(reference.values())) == 8  # every iteration updates the model
    assert resumed[same_layout] == {i: reference[i] for i in range(5, 9)}  # same layout: identical
    for name in other_layouts:
        assert sorted(resumed[name]) == [5, 6, 7, 8], name
        for iteration in range(5, 9):
            assert resumed[name][iteration] == pytest.approx(reference[iteration], rel=1e-5, abs=0), (name, iteration)


@pytest.mark.parametrize(
    "save_layout, resume_layouts",
    [
        ("dp2_distopt", ["tp2", "pp2", "dp2_ddp", "mfsdp_z3"]),
        ("mfsdp_z3", ["fsdp2", "mfsdp_z1_tp2", "mfsdp_z0_pp2"]),
        ("fsdp2", ["fsdp2_tp2", "dp2_distopt", "mfsdp_z3"]),
    ],
)
def test_resume_is_exact_and_reshards(tmp_path, save_layout, resume_layouts):
    reference, resumed = run_on_ranks(2, _save_then_resume_everywhere, str(tmp_path), save_layout,
                                      [save_layout] + resume_layouts)[0]
    _check(reference, resumed, save_layout, resume_layouts)
