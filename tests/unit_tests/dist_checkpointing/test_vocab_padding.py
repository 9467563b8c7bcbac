"""A checkpoint loads across another vocabulary padding: 121 tokens padded to a multiple of 128 x TP are 128
rows at TP1 and 256 at TP2. The loaded rows (the whole vocabulary and the padding both runs have) equal the
saved ones exactly, model and optimizer moments, under every wrapper; the rows only the loading model has keep
its values with zero moments; the load report says so; and training goes on from the checkpoint. With
--use-checkpoint-args the padding does not change: the run keeps the checkpoint's rows and its losses.
"""

import contextlib
import io
import math
import os

import pytest
import torch

from tests.unit_tests.dist_checkpointing.pretrain_helpers import TrainingState, run_pretrain
from tests.unit_tests.multiprocess_harness import run_on_ranks

VOCAB = 120 + 1  # TINY_GPT's NullTokenizer --vocab-size 120: the text ids 0..119 and the eod 120
PADDING = "--make-vocab-size-divisible-by 128"  # TINY_GPT's 64 would pad to 128 rows at TP1 and at TP2
# One micro-batch per data-parallel rank holds TINY_GPT's global batch of 8 (DP2 at TP1, DP1 at TP2).
TP1, TP2 = "--micro-batch-size 4", "--tensor-model-parallel-size 2 --micro-batch-size 8"
ROWS = {TP1: 128, TP2: 256}
WRAPPERS = {
    "ddp": "",
    "distributed_optimizer": "--use-distributed-optimizer",
    "megatron_fsdp_z3": "--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params",
    "torch_fsdp2": "--use-torch-fsdp2",
}
VOCAB_TENSORS = ("embedding.word_embeddings.weight", "output_layer.weight")
MOMENTS = ("exp_avg", "exp_avg_sq")
SAVED_AT = 2  # iterations 1 and 2 both change the weights (learning-rate warm-up over 2 iterations)


# Training goes on: under these wrappers a run saved at iteration 2 of 4 at one TP size is resumed at the other.
# The losses cannot equal the uninterrupted run's: the output layer's padding rows give logits that enter the
# softmax's denominator (no label names them, but they take probability mass), and the resumed model has other
# padding rows than the uninterrupted one (128 fresh ones at TP2; at TP1 the 128 trained rows of TP2 are gone).
# The true vocabulary's rows are the same, so the losses stay close: 128 fresh padding logits near 0 about double
# the denominator at first (+ln 2 on a loss near ln 121), trained ones that are gone lower it. Measured: at most
# 14.2% relative (TP1 -> TP2, higher than the uninterrupted run) and 12.1% (TP2 -> TP1, lower), the same under
# DDP and Megatron-FSDP ZeRO-3.
TRAINING_WRAPPERS = ("ddp", "megatron_fsdp_z3")
REL_TOLERANCE = 0.2


def _load_and_save_again(saved, resaved, flags):
    """Load `saved` and save the loaded state at once (no step in between: the second checkpoint is exactly what
    the load produced). Returns the load report (rank 0)."""
    from megatron.training import checkpointing

    state = TrainingState(f"{flags} --load {saved} --save {resaved}")
    output = io.StringIO()
    with contextlib.redirect_stdout(output):
        iteration = checkpointing.load_checkpoint(state.model, state.optimizer, state.scheduler, state.args)
    checkpointing.save_checkpoint(iteration, state.model, state.optimizer, state.scheduler, state.args)
    state.close()
    return output.getvalue()


def _every_wrapper_both_ways(workdir):
    """Per wrapper and direction: pretrain() at one TP size saves at iteration 2; the checkpoint is loaded (and
    saved again) at the other TP size, and under TRAINING_WRAPPERS training resumes there too."""
    from megatron.training.checkpointing import write_tracker

    results = {}
    for wrapper in WRAPPERS:
        iterations = 2 * SAVED_AT if wrapper in TRAINING_WRAPPERS else SAVED_AT
        for save_tp, load_tp in ((TP1, TP2), (TP2, TP1)):
            case = os.path.join(workdir, f"{wrapper}_{ROWS[save_tp]}_to_{ROWS[load_tp]}")
            saved = os.path.join(case, "saved")
            flags = (f"{PADDING} {WRAPPERS[wrapper]} --ckpt-format torch_dist --train-iters {iterations} "
                     f"--lr-decay-iters {2 * SAVED_AT}")
            reference = run_pretrain(case, f"{flags} {save_tp} --save {saved} --save-interval {SAVED_AT}")
            if torch.distributed.get_rank() == 0:
                write_tracker(saved, SAVED_AT)  # resume from the middle of the reference run
            torch.distributed.barrier()
            report = _load_and_save_again(saved, os.path.join(case, "resaved"), f"{flags} {load_tp}")
            resumed = None
            if wrapper in TRAINING_WRAPPERS:
                resumed = run_pretrain(case, f"{flags} {load_tp} --load {saved}")
            results[case] = (ROWS[save_tp], ROWS[load_tp], report, reference, resumed)
    return results


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    return run_on_ranks(2, _every_wrapper_both_ways, str(tmp_path_factory.mktemp("vocab_padding")))[0]


def _check_rows(case, saved_rows, loaded_rows):
    from megatron.core.dist_checkpointing import offline

    saved = offline.read_checkpoint(os.path.join(case, "saved", f"iter_{SAVED_AT:07d}"))
    resaved = offline.read_checkpoint(os.path.join(case, "resaved", f"iter_{SAVED_AT:07d}"))
    common = min(saved_rows, loaded_rows)
    for name in VOCAB_TENSORS:
        keys = [f"model.{name}"] + [f"optimizer.state.{name}.{moment}" for moment in MOMENTS]
        for key in keys:
            before, after = saved[key], resaved[key]
            assert before.shape == (saved_rows, 32) and after.shape == (loaded_rows, 32), (case, key)
            assert torch.equal(after[:common], before[:common]), (case, key)  # the vocabulary and shared padding
            assert before[:VOCAB].abs().sum() > 0, (case, key)  # trained: the equality means something
        for moment in MOMENTS:  # rows only the loading model has: never stepped
            assert torch.count_nonzero(resaved[f"optimizer.state.{name}.{moment}"][common:]) == 0, (case, name)
    # every other tensor loads as usual
    other = [key for key in saved if torch.is_tensor(saved[key]) and not any(name in key for name in VOCAB_TENSORS)]
    assert len(other) > 50 and all(torch.equal(saved[key], resaved[key]) for key in other), case


@pytest.mark.world_size(2)
def test_loaded_rows_equal_the_saved_ones_under_every_wrapper(cases):
    assert len(cases) == 2 * len(WRAPPERS)
    for case, (saved_rows, loaded_rows, report, _, _) in cases.items():
        _check_rows(case, saved_rows, loaded_rows)
        saved_tp, loaded_tp = saved_rows // 128, loaded_rows // 128
        assert (f"note: vocabulary padding changed: embedding.word_embeddings.weight (and its optimizer state), "
                f"output_layer.weight (and its optimizer state): {saved_rows} rows in the checkpoint "
                f"(--make-vocab-size-divisible-by 128 x TP {saved_tp}) and {loaded_rows} in this run (128 x TP "
                f"{loaded_tp}), true vocabulary size {VOCAB}: rows 0-127 loaded, ") in report, (case, report)
        rest = ("rows 128-255 keep this model's values (optimizer moments zero)" if loaded_rows > saved_rows
                else "the checkpoint's rows 128-255 are not read")
        assert rest in report, (case, report)


@pytest.mark.world_size(2)
def test_training_continues_at_another_vocab_padding(cases):
    largest = {}
    for case, (_, _, _, reference, resumed) in cases.items():
        if resumed is None:
            continue
        assert sorted(reference) == list(range(1, 2 * SAVED_AT + 1)), case
        assert sorted(resumed) == list(range(SAVED_AT + 1, 2 * SAVED_AT + 1)), case
        assert all(math.isfinite(loss) for loss in resumed.values()), (case, resumed)
        more_padding = case.endswith("128_to_256")
        first = SAVED_AT + 1
        assert (resumed[first] > reference[first]) == more_padding, (case, reference, resumed)  # the padding's mass
        differences = [abs(resumed[i] - reference[i]) / reference[i] for i in resumed]
        largest[os.path.basename(case)] = max(differences)
        assert max(differences) <= REL_TOLERANCE, (case, reference, resumed)
    assert len(largest) == 2 * len(TRAINING_WRAPPERS)
    print("largest relative loss difference after loading at another vocab padding:", largest)


def _resume_at_tp2_with_checkpoint_args(workdir, saved):
    """The DDP case's TP1 run (128 rows), saved at iteration 2 of 4, resumed by a TP2 run with --use-checkpoint-args
    (and a wrong --hidden-size). Returns (the resumed losses, the rows the resumed run built, what rank 0
    printed)."""
    from megatron.training.global_vars import get_args

    flags = f"{PADDING} --ckpt-format torch_dist --train-iters {2 * SAVED_AT} --lr-decay-iters {2 * SAVED_AT}"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        resumed = run_pretrain(workdir, f"{flags} {TP2} --load {saved} --use-checkpoint-args --hidden-size 64")
    return resumed, get_args().padded_vocab_size, printed.getvalue()


@pytest.mark.world_size(2)
def test_use_checkpoint_args_keeps_the_saved_rows_at_another_tp_size(cases, tmp_path):
    """As upstream, --use-checkpoint-args takes the checkpoint's padded vocabulary: TP2 builds the 128 rows TP1
    saved (not 256), so the padding rows are the trained ones and the losses go on as the uninterrupted run's
    (to the reduction order of another TP size)."""
    case = next(case for case in cases if os.path.basename(case) == f"ddp_{ROWS[TP1]}_to_{ROWS[TP2]}")
    straight = cases[case][3]  # the uninterrupted TP1 run that saved the checkpoint
    resumed, rows, printed = run_on_ranks(2, _resume_at_tp2_with_checkpoint_args, str(tmp_path),
                                          os.path.join(case, "saved"))[0]
    assert rows == ROWS[TP1]
    assert "vocabulary padding changed" not in printed and "--hidden-size 32 (command line: 64)" in printed
    assert sorted(straight) == list(range(1, 2 * SAVED_AT + 1))
    assert sorted(resumed) == list(range(SAVED_AT + 1, 2 * SAVED_AT + 1))
    for iteration, loss in resumed.items():
        assert loss == pytest.approx(straight[iteration], rel=1e-6), (iteration, straight, resumed)
