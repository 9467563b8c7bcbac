"""The ends of a run on 2 ranks: --exit-signal-handler records SIGTERM from start-up on (a signal while the model
is built stops the run before its first iteration; one during the final evaluation lets it finish), and a finished
run resumed from a non-persistent checkpoint saves it persistently into --save."""

import contextlib
import io
import json
import os
import shutil
import signal

import torch

from tests.unit_tests.multiprocess_harness import run_on_ranks

TINY_GPT = (
    "--num-layers 1 --hidden-size 32 --num-attention-heads 2 --seq-length 16 --micro-batch-size 2 "
    "--global-batch-size 8 --lr 1e-3 --mock-data --vocab-size 127 --make-vocab-size-divisible-by 64 "
    "--hidden-dropout 0 --attention-dropout 0 --num-workers 0 --log-interval 1 --train-iters 2"
)


def _pretrain(argv, model_provider=None, forward_step=None):
    """(the iteration pretrain() returned, what it printed, whether SIGTERM has its default action again)."""
    import pretrain_gpt
    from megatron.core.enums import ModelType
    from megatron.training.training import pretrain

    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        iteration = pretrain(pretrain_gpt.train_valid_test_datasets_provider,
                             model_provider or pretrain_gpt.model_provider, ModelType.encoder_or_decoder,
                             forward_step or pretrain_gpt.forward_step, argv=argv.split())
    return iteration, stdout.getvalue(), signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def _sigterm_while_the_model_is_built(workdir):
    import pretrain_gpt

    def model_provider(*args, **kwargs):
        if torch.distributed.get_rank() == 0:
            os.kill(os.getpid(), signal.SIGTERM)
        return pretrain_gpt.model_provider(*args, **kwargs)

    iteration, output, restored = _pretrain(f"{TINY_GPT} --eval-iters 0 --save {workdir} --exit-signal-handler "
                                            f"--metrics-file {workdir}/metrics.jsonl", model_provider=model_provider)
    return iteration, "exiting at iteration 0: received SIGTERM before the first iteration" in output, restored


def test_sigterm_during_set_up_stops_every_rank_before_the_first_iteration(tmp_path):
    assert run_on_ranks(2, _sigterm_while_the_model_is_built, str(tmp_path)) == [(0, True, True), (0, False, True)]
    assert (tmp_path / "metrics.jsonl").read_text() == ""  # no iteration ran
    assert not os.path.exists(tmp_path / "latest_checkpointed_iteration.txt")  # nothing trained, nothing saved


def _sigterm_during_the_final_evaluation(workdir):
    import pretrain_gpt
    from megatron.training.checkpointing import read_tracker

    forwards = {"count": 0}

    def forward_step(data_iterator, model):
        forwards["count"] += 1
        if torch.distributed.get_rank() == 0 and forwards["count"] == 2 * 2 + 1:  # 2 iterations x 2 microbatches
            os.kill(os.getpid(), signal.SIGTERM)
        return pretrain_gpt.forward_step(data_iterator, model)

    iteration, _, restored = _pretrain(f"{TINY_GPT} --eval-iters 2 --eval-interval 100 --save {workdir} "
                                       f"--exit-signal-handler --metrics-file {workdir}/metrics.jsonl",
                                       forward_step=forward_step)
    return iteration, read_tracker(workdir), forwards["count"], restored


def test_sigterm_during_the_final_evaluation_lets_it_finish(tmp_path):
    # The last iteration's checkpoint is saved, and the final evaluation runs to the end: 2 batches of 2 microbatches
    # per rank on the validation set, then on the test set, after the 2 training iterations' 2 x 2.
    assert run_on_ranks(2, _sigterm_during_the_final_evaluation, str(tmp_path)) == [(2, 2, 3 * 2 * 2, True)] * 2
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(record["iteration"], record["split"], record.get("when")) for record in records] == [
        (1, "train", None), (2, "train", None), (2, "validation", "on validation set"), (2, "test", "on test set")]


def _resume_a_finished_run_from_its_non_persistent_checkpoint(workdir):
    from megatron.training.checkpointing import read_tracker

    flags = f"{TINY_GPT} --eval-iters 0 --ckpt-format torch_dist --non-persistent-save-interval 2"
    _pretrain(f"{flags} --save {workdir}")
    if torch.distributed.get_rank() == 0:  # as if killed between the non-persistent and the final persistent save
        shutil.rmtree(os.path.join(workdir, "iter_0000002"))
        os.remove(os.path.join(workdir, "latest_checkpointed_iteration.txt"))
    torch.distributed.barrier()
    iteration, output, _ = _pretrain(f"{flags} --load {workdir} --save {workdir}")
    return iteration, read_tracker(workdir), "resuming the non-persistent checkpoint" in output


def test_finished_run_resumed_from_a_non_persistent_checkpoint_saves_it_persistently(tmp_path):
    assert run_on_ranks(2, _resume_a_finished_run_from_its_non_persistent_checkpoint, str(tmp_path)) == [
        (2, 2, True), (2, 2, False)]
    assert os.path.isfile(tmp_path / "iter_0000002" / ".metadata")
