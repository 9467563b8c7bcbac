"""The uneven pipeline-split flags on the command line: the split and the virtual stages they derive, and the
rules (upstream's, plus what the wrappers here need), with messages naming the flags."""

from functools import partial

import pytest

from megatron.training.model_config import core_transformer_config_from_args
from tests.unit_tests.training import argument_checks

SMALLER = ("--num-layers 4 --hidden-size 32 --seq-length 16 --micro-batch-size 1 --global-batch-size 4 "
           "--train-iters 2")
PP2 = "--pipeline-model-parallel-size 2"
validated = partial(argument_checks.validated, world_size=2, base=f"{argument_checks.BASE} {SMALLER}")


@pytest.mark.parametrize(
    "extra, counts, chunks",
    [
        (f"{PP2} --decoder-first-pipeline-num-layers 1", (1, 3), None),
        (f"{PP2} --decoder-last-pipeline-num-layers 4", (0, 4), None),
        (f"{PP2} --num-layers 3 --account-for-embedding-in-pipeline-split", (1, 2), None),
        (f"{PP2} --num-layers 6 --account-for-embedding-in-pipeline-split --account-for-loss-in-pipeline-split "
         "--num-layers-per-virtual-pipeline-stage 2", (1, 2, 2, 1), 2),
        (f"{PP2} --pipeline-model-parallel-layout E|t*4L", (0, 4), None),
        (f"{PP2} --pipeline-model-parallel-layout Et|tt|t|L", (1, 2, 1, 0), 2),
        (f"{PP2} --pipeline-model-parallel-layout Et|tt|t|L --num-virtual-stages-per-pipeline-rank 2",
         (1, 2, 1, 0), 2),
        (f"{PP2} --num-layers 8 --num-virtual-stages-per-pipeline-rank 2 --decoder-first-pipeline-num-layers 2",
         (1, 3, 1, 3), 2),
        ("--pipeline-model-parallel-layout EttttL", (4,), None),  # one stage without pipelining
    ],
)
def test_split_and_chunks(extra, counts, chunks):
    args = validated(extra)
    assert args.virtual_stage_layer_counts == counts
    assert args.virtual_pipeline_model_parallel_size == chunks
    config = core_transformer_config_from_args(args)  # the config accepts what the flags accepted
    assert config.virtual_pipeline_model_parallel_size == chunks


@pytest.mark.parametrize(
    "extra, world_size, message",
    [
        ("--decoder-first-pipeline-num-layers 1", 1, r"--decoder-first-pipeline-num-layers / "
         r"--decoder-last-pipeline-num-layers need --pipeline-model-parallel-size > 1 \(got 1\)"),
        (f"{PP2} --decoder-last-pipeline-num-layers -1", 2,
         r"--decoder-last-pipeline-num-layers must be an integer in \[0, --num-layers=4\], got -1"),
        (f"{PP2} --decoder-first-pipeline-num-layers 5", 2,
         r"--decoder-first-pipeline-num-layers must be an integer in \[0, --num-layers=4\], got 5"),
        ("--pipeline-model-parallel-size 4 --num-layers 8 --decoder-first-pipeline-num-layers 3", 4,
         r"the 5 layers left by --decoder-first-pipeline-num-layers \(3\) of --num-layers \(8\) must be divisible "
         r"by the 3 other pipeline stages"),
        (f"{PP2} --decoder-first-pipeline-num-layers 1 --account-for-loss-in-pipeline-split", 2,
         r"exclusive \(as upstream\)"),
        (f"{PP2} --pipeline-model-parallel-layout Ett|ttL --decoder-first-pipeline-num-layers 2", 2,
         r"--pipeline-model-parallel-layout places every layer itself: drop --decoder-first-pipeline-num-layers"),
        (f"{PP2} --pipeline-model-parallel-layout Ett|ttL --account-for-embedding-in-pipeline-split", 2,
         r"--pipeline-model-parallel-layout places every layer itself"),
        (f"{PP2} --account-for-loss-in-pipeline-split", 2,
         r"--num-layers \(4\) \+ 1 for each of --account-for-loss-in-pipeline-split \(5\) must be divisible by "
         r"--pipeline-model-parallel-size \(2\)"),
        (f"{PP2} --num-layers-per-virtual-pipeline-stage 1 --decoder-first-pipeline-num-layers 2", 2,
         r"--num-layers-per-virtual-pipeline-stage needs the same number of layers in every virtual stage.*give "
         r"--num-virtual-stages-per-pipeline-rank instead"),
        (f"{PP2} --num-virtual-stages-per-pipeline-rank 2 --decoder-first-pipeline-num-layers 1", 2,
         r"the first pipeline stage \(--decoder-first-pipeline-num-layers\) holds 1 layers, not divisible by its 2 "
         r"virtual stages"),
        (f"{PP2} --pipeline-model-parallel-layout Ett|t|tL", 2, r"has 3 stages, not a multiple of "
         r"--pipeline-model-parallel-size \(2\)"),
        (f"{PP2} --pipeline-model-parallel-layout Et|tt|t|L --num-virtual-stages-per-pipeline-rank 4", 2,
         r"--pipeline-model-parallel-layout 'Et\|tt\|t\|L' gives 2 virtual stages per pipeline rank .* but "
         r"--num-virtual-stages-per-pipeline-rank is 4"),
        (f"{PP2} --pipeline-model-parallel-layout Et|tt|t|L --num-layers-per-virtual-pipeline-stage 2", 2,
         r"but --num-layers-per-virtual-pipeline-stage 2 gives 1"),
        (f"{PP2} --pipeline-model-parallel-layout Ettt|L", 2, r"places 3 transformer layers \('t'\) but "
         r"--num-layers is 4"),
        (f"{PP2} --pipeline-model-parallel-layout Ettt|tmL", 2, r"places multi-token-prediction depths \('m'\): "
         r"add --mtp-num-layers"),
        (f"{PP2} --pipeline-model-parallel-layout Ettt|tmL --position-embedding-type rope --mtp-num-layers 2", 2,
         r"places 1 multi-token-prediction depths \('m'\) but --mtp-num-layers is 2"),
        (f"{PP2} --pipeline-model-parallel-layout Ett|tt+L", 2, r"unknown symbol '\+'"),
        ("--pipeline-model-parallel-layout Ett|ttL", 1, r"has 2 stages: an interleaved pipeline needs "
         r"--pipeline-model-parallel-size > 1"),
        ("--pipeline-model-parallel-size 3 --pipeline-model-parallel-layout Ett||ttL", 3,
         r"leaves pipeline rank\(s\) \[1\] without any parameter \(pipeline stage 1: no transformer layer\)"),
        ("--pipeline-model-parallel-size 3 --pipeline-model-parallel-layout Ett||ttL --use-megatron-fsdp", 3,
         r"leaves pipeline rank\(s\) \[1\] without any parameter"),
    ],
)
def test_rules_name_the_flags(extra, world_size, message):
    with pytest.raises(ValueError, match=message):
        validated(extra, world_size=world_size)


def test_odd_layer_count_needs_an_uneven_split():
    with pytest.raises(ValueError, match=r"--num-layers \(3\) must be divisible by --pipeline-model-parallel-size "
                                         r"\(2\).*or split unevenly with --decoder-first-pipeline-num-layers"):
        validated(f"{PP2} --num-layers 3")
    assert validated(f"{PP2} --num-layers 3 --decoder-last-pipeline-num-layers 2").virtual_stage_layer_counts == (1, 2)


@pytest.mark.parametrize("wrapper", ["--use-distributed-optimizer", "--use-megatron-fsdp"])
def test_empty_middle_chunk_runs_under_every_wrapper(wrapper):
    """A chunk without layers is fine where its rank holds parameters elsewhere (Megatron DDP, the distributed
    optimizer, FSDP2, Megatron-FSDP)."""
    args = validated(f"{PP2} --pipeline-model-parallel-layout Ett||tt|L {wrapper}")
    assert args.virtual_stage_layer_counts == (2, 0, 2, 0)
