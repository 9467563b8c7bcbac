"""The interleaved-pipeline flags: derived chunk count and the upstream rules, with messages naming the flags."""

from functools import partial

import pytest

from tests.unit_tests.training import argument_checks

EIGHT_LAYERS = f"{argument_checks.BASE} --num-layers 8 --micro-batch-size 1"
validated = partial(argument_checks.validated, world_size=2, base=f"{EIGHT_LAYERS} --pipeline-model-parallel-size 2")


@pytest.mark.parametrize(
    "extra, chunks",
    [("--num-layers-per-virtual-pipeline-stage 2 --global-batch-size 4", 2),
     ("--num-virtual-stages-per-pipeline-rank 4 --global-batch-size 4", 4),
     ("--num-layers-per-virtual-pipeline-stage 4 --global-batch-size 4", None),  # one chunk: plain 1F1B
     ("--num-virtual-stages-per-pipeline-rank 2 --global-batch-size 7 "
      "--microbatch-group-size-per-virtual-pipeline-stage 4", 2),
     ("--global-batch-size 3", None),
     ("--num-virtual-stages-per-pipeline-rank 2 --global-batch-size 4 --use-megatron-fsdp", 2),
     ("--num-virtual-stages-per-pipeline-rank 2 --global-batch-size 4 --use-megatron-fsdp "
      "--data-parallel-sharding-strategy optim", 2)],
)
def test_chunks_per_rank(extra, chunks):
    args = validated(extra)
    assert args.virtual_pipeline_model_parallel_size == chunks


@pytest.mark.parametrize(
    "extra, message",
    [("--num-layers-per-virtual-pipeline-stage 3 --global-batch-size 4",
      r"layers of a pipeline stage .*--num-layers-per-virtual-pipeline-stage \(3\)"),
     ("--num-virtual-stages-per-pipeline-rank 3 --global-batch-size 4",
      r"divisible by --num-virtual-stages-per-pipeline-rank \(3\)"),
     ("--num-virtual-stages-per-pipeline-rank 2 --num-layers-per-virtual-pipeline-stage 2 --global-batch-size 4",
      "either"),
     ("--num-virtual-stages-per-pipeline-rank 2 --global-batch-size 3",
      r"with the default --microbatch-group-size-per-virtual-pipeline-stage \(the pipeline size\) needs the number "
      r"of microbatches per global batch \(3 = .*\) to be a multiple of --pipeline-model-parallel-size \(2\)"),
     ("--num-virtual-stages-per-pipeline-rank 2 --global-batch-size 5 "
      "--microbatch-group-size-per-virtual-pipeline-stage 4",
      r"number of microbatches \(5\) modulo --microbatch-group-size-per-virtual-pipeline-stage \(4\) must be 0 "
      r"or at least --pipeline-model-parallel-size \(2\), got 1; change --global-batch-size or "
      r"--microbatch-group-size-per-virtual-pipeline-stage$"),
     ("--num-virtual-stages-per-pipeline-rank 2 --global-batch-size 4 "
      "--microbatch-group-size-per-virtual-pipeline-stage 8", "between --pipeline-model-parallel-size"),
     ("--num-layers-per-virtual-pipeline-stage 0 --global-batch-size 4",
      r"--num-layers-per-virtual-pipeline-stage must be at least 1, got 0"),
     ("--num-layers-per-virtual-pipeline-stage -2 --global-batch-size 4",
      r"--num-layers-per-virtual-pipeline-stage must be at least 1, got -2")],
)
def test_rules_name_the_flags(extra, message):
    with pytest.raises(ValueError, match=message):
        validated(extra)


@pytest.mark.parametrize("extra", ["--global-batch-size 3", "--num-virtual-stages-per-pipeline-rank 1 "
                                                         "--global-batch-size 3"])
def test_group_size_without_interleaving_is_ignored_as_upstream(extra):
    """Upstream accepts the group size with a plain 1F1B pipeline, where it changes nothing (here: a warning)."""
    with pytest.warns(UserWarning, match="--microbatch-group-size-per-virtual-pipeline-stage has no effect without "
                                         "an interleaved pipeline"):
        args = validated(f"{extra} --microbatch-group-size-per-virtual-pipeline-stage 4")
    assert args.virtual_pipeline_model_parallel_size is None


def test_needs_a_pipeline():
    with pytest.raises(ValueError, match="need --pipeline-model-parallel-size > 1"):
        argument_checks.validated("--num-virtual-stages-per-pipeline-rank 2", base=EIGHT_LAYERS)
