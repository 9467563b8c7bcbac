"""`--async-save` across runs: a process that calls pretrain() twice (each creating and destroying the default
process group) saves in the background in both; the second run's writes must not use the first run's group."""

import multiprocessing
import os
import socket

import torch

from tests.unit_tests.multiprocess_harness import FORK_SERVER_PRELOAD


def _two_pretrains_forked(roots, port, log_path):
    """pretrain() once per root, saving in the background, as the one rank of a world of its own on `port` (no
    process group before the first run), with the output in `log_path`."""
    import pretrain_gpt
    from megatron.core.enums import ModelType
    from megatron.training.checkpointing import read_tracker
    from megatron.training.training import pretrain
    from tests.unit_tests.dist_checkpointing.pretrain_helpers import tiny_gpt_argv

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    torch.set_num_threads(1)
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(log, 1)
    os.dup2(log, 2)
    for root in roots:
        argv = tiny_gpt_argv(f"--train-iters 2 --global-batch-size 2 --save {root} --save-interval 1 --async-save "
                             "--ckpt-format torch_dist")
        pretrain(pretrain_gpt.train_valid_test_datasets_provider, pretrain_gpt.model_provider,
                 ModelType.encoder_or_decoder, pretrain_gpt.forward_step, argv=argv.split())
        print("TRACKER", root, read_tracker(root), flush=True)


def _free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_background_saves_work_in_a_second_pretrain_of_the_process(tmp_path):
    roots = [str(tmp_path / "first"), str(tmp_path / "second")]
    log = tmp_path / "child.log"
    # A process of its own, forked from the rank pools' fork server (torch and Megatron already imported).
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(FORK_SERVER_PRELOAD)
    child = context.Process(target=_two_pretrains_forked, args=(roots, _free_port(), str(log)))
    child.start()
    child.join(timeout=240)
    if child.exitcode is None:
        child.kill()
        child.join()
    output = log.read_text(errors="replace") if log.exists() else ""
    assert child.exitcode == 0, output[-3000:]
    assert "NOT saved" not in output, output[-3000:]
    for root in roots:
        assert f"TRACKER {root} 2" in output
        # Scheduling is not saving: the save line comes from the background write's completion.
        assert f"scheduled a background save of iteration 1 to {root} (--async-save)" in output
        assert "successfully saved checkpoint" not in output
        assert f"saved checkpoint of iteration 1 to {root} (--ckpt-format torch_dist)" in output
        assert sorted(os.listdir(root)) == ["iter_0000001", "iter_0000002", "latest_checkpointed_iteration.txt",
                                            "metrics.jsonl"]


LAST_SAVE_FAILS = (
    "--num-layers 1 --hidden-size 32 --num-attention-heads 2 --seq-length 16 --micro-batch-size 2 "
    "--global-batch-size 2 --lr 1e-3 --mock-data --vocab-size 127 --make-vocab-size-divisible-by 64 "
    "--num-workers 0 --eval-iters 0 --train-iters 2 --save-interval 1 --async-save --ckpt-format torch_dist"
)


def _pretrain_whose_last_background_save_fails(root):
    """pretrain() saving iterations 1 and 2 in the background, the write of 2 failing (a full disk): (how
    pretrain() ended, the tracker, the root's entries)."""
    import contextlib
    import io

    import pretrain_gpt
    from megatron.core.dist_checkpointing import serialization
    from megatron.core.enums import ModelType
    from megatron.training.checkpointing import CheckpointSaveError, read_tracker
    from megatron.training.training import pretrain

    real_save = serialization.save

    def save_failing_at_iteration_2(state, directory, **kwargs):
        if os.path.basename(directory) == "iter_0000002.tmp":
            raise OSError(28, "No space left on device")
        return real_save(state, directory, **kwargs)

    serialization.save = save_failing_at_iteration_2
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            pretrain(pretrain_gpt.train_valid_test_datasets_provider, pretrain_gpt.model_provider,
                     ModelType.encoder_or_decoder, pretrain_gpt.forward_step,
                     argv=f"{LAST_SAVE_FAILS} --save {root} --metrics-file {root}/metrics.jsonl".split())
        ended = "returned"
    except CheckpointSaveError as error:
        ended = str(error)
    finally:
        serialization.save = real_save
    return ended, read_tracker(root), sorted(os.listdir(root))


def test_a_failed_last_background_save_fails_the_run(tmp_path):
    from tests.unit_tests.multiprocess_harness import run_on_ranks

    [(ended, tracker, entries)] = run_on_ranks(1, _pretrain_whose_last_background_save_fails, str(tmp_path))
    assert ended == (f"checkpoint of iteration 2 was NOT saved: a background write failed (see above); make --save "
                     f"{tmp_path} writable with free space (or point --save elsewhere) and restart: the latest "
                     f"checkpoint under {tmp_path} is still iteration 1")
    assert tracker == 1
    assert entries == ["iter_0000001", "latest_checkpointed_iteration.txt", "metrics.jsonl"]
