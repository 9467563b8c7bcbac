"""torch_dist checkpoints in training: exact resume, and resume at another layout or wrapper (resharding).

Exact resume per wrapper (4 iterations straight, saving at 2, against loading 2 and training to 4) is checked by
the functional `gpt/resume_*` cases. Here: a reference run trains 6 iterations and saves at iteration 4; resumed
runs load iteration 4 and train to 6 (iteration 5 tests the loaded weights, 6 the loaded optimizer state as
well). Same layout: the losses of iterations 5-6 are identical. Another layout or wrapper
(TP, PP, even or uneven pipeline splits, one with a model chunk holding no parameter, DP size, DDP, distributed
optimizer, Megatron-FSDP ZeRO-0..3 / HSDP / HFSDP, FSDP2): equal to 1e-6 relative in fp32, the difference being
only the order of floating-point reductions (measured: at most 5e-8); 1e-4 in bf16 (measured: 2.6e-6).
"""

import contextlib
import io
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
    # Uneven splits: layers 1 | 2-4, and the embedding alone on stage 0 (layers 1-4 on stage 1).
    "pp2_first1": "--pipeline-model-parallel-size 2 --decoder-first-pipeline-num-layers 1",
    "pp2_embedding_alone": "--use-distributed-optimizer --pipeline-model-parallel-size 2 "
                           "--pipeline-model-parallel-layout E|t*4L",
    "mfsdp_z3": "--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params",
    "mfsdp_z1_tp2": "--use-megatron-fsdp --data-parallel-sharding-strategy optim --tensor-model-parallel-size 2",
    "mfsdp_z0_pp2": "--use-megatron-fsdp --data-parallel-sharding-strategy no_shard --pipeline-model-parallel-size 2",
    # PP2 x VPP2 with an empty middle chunk (virtual stage 1, chunk 0 of pipeline rank 1: it holds no parameter).
    "mfsdp_z3_vpp_empty_chunk": "--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params "
                                "--pipeline-model-parallel-size 2 --pipeline-model-parallel-layout Ett||t|tL",
    "fsdp2": "--use-torch-fsdp2",
    "fsdp2_tp2": "--use-torch-fsdp2 --tensor-model-parallel-size 2",
    "tied_pp2": "TIED --use-distributed-optimizer --pipeline-model-parallel-size 2",
    "tied_dp2": "TIED --use-distributed-optimizer",
    "tied_mfsdp_pp2": "TIED --use-megatron-fsdp --pipeline-model-parallel-size 2",
    "distopt_bf16": "--use-distributed-optimizer --bf16",
    "mfsdp_z3_bf16": "--use-megatron-fsdp --bf16",
    "fsdp2_bf16": "--use-torch-fsdp2 --bf16",
}


SIX_ITERATIONS = "--train-iters 6 --lr-decay-iters 6"
BF16_REL_TOLERANCE = 1e-4
FP32_REL_TOLERANCE = 1e-6


def _save_then_resume_everywhere(workdir, save_layout, resume_layouts, save_args=""):
    from megatron.training.checkpointing import read_tracker, write_tracker

    root = os.path.join(workdir, "ckpt")
    reference = run_pretrain(workdir, f"{LAYOUTS[save_layout]} {SIX_ITERATIONS} --save {root} --save-interval 4 "
                                      f"--ckpt-format torch_dist {save_args}")
    if torch.distributed.get_rank() == 0:
        write_tracker(root, 4)  # resume from the middle of the reference run
    torch.distributed.barrier()
    resumed = {name: run_pretrain(workdir, f"{LAYOUTS[name]} {SIX_ITERATIONS} --load {root} --ckpt-format torch_dist")
               for name in resume_layouts if name != save_layout}
    # The resume at the saving layout also stops by --exit-interval (its check comes after each iteration, before
    # the loop's end) and saves there with --async-save: the exit checkpoint is published before pretrain() returns.
    exit_root = os.path.join(workdir, "exit")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        resumed[save_layout] = run_pretrain(workdir, f"{LAYOUTS[save_layout]} {SIX_ITERATIONS} --load {root} "
                                                     f"--ckpt-format torch_dist --save {exit_root} --exit-interval 6 "
                                                     "--async-save")
    stopped = "exiting at iteration 6: reached --exit-interval 6" in printed.getvalue()
    return reference, resumed, (stopped, read_tracker(exit_root), sorted(os.listdir(exit_root)))


def _check(reference, resumed, same_layout, other_layouts, rel=FP32_REL_TOLERANCE):
    assert sorted(reference) == list(range(1, 7))
    assert len(set(reference.values())) == 6  # every iteration updates the model
    assert resumed[same_layout] == {i: reference[i] for i in range(5, 7)}  # same layout: identical
    for name in other_layouts:
        assert sorted(resumed[name]) == [5, 6], name
        for iteration in range(5, 7):
            assert resumed[name][iteration] == pytest.approx(reference[iteration], rel=rel, abs=0), (name, iteration)


@pytest.mark.world_size(2)
@pytest.mark.parametrize(
    "save_layout, resume_layouts, save_args",
    [
        # The reference saves asynchronously: iteration 4 is written while iterations 5-6 train.
        ("dp2_distopt", ["tp2", "pp2", "dp2_ddp", "mfsdp_z3", "pp2_first1"],
         "--async-save --use-persistent-ckpt-worker"),
        ("mfsdp_z3", ["fsdp2", "mfsdp_z1_tp2", "mfsdp_z0_pp2"], "--async-save"),
        ("fsdp2", ["fsdp2_tp2", "dp2_distopt", "mfsdp_z3"], ""),
        # Tied embeddings: the last stage's output-layer copy is the logical word embedding, loaded, not saved.
        ("tied_pp2", ["tied_dp2", "tied_mfsdp_pp2"], ""),
        # Saved under an uneven pipeline split (global layer numbers): loads under the even one and another.
        ("pp2_first1", ["pp2", "pp2_embedding_alone"], ""),
        # Megatron-FSDP with a model chunk without parameters: loads at PP1 and at the even PP2 split.
        ("mfsdp_z3_vpp_empty_chunk", ["mfsdp_z3", "mfsdp_z0_pp2"], ""),
        # bf16 weights with fp32 main weights (saved as `fp32_param`): the resumed main weights are exact.
        ("distopt_bf16", ["mfsdp_z3_bf16", "fsdp2_bf16"], ""),
    ],
)
def test_resume_is_exact_and_reshards(tmp_path, save_layout, resume_layouts, save_args):
    reference, resumed, exited = run_on_ranks(2, _save_then_resume_everywhere, str(tmp_path), save_layout,
                                              [save_layout] + resume_layouts, save_args)[0]
    # bf16 across wrappers: other reduction orders round bf16 activations and gradients differently.
    tolerance = BF16_REL_TOLERANCE if "bf16" in save_layout else FP32_REL_TOLERANCE
    _check(reference, resumed, save_layout, resume_layouts, rel=tolerance)
    assert exited == (True, 6, ["iter_0000006", "latest_checkpointed_iteration.txt"])


DROPOUT = "--hidden-dropout 0.1 --attention-dropout 0.1 --eval-interval 2 --eval-iters 1"


def _save_then_resume_with_dropout(workdir):
    from megatron.training.checkpointing import write_tracker

    root = os.path.join(workdir, "ckpt")
    reference = run_pretrain(workdir, f"{LAYOUTS['mfsdp_z3']} {DROPOUT} {SIX_ITERATIONS} --save {root} "
                                      "--save-interval 4 --ckpt-format torch_dist")
    if torch.distributed.get_rank() == 0:
        write_tracker(root, 4)
    torch.distributed.barrier()
    resumed = run_pretrain(workdir, f"{LAYOUTS['mfsdp_z3']} {DROPOUT} {SIX_ITERATIONS} --load {root} "
                                    "--ckpt-format torch_dist")
    without_dropout = run_pretrain(workdir, f"{LAYOUTS['mfsdp_z3']} --train-iters 2")
    return reference, resumed, without_dropout


@pytest.mark.world_size(2)
def test_resume_with_dropout_and_evaluations_draws_the_uninterrupted_masks(tmp_path):
    # The checkpoint restores the dropout stream; nothing between the load and iteration 5 (building the data
    # iterators, restarting the validation iterator) may draw from it.
    reference, resumed, without_dropout = run_on_ranks(2, _save_then_resume_with_dropout, str(tmp_path))[0]
    assert sorted(reference) == list(range(1, 7))
    assert resumed == {i: reference[i] for i in range(5, 7)}
    assert all(reference[i] != without_dropout[i] for i in (1, 2))  # the masks are in the losses


SGD_FOUR_ITERATIONS = "--optimizer sgd --sgd-momentum 0.9 --train-iters 4 --lr-decay-iters 4 --ckpt-format torch_dist"
SGD_LAYOUTS = ("dp2_ddp", "dp2_distopt", "mfsdp_z3")


def _sgd_save_then_resume(workdir):
    from megatron.training.checkpointing import write_tracker

    runs = {}
    for name in SGD_LAYOUTS:
        root = os.path.join(workdir, name)
        reference = run_pretrain(workdir, f"{LAYOUTS[name]} {SGD_FOUR_ITERATIONS} --save {root} --save-interval 2")
        if torch.distributed.get_rank() == 0:
            write_tracker(root, 2)
        torch.distributed.barrier()
        runs[name] = reference, run_pretrain(workdir, f"{LAYOUTS[name]} {SGD_FOUR_ITERATIONS} --load {root}")
    return runs


@pytest.mark.world_size(2)
def test_resume_with_sgd_momentum_loads_the_momentum_buffers(tmp_path):
    # SGD creates its momentum buffers on the first step: a resumed run must still load the saved ones (iteration
    # 4 is the first whose loss depends on them).
    for name, (reference, resumed) in run_on_ranks(2, _sgd_save_then_resume, str(tmp_path))[0].items():
        assert sorted(reference) == [1, 2, 3, 4], name
        assert resumed == {3: reference[3], 4: reference[4]}, name
