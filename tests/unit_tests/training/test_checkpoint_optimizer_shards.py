"""The torch format's distributed-optimizer shards loaded where the buffers are cut otherwise: the error names the
flags that differ from the checkpoint's, not only the data-parallel size (which may be the same)."""

import argparse
import os

import pytest
import torch

from megatron.training.checkpoint_optimizer_shards import RESHARD_HINT, reshard_hint
from tests.unit_tests.dist_checkpointing.pretrain_helpers import run_pretrain
from tests.unit_tests.multiprocess_harness import run_on_ranks

TORCH_DISTOPT = "--ckpt-format torch --use-distributed-optimizer --train-iters 1 --lr-warmup-iters 0 --lr-decay-iters 1"


def test_hint_names_each_flag_that_cuts_the_shards_otherwise():
    saved = argparse.Namespace(num_distributed_optimizer_instances=2, ddp_bucket_size=10000, overlap_grad_reduce=True)
    current = argparse.Namespace(num_distributed_optimizer_instances=1, ddp_bucket_size=None, overlap_grad_reduce=True)
    assert reshard_hint(saved, current) == (
        "The shards are cut otherwise because of --num-distributed-optimizer-instances: 2 in the checkpoint, 1 in "
        "this run; --ddp-bucket-size: 10000 in the checkpoint, not given in this run: launch with the checkpoint's "
        f"values. {RESHARD_HINT}")
    # Arguments saved before a flag existed count as its default.
    assert reshard_hint(argparse.Namespace(), argparse.Namespace(ddp_pad_buckets_for_high_nccl_busbw=True)) == (
        "The shards are cut otherwise because of --ddp-pad-buckets-for-high-nccl-busbw: not set in the checkpoint, "
        f"set in this run: launch with the checkpoint's value. {RESHARD_HINT}")
    assert reshard_hint(saved, saved) == RESHARD_HINT


def _resume_with_one_optimizer_instance(workdir):
    from megatron.training.checkpointing import CheckpointLoadError

    root = os.path.join(workdir, "ckpt")
    run_pretrain(workdir, f"{TORCH_DISTOPT} --num-distributed-optimizer-instances 2 --save {root} --save-interval 1")
    with pytest.raises(CheckpointLoadError) as error:
        run_pretrain(workdir, f"{TORCH_DISTOPT} --load {root}")
    torch.distributed.barrier()
    return str(error.value)


@pytest.mark.world_size(2)
def test_another_number_of_optimizer_instances_at_the_same_data_parallel_size_is_named(tmp_path):
    # Two instances of one rank each hold the whole state per rank; one instance of two ranks holds halves. Both
    # runs have data-parallel size 2 and two shard files, so the file count cannot tell them apart.
    message = run_on_ranks(2, _resume_with_one_optimizer_instance, str(tmp_path))[0]
    assert "distrib_optim_dp_rank_000.pt: DistributedOptimizer.load_state_dict: the checkpoint was sharded " \
        "differently" in message
    assert "--num-distributed-optimizer-instances: 2 in the checkpoint, 1 in this run: launch with the " \
        "checkpoint's value." in message
