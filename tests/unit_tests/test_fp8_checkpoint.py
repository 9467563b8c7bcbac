"""FP8 runs and torch_dist checkpoints through `pretrain()` on 2 ranks (the small GPT of the checkpoint tests).

- `--fp8-param-gather` under Megatron-FSDP (ZeRO-3): a run resumed from the checkpoint of iteration 4 continues
  exactly like the run that wrote it (the FP8 shards are re-encoded from the loaded fp32 main weights with the
  same agreed scales).
- A checkpoint of a run without FP8 loads into a delayed-scaling FP8 run (fine-tuning in FP8): its amax
  histories are not in the checkpoint, start empty, and the load report says so.
"""

import contextlib
import io
import math

import pytest
import torch

from tests.unit_tests.dist_checkpointing.pretrain_helpers import run_pretrain
from tests.unit_tests.multiprocess_harness import run_on_ranks

# Resumed and uninterrupted runs do the same computation: only a different summation order could separate them.
RESUME_TOLERANCE = 1e-5
FSDP_FP8 = ("--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params --ckpt-format torch_dist "
            "--fp8-format hybrid --fp8-recipe tensorwise --fp8-param-gather")
# Saved at iteration 4 of 6: iteration 5 tests the loaded weights, 6 the loaded optimizer state too.
SIX_ITERATIONS = "--train-iters 6 --lr-decay-iters 6"
# Saved at iteration 1 (with optimizer state) of 3: the FP8 run trains two iterations from it.
THREE_ITERATIONS = "--train-iters 3 --lr-decay-iters 3"


def _resume_fsdp_fp8(workdir):
    import megatron_fsdp.collectives as fsdp_collectives
    from megatron.training.checkpointing import write_tracker

    uninterrupted = run_pretrain(f"{workdir}/full", f"{FSDP_FP8} {SIX_ITERATIONS} --save {workdir}/ckpt "
                                                    "--save-interval 4")
    if torch.distributed.get_rank() == 0:
        write_tracker(f"{workdir}/ckpt", 4)  # resume from the checkpoint of iteration 4
    torch.distributed.barrier()
    gathered_dtypes = set()
    original = fsdp_collectives.all_gather_flat
    original_in_place = fsdp_collectives.all_gather_pieces_in_place

    def recording_all_gather(output, shard, *args, **kwargs):
        gathered_dtypes.add(str(shard.dtype))
        return original(output, shard, *args, **kwargs)

    def recording_all_gather_in_place(outputs, own_pieces, *args, **kwargs):  # fp32 groups on gloo
        gathered_dtypes.add(str(own_pieces[0].dtype))
        return original_in_place(outputs, own_pieces, *args, **kwargs)

    fsdp_collectives.all_gather_flat = recording_all_gather
    fsdp_collectives.all_gather_pieces_in_place = recording_all_gather_in_place
    try:
        resumed = run_pretrain(f"{workdir}/resumed", f"{FSDP_FP8} {SIX_ITERATIONS} --load {workdir}/ckpt "
                                                     f"--save {workdir}/ckpt_resumed --save-interval 4")
    finally:
        fsdp_collectives.all_gather_flat = original
        fsdp_collectives.all_gather_pieces_in_place = original_in_place
    return uninterrupted, resumed, gathered_dtypes


def test_fp8_param_gather_megatron_fsdp_torch_dist_resume_is_exact(tmp_path):
    uninterrupted, resumed, gathered_dtypes = run_on_ranks(2, _resume_fsdp_fp8, str(tmp_path))[0]
    assert gathered_dtypes == {"torch.float32", "torch.uint8"}  # the resumed run gathers its FP8 weights as bytes
    assert sorted(uninterrupted) == list(range(1, 7)) and sorted(resumed) == [5, 6]
    for iteration in range(5, 7):
        assert resumed[iteration] == pytest.approx(uninterrupted[iteration], abs=RESUME_TOLERANCE), (
            iteration, resumed, uninterrupted)


def _fp8_finetune_from_plain_checkpoint(workdir, wrapper):
    import torch.distributed as dist

    plain = run_pretrain(f"{workdir}/plain", f"{wrapper} {THREE_ITERATIONS} --ckpt-format torch_dist "
                                             f"--save {workdir}/ckpt --save-interval 1 --exit-interval 1")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        fp8 = run_pretrain(f"{workdir}/fp8", f"{wrapper} {THREE_ITERATIONS} --ckpt-format torch_dist "
                                             f"--load {workdir}/ckpt --fp8-format hybrid --fp8-recipe delayed "
                                             "--fp8-amax-history-len 4")
    return plain, fp8, printed.getvalue() if dist.get_rank() == 0 else None


@pytest.mark.parametrize("wrapper", ["--use-distributed-optimizer", "--use-megatron-fsdp"])
def test_non_fp8_checkpoint_loads_into_delayed_fp8_run(tmp_path, wrapper):
    plain, fp8, printed = run_on_ranks(2, _fp8_finetune_from_plain_checkpoint, str(tmp_path), wrapper)[0]
    assert sorted(plain) == [1] and sorted(fp8) == [2, 3]
    assert all(math.isfinite(loss) for loss in fp8.values())
    # 4 transformer layers x (qkv, proj, fc1, fc2); the output layer never runs in FP8 and has no histories.
    assert "not loaded: FP8 amax histories of 16 layer(s) (not in the checkpoint" in printed, printed
    assert "they start empty" in printed


def _plain_resume_from_delayed_fp8_checkpoint(workdir):
    import torch.distributed as dist

    fp8 = run_pretrain(f"{workdir}/fp8", f"{THREE_ITERATIONS} --ckpt-format torch_dist --fp8-format hybrid "
                                         f"--fp8-recipe delayed --save {workdir}/ckpt --save-interval 1 "
                                         "--exit-interval 1")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        plain = run_pretrain(f"{workdir}/plain", f"{THREE_ITERATIONS} --ckpt-format torch_dist --load {workdir}/ckpt "
                                                 "--dist-ckpt-strictness raise_all")
    return fp8, plain, printed.getvalue() if dist.get_rank() == 0 else None


def test_delayed_fp8_checkpoint_resumes_without_fp8_leaving_its_histories_unused(tmp_path):
    fp8, plain, printed = run_on_ranks(2, _plain_resume_from_delayed_fp8_checkpoint, str(tmp_path))[0]
    assert sorted(fp8) == [1] and sorted(plain) == [2, 3]
    assert all(math.isfinite(loss) for loss in plain.values())
    # Even --dist-ckpt-strictness raise_all takes them for what they are, not for tensors of another model.
    assert "not loaded: FP8 amax histories of 16 layer(s) (saved by a run with delayed FP8 scaling; this run keeps " \
           "none): unused" in printed, printed
    assert "the model lacks" not in printed
