"""Upstream checkpoint flags on real `pretrain()` runs: --save-retain-interval, --auto-detect-ckpt-format,
--ckpt-convert-format, --non-persistent-save-interval and --use-checkpoint-args.

One pool task trains once straight and resumes several ways from the checkpoints it and an interrupted run
wrote; the tests below assert on its results (fp32 on CPU: resumed losses equal the straight run's exactly).
Runs that resume a checkpoint train two iterations past it (--exit-interval where the schedule goes on): the
first tests the loaded model, the second the loaded optimizer state.
"""

import contextlib
import io
import os

import pytest
import torch

from megatron.training.checkpoint_retention import iterations_to_remove, prune_to_retain_interval
from megatron.training.checkpointing import write_tracker
from tests.unit_tests.dist_checkpointing.pretrain_helpers import run_pretrain
from tests.unit_tests.multiprocess_harness import run_on_ranks

WORLD_SIZE = 2
SCHEDULE = "--train-iters 10 --lr-decay-iters 10"
CRASH_ITERATION = 8


class _Interrupted(RuntimeError):
    pass


def _forward_step_crashing_in(iteration):
    """pretrain_gpt's forward step, raising on every rank in the first microbatch of `iteration`."""
    import pretrain_gpt
    from megatron.core.num_microbatches_calculator import get_num_microbatches

    calls = {"count": 0}

    def forward_step(data_iterator, model):
        calls["count"] += 1
        if calls["count"] == (iteration - 1) * get_num_microbatches() + 1:
            raise _Interrupted(f"interrupted in iteration {iteration}")
        return pretrain_gpt.forward_step(data_iterator, model)

    return forward_step


def _pretrain_returning_iteration(extra_args):
    import pretrain_gpt
    from megatron.core.enums import ModelType
    from megatron.training.training import pretrain
    from tests.unit_tests.dist_checkpointing.pretrain_helpers import tiny_gpt_argv

    return pretrain(pretrain_gpt.train_valid_test_datasets_provider, pretrain_gpt.model_provider,
                    ModelType.encoder_or_decoder, pretrain_gpt.forward_step, argv=tiny_gpt_argv(extra_args).split())


def _listing(root):
    return sorted(name for name in os.listdir(root) if not name.startswith("metrics"))


def _all_runs(workdir):
    from megatron.training.checkpointing import read_tracker

    rank = torch.distributed.get_rank()
    results = {}
    torch_root, convert_save = f"{workdir}/torch", f"{workdir}/converted"
    converted_root = f"{convert_save}/torch_dist"  # as upstream, --ckpt-convert-save DIR writes into DIR/<format>
    # 1. Straight, torch format, saved every 2 iterations, retaining multiples of 4 (and the latest).
    results["straight"] = run_pretrain(workdir, f"{SCHEDULE} --ckpt-format torch --save {torch_root} "
                                                "--save-interval 2 --save-retain-interval 4")
    results["retained"] = (_listing(torch_root), read_tracker(torch_root))
    # 2. --auto-detect-ckpt-format: resume from the torch checkpoint of iteration 4 under --ckpt-format torch_dist.
    if rank == 0:
        write_tracker(torch_root, 4)
    torch.distributed.barrier()
    results["auto_detect"] = run_pretrain(workdir, f"{SCHEDULE} --ckpt-format torch_dist --auto-detect-ckpt-format "
                                                   f"--load {torch_root} --save {workdir}/auto_saved --exit-interval 6")
    results["auto_saved"] = sorted(os.listdir(f"{workdir}/auto_saved/iter_0000006"))
    # 3. --ckpt-convert-format torch_dist: iteration 4 of the torch checkpoint, then a resume from the converted one.
    results["convert_returned"] = _pretrain_returning_iteration(
        f"{SCHEDULE} --ckpt-format torch --load {torch_root} --ckpt-convert-format torch_dist "
        f"--ckpt-convert-save {convert_save}")
    results["converted"] = (_listing(convert_save), _listing(converted_root), read_tracker(converted_root))
    results["from_converted"] = run_pretrain(workdir, f"{SCHEDULE} --load {converted_root} --exit-interval 6")
    # 4. Non-persistent checkpoints every 3 iterations, persistent ones every 5, interrupted in iteration 8.
    persistent_root = f"{workdir}/persistent"
    try:
        run_pretrain(workdir, f"{SCHEDULE} --save {persistent_root} --save-interval 5 --non-persistent-save-interval 3",
                     forward_step=_forward_step_crashing_in(CRASH_ITERATION))
        results["interrupted"] = False
    except _Interrupted:
        results["interrupted"] = True
    torch.distributed.barrier()
    results["persistent"] = (_listing(persistent_root), read_tracker(persistent_root))
    non_persistent_root = f"{persistent_root}/non_persistent"
    results["non_persistent"] = (_listing(non_persistent_root), read_tracker(non_persistent_root))
    # 5. Resume it with --use-checkpoint-args and a wrong model shape on the command line.
    results["resumed_with_checkpoint_args"] = run_pretrain(
        workdir, f"{SCHEDULE} --load {persistent_root} --use-checkpoint-args --hidden-size 64 --num-layers 2 "
                 "--ffn-hidden-size 48 --exit-interval 8")
    # 6. --ckpt-step: iteration 8 of the torch checkpoint although its tracker names 4; a step that is not there.
    results["ckpt_step"] = run_pretrain(workdir, f"{SCHEDULE} --ckpt-format torch --load {torch_root} --ckpt-step 8")
    try:
        run_pretrain(workdir, f"{SCHEDULE} --ckpt-format torch --load {torch_root} --ckpt-step 6")
        results["missing_step"] = None
    except FileNotFoundError as error:
        results["missing_step"] = str(error)
    # 7. --finetune from the torch checkpoint of 8: the report names the directory loaded; training restarts at
    # iteration 0 (stopped at 2: without --finetune, the same flags would train iterations 9 and 10).
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        results["finetuned"] = run_pretrain(workdir, f"{SCHEDULE} --ckpt-format torch --load {torch_root} "
                                                     "--ckpt-step 8 --finetune --exit-interval 2")
    results["finetune_report"] = printed.getvalue()
    # 8. --pretrained-checkpoint (the converted checkpoint of 4) where --load holds none: fine-tuned from it, saved
    # under --load; the same command launched again finds the finished run under --load and trains nothing.
    fresh, short = f"{workdir}/fresh", "--train-iters 4 --lr-decay-iters 4"
    from_pretrained = f"{SCHEDULE} {short} --load {fresh} --save {fresh} --save-interval 2 " \
                      f"--pretrained-checkpoint {converted_root}"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        results["from_pretrained"] = run_pretrain(workdir, from_pretrained)
    results["from_pretrained_saves"] = [line for line in printed.getvalue().splitlines() if "saved checkpoint" in line]
    results["finetuned_from_converted"] = run_pretrain(workdir, f"{SCHEDULE} {short} --load {converted_root} "
                                                                "--finetune")
    results["relaunched"] = (run_pretrain(workdir, f"{from_pretrained} --eval-iters 1 --eval-interval 2"),
                             _pretrain_returning_iteration(from_pretrained))
    return results


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    workdir = str(tmp_path_factory.mktemp("checkpoint_sources"))
    return run_on_ranks(WORLD_SIZE, _all_runs, workdir)[0]


def _second_part(losses, first, last=10):
    return {iteration: loss for iteration, loss in losses.items() if first <= iteration <= last}


def test_save_retain_interval_keeps_multiples_and_the_latest(runs):
    listing, tracker = runs["retained"]
    assert listing == ["iter_0000004", "iter_0000008", "iter_0000010", "latest_checkpointed_iteration.txt"]
    assert tracker == 10


def test_auto_detect_loads_a_torch_checkpoint_under_torch_dist(runs):
    straight = runs["straight"]
    assert sorted(straight) == list(range(1, 11)) and len(set(straight.values())) == 10
    assert runs["auto_detect"] == _second_part(straight, 5, 6)
    assert ".metadata" in runs["auto_saved"]  # saving still follows --ckpt-format torch_dist


def test_ckpt_convert_format_saves_the_loaded_checkpoint_and_stops(runs):
    assert runs["convert_returned"] == 4  # returned right after loading iteration 4: no training
    parent, listing, tracker = runs["converted"]  # into <--ckpt-convert-save>/torch_dist
    assert parent == ["torch_dist"]
    assert listing == ["iter_0000004", "latest_checkpointed_iteration.txt"] and tracker == 4
    assert runs["from_converted"] == _second_part(runs["straight"], 5, 6)


def test_non_persistent_checkpoint_is_resumed_when_newer(runs):
    assert runs["interrupted"]
    assert runs["persistent"] == (["iter_0000005", "latest_checkpointed_iteration.txt", "non_persistent"], 5)
    assert runs["non_persistent"] == (["iter_0000006", "latest_checkpointed_iteration.txt"], 6)
    # Resumed at 6 (non-persistent, newer than 5), with the checkpoint's model despite --hidden-size 64.
    assert runs["resumed_with_checkpoint_args"] == _second_part(runs["straight"], 7, 8)


def test_retention_never_removes_the_latest_or_runs_before_the_tracker_names_it(tmp_path):
    assert iterations_to_remove([2, 4, 6, 7], latest=7, retain_interval=4) == [2, 6]
    for iteration in (2, 4, 6):
        os.makedirs(tmp_path / f"iter_{iteration:07d}")
    os.makedirs(tmp_path / "iter_0000008.tmp")  # a save in progress
    write_tracker(tmp_path, 4)
    assert prune_to_retain_interval(str(tmp_path), 6, 4) == []  # the tracker does not name 6 yet
    write_tracker(tmp_path, 6)
    assert prune_to_retain_interval(str(tmp_path), 6, 4) == [2]
    assert sorted(os.listdir(tmp_path)) == ["iter_0000004", "iter_0000006", "iter_0000008.tmp",
                                            "latest_checkpointed_iteration.txt"]


def test_ckpt_step_loads_that_iteration_and_names_the_ones_there(runs, monkeypatch):
    assert runs["ckpt_step"] == _second_part(runs["straight"], 9)
    assert "--ckpt-step 6:" in runs["missing_step"] and "iter_0000006 is not a checkpoint" in runs["missing_step"]
    assert "the iterations under --load" in runs["missing_step"] and "[4, 8, 10]" in runs["missing_step"]
    from tests.unit_tests.training.test_arguments import validated

    with pytest.raises(ValueError, match="--ckpt-step 4 names an iteration under --load: it needs --load DIR"):
        validated("--ckpt-step 4", monkeypatch=monkeypatch)


def test_finetune_reports_the_directory_it_loaded(runs):
    assert sorted(runs["finetuned"]) == [1, 2]  # iteration 0 again
    assert "/torch/iter_0000008 (--ckpt-format torch): model, resuming at iteration 0" in runs["finetune_report"]


def test_pretrained_checkpoint_fine_tunes_until_load_has_one(runs):
    assert sorted(runs["from_pretrained"]) == [1, 2, 3, 4]
    assert runs["from_pretrained"] == runs["finetuned_from_converted"]  # as --load <it> --finetune
    # Launched again: --load has the finished run (iteration 4): nothing left to train, no crash, no fine-tuning.
    assert runs["relaunched"] == ({}, 4)


def test_each_synchronous_save_prints_upstreams_line_once(runs):
    saves = runs["from_pretrained_saves"]
    fresh = saves[0].split(" to ")[1].split(" [")[0] if saves else None
    assert fresh is not None and fresh.endswith("/fresh")
    assert saves == [f"  successfully saved checkpoint from iteration {iteration:7d} to {fresh} [ t 1/1, p 1/1 ]"
                     for iteration in (2, 4)]


def _truncate(path):
    data = open(path, "rb").read()
    with open(path, "wb") as stream:
        stream.write(data[:len(data) // 2])


@pytest.mark.parametrize("ckpt_format", ["torch", "torch_dist"])
def test_use_checkpoint_args_names_a_damaged_file_and_the_checkpoint_before_it(tmp_path, ckpt_format):
    """--use-checkpoint-args reads the saved arguments before anything else: a truncated file there must be named,
    with the --ckpt-step that resumes the earlier checkpoint, as a load would."""
    import argparse

    from megatron.core.dist_checkpointing import serialization
    from megatron.core.dist_checkpointing.errors import CheckpointError
    from megatron.training import checkpoint_sources

    for iteration in (4, 8):
        directory = tmp_path / f"iter_{iteration:07d}"
        if ckpt_format == "torch":
            os.makedirs(directory / "mp_rank_00")
            torch.save({"args": argparse.Namespace(hidden_size=32)}, directory / "mp_rank_00" / "model_optim_rng.pt")
        else:
            serialization.save({"common": {"args": argparse.Namespace(hidden_size=32)}, "w": torch.ones(2)},
                               str(directory), single_process=True)
    write_tracker(str(tmp_path), 8)
    damaged = tmp_path / "iter_0000008" / ("mp_rank_00/model_optim_rng.pt" if ckpt_format == "torch" else ".metadata")
    _truncate(damaged)
    args = argparse.Namespace(load=str(tmp_path), ckpt_step=None, non_persistent_global_ckpt_dir=None)
    with pytest.raises(CheckpointError) as error:
        checkpoint_sources.saved_args(checkpoint_sources.checkpoint_to_load(args))
    message = str(error.value)
    assert message.startswith(f"{'checkpoint file ' if ckpt_format == 'torch' else ''}{damaged} is truncated or "
                              "damaged ("), message
    assert message.endswith(f"); to resume the checkpoint before it, pass --load {tmp_path} --ckpt-step 4 (the "
                            "earlier iterations there: 4)"), message


def test_a_stale_non_persistent_tracker_points_at_the_persistent_checkpoints(tmp_path):
    """The non-persistent tracker names a directory that is gone: the error says to remove that tracker (which
    resumes the persistent checkpoint) or to pick a persistent iteration with --ckpt-step, not to pass the
    non-persistent root as --load."""
    import argparse

    from megatron.core.dist_checkpointing.errors import CheckpointError
    from megatron.training.checkpoint_sources import checkpoint_to_load

    load, non_persistent = tmp_path / "load", tmp_path / "load" / "non_persistent"
    for iteration in (5, 10):
        (load / f"iter_{iteration:07d}").mkdir(parents=True)
        (load / f"iter_{iteration:07d}" / ".metadata").write_bytes(b"")
    write_tracker(str(load), 10)
    non_persistent.mkdir()
    write_tracker(str(non_persistent), 20)
    args = argparse.Namespace(load=str(load), non_persistent_global_ckpt_dir=None, ckpt_step=None)
    with pytest.raises(CheckpointError) as raised:
        checkpoint_to_load(args)
    assert str(raised.value) == (
        f"{non_persistent}/latest_checkpointed_iteration.txt (the non-persistent checkpoints, "
        f"--non-persistent-global-ckpt-dir) names iteration 20, but {non_persistent}/iter_0000020 does not exist "
        f"(nor a .replaced copy of it); remove that tracker file to resume the persistent checkpoint under --load "
        f"{load} (iteration 10), or load an iteration of --load {load} with --ckpt-step N (N: 5, 10)")
    # Each way out the message gives works.
    assert checkpoint_to_load(argparse.Namespace(**{**vars(args), "ckpt_step": 5}))[:2] == (str(load), 5)
    os.remove(load / "latest_checkpointed_iteration.txt")
    with pytest.raises(CheckpointError, match=r"iter_0000020 does not exist \(nor a .replaced copy of it\); remove "
                                              r"that tracker file to start from scratch or from "
                                              r"--pretrained-checkpoint \(--load .* has no tracker of its own\), or "
                                              r"load an iteration of --load .* with --ckpt-step N \(N: 5, 10\)$"):
        checkpoint_to_load(args)
    write_tracker(str(load), 10)
    os.remove(non_persistent / "latest_checkpointed_iteration.txt")
    assert checkpoint_to_load(args) == (str(load), 10, "torch_dist", False)
