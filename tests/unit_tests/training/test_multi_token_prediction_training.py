"""pretrain() with multi-token prediction (`--mtp-num-layers 2`): the `mtp_1 loss` / `mtp_2 loss` log fields, an
`lm loss` that MTP leaves unchanged at iteration 1 (and changes afterwards: the MTP loss trains the model), the
same losses under data parallelism (Megatron DDP, Megatron-FSDP ZeRO-3, FSDP2), tensor + sequence parallelism,
context parallelism and pipeline parallelism (untied weights with a `m` layout, whose last stage keeps a
synchronised copy of the word embedding; tied weights) as on a single rank, and an exact resume from a torch_dist
checkpoint, which also loads at another layout.

fp32 on the CPU: the runs differ only in the order of floating-point reductions, so losses agree to 1e-5 relative.
The single-rank runs are shared by both tests (computed once per session).
"""

import os

import pytest
import torch

from tests.unit_tests.dist_checkpointing.pretrain_helpers import pretrain_records, tiny_gpt_argv
from tests.unit_tests.multiprocess_harness import run_on_ranks

MTP = "--position-embedding-type rope --mtp-num-layers 2"
ITERATIONS = "--train-iters 4 --lr-decay-iters 4"
METRICS = ("lm loss", "mtp_1 loss", "mtp_2 loss")
REL_TOLERANCE = 1e-5
Z3 = "--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params"
# name: (flags on two ranks, the single-rank reference they must reproduce)
PARALLEL_RUNS = {
    "ddp_dp2": ("", "untied"),
    "megatron_fsdp_z3_dp2": (Z3, "untied"),
    "fsdp2_dp2": ("--use-torch-fsdp2", "untied"),
    "tp2_sequence_parallel": ("--tensor-model-parallel-size 2 --sequence-parallel --use-distributed-optimizer",
                              "untied"),
    "pp2_layout_untied": ("--pipeline-model-parallel-size 2 --pipeline-model-parallel-layout Ett|ttmmL", "untied"),
    "pp2_tied_distributed_optimizer": ("TIED --pipeline-model-parallel-size 2 --use-distributed-optimizer",
                                       "tied"),
    # The depths' shifts cross the two ranks' load-balanced chunks (16 tokens: chunks of 4).
    "cp2": ("--context-parallel-size 2", "untied"),
}
SINGLE_RANK_RUNS = {"untied": MTP, "tied": f"TIED {MTP}", "untied_without_mtp": "--position-embedding-type rope"}
_single_rank_losses = {}  # shared by the two tests of this session


def _train(workdir, extra_args):
    """pretrain() with TINY_GPT + `extra_args`; {iteration: {metric: value}} of the training records."""
    return {record["iteration"]: {name: record.get(name) for name in METRICS}
            for record in pretrain_records(workdir, tiny_gpt_argv(extra_args))}


def _single_rank_runs(workdir):
    return {name: _train(workdir, f"{flags} {ITERATIONS}") for name, flags in SINGLE_RANK_RUNS.items()}


def _single_rank_references(workdir):
    if not _single_rank_losses:
        _single_rank_losses.update(run_on_ranks(1, _single_rank_runs, workdir)[0])
    return _single_rank_losses


def _assert_close(losses, reference, name):
    assert sorted(losses) == [1, 2, 3, 4], name
    for iteration, values in losses.items():
        for metric in METRICS:
            assert values[metric] == pytest.approx(reference[iteration][metric], rel=REL_TOLERANCE, abs=0), (
                name, iteration, metric)


@pytest.mark.world_size(1)
def test_single_rank_logs_mtp_losses_and_keeps_lm_loss(tmp_path):
    runs = _single_rank_references(str(tmp_path))
    for name in ("untied", "tied"):
        for iteration, values in runs[name].items():
            # Each depth's loss is logged beside the LM loss; at initialisation all are near ln(vocab) = 4.8.
            assert all(4.0 < values[metric] < 5.5 for metric in METRICS), (name, iteration, values)
        assert len({values["mtp_1 loss"] for values in runs[name].values()}) == 4, name
    without_mtp = runs["untied_without_mtp"]
    assert all(values["mtp_1 loss"] is None for values in without_mtp.values())
    # The main model is built and run as without MTP: the same LM loss before any update (iteration 2 too,
    # the learning rate warms up from 0); the MTP loss's gradients then change the shared weights.
    assert runs["untied"][1]["lm loss"] == without_mtp[1]["lm loss"]
    assert runs["untied"][4]["lm loss"] != without_mtp[4]["lm loss"]


def _parallel_runs_and_resume(workdir, names):
    from megatron.training.checkpointing import write_tracker

    results = {name: _train(workdir, f"{PARALLEL_RUNS[name][0]} {MTP} {ITERATIONS}") for name in names}
    # Exact resume under PP2 with untied weights: the MTP depths and the last stage's embedding copy come back.
    root = os.path.join(workdir, "mtp_checkpoint")
    layout = f"{MTP} --pipeline-model-parallel-size 2 {ITERATIONS} --ckpt-format torch_dist"
    straight = _train(workdir, f"{layout} --save {root} --save-interval 2")
    if torch.distributed.get_rank() == 0:
        write_tracker(root, 2)  # as if the run had stopped after the first checkpoint
    torch.distributed.barrier()
    resumed = _train(workdir, f"{layout} --load {root}")
    # The same checkpoint at another layout (DP2, no pipeline): the depths keep their names (`mtp.layers.{k}`,
    # not renumbered with the last stage's decoder layers).
    resumed_dp2 = _train(workdir, f"{MTP} {ITERATIONS} --ckpt-format torch_dist --load {root}")
    return results, straight, resumed, resumed_dp2


@pytest.mark.world_size(2)
def test_parallel_runs_reproduce_single_rank_and_resume_exactly(tmp_path):
    references = _single_rank_references(str(tmp_path / "single"))
    results, straight, resumed, resumed_dp2 = run_on_ranks(2, _parallel_runs_and_resume, str(tmp_path),
                                                            list(PARALLEL_RUNS))[0]
    for name, (_, reference) in PARALLEL_RUNS.items():
        _assert_close(results[name], references[reference], name)
    _assert_close(straight, references["untied"], "pp2_straight")
    assert resumed == {iteration: straight[iteration] for iteration in (3, 4)}
    assert sorted(resumed_dp2) == [3, 4]
    for iteration in (3, 4):  # another reduction order: equal to rounding
        for metric in METRICS:
            assert resumed_dp2[iteration][metric] == pytest.approx(straight[iteration][metric], rel=REL_TOLERANCE)
