"""Checkpoints in the torch format: layout, round trip on ranks, loading what was or was not saved, and the
checkpoint flags (interrupted and failed saves: test_checkpoint_interrupted_saves.py)."""

import argparse
import os

import pytest
import torch

from megatron.training import checkpointing
from tests.unit_tests.multiprocess_harness import run_on_ranks
from tests.unit_tests.training.torch_format_checkpoints import Scheduler, checkpoint_args, trained_state


def test_directory_names_follow_megatron():
    assert checkpointing.iteration_dir_name(10) == "iter_0000010"
    assert checkpointing.model_parallel_dir_name(1, 0, 1) == "mp_rank_01"
    assert checkpointing.model_parallel_dir_name(1, 3, 4) == "mp_rank_01_003"
    assert checkpointing.checkpoint_dir("/c", 7, 0, 1, 2) == os.path.join("/c", "iter_0000007", "mp_rank_00_001")


def test_tracker_round_trip_and_missing(tmp_path):
    assert checkpointing.read_tracker(tmp_path) is None
    checkpointing.write_tracker(tmp_path, 20)
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_text() == "20"
    assert checkpointing.read_tracker(tmp_path) == 20
    assert [p.name for p in tmp_path.iterdir()] == ["latest_checkpointed_iteration.txt"]


def test_tracker_write_interrupted_before_rename_keeps_previous(tmp_path, monkeypatch):
    checkpointing.write_tracker(tmp_path, 10)

    def crash(*args):
        raise OSError("disk died")

    monkeypatch.setattr(checkpointing.os, "replace", crash)
    with pytest.raises(OSError):
        checkpointing.write_tracker(tmp_path, 20)
    assert checkpointing.read_tracker(tmp_path) == 10


def test_atomic_save_interrupted_mid_write_leaves_no_file(tmp_path, monkeypatch):
    target = tmp_path / "model_optim_rng.pt"

    def partial_save(obj, stream):
        stream.write(b"PK\x03\x04 half a checkpoint")
        raise RuntimeError("killed mid-save")

    monkeypatch.setattr(checkpointing, "_serialize", partial_save)
    with pytest.raises(RuntimeError):
        checkpointing.atomic_torch_save({"a": 1}, target)
    assert not target.exists()


def test_atomic_save_removes_the_partial_file_of_a_writer_killed_before(tmp_path):
    """A SIGKILL mid-write leaves `<file>.tmp.<pid>` in the checkpoint directory; the next save of the file removes
    it rather than keeping a partial copy of the checkpoint on disk for good."""
    target = tmp_path / "model_optim_rng.pt"
    (tmp_path / "model_optim_rng.pt.tmp.4242").write_bytes(b"PK\x03\x04 half a checkpoint")
    (tmp_path / "distrib_optim_dp_rank_001.pt.tmp.4243").write_bytes(b"another file's writer")
    checkpointing.atomic_torch_save({"a": 1}, target)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["distrib_optim_dp_rank_001.pt.tmp.4243",
                                                          "model_optim_rng.pt"]
    assert torch.load(target) == {"a": 1}


def test_torch_format_at_another_tensor_parallel_size_names_the_flags_and_the_converter(tmp_path):
    """TP 2 loaded at TP 1: rank 0's file exists and records TP 2; TP 1 loaded at TP 2 (or PP 2 at PP 1): this
    rank's file is missing and the mp_rank_* directories give the saved layout."""
    saved = argparse.Namespace(tensor_model_parallel_size=2, pipeline_model_parallel_size=1)
    run = argparse.Namespace(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    path = os.path.join("ckpt", "iter_0000004", "mp_rank_00", "model_optim_rng.pt")
    with pytest.raises(ValueError) as error:
        checkpointing._check_layout_matches(saved, run, path)
    assert str(error.value) == (
        f"{path} was saved with --tensor-model-parallel-size 2 but this run uses 1; the torch format cannot change "
        "the model-parallel layout: launch with the checkpoint's --tensor-model-parallel-size 2 "
        "--pipeline-model-parallel-size 1, or convert it to torch_dist, which loads at any layout (python "
        "tools/checkpoint/convert_legacy.py --input ckpt --output NEW_ROOT, then --load NEW_ROOT --ckpt-format "
        "torch_dist)")

    iteration = tmp_path / "iter_0000004"
    for name in ("mp_rank_00_000", "mp_rank_00_001"):
        (iteration / name).mkdir(parents=True)
    missing = str(iteration / "mp_rank_00" / "model_optim_rng.pt")
    with pytest.raises(checkpointing.CheckpointLoadError) as error:
        checkpointing._check_files_match_layout(missing, run)
    assert str(error.value).startswith(
        f"checkpoint file {missing} not found: {iteration} was saved with --tensor-model-parallel-size 1 "
        "--pipeline-model-parallel-size 2 (its mp_rank_* directories) but this run uses --tensor-model-parallel-size "
        "1 --pipeline-model-parallel-size 1; the torch format cannot change the model-parallel layout: launch with "
        f"the checkpoint's --tensor-model-parallel-size 1 --pipeline-model-parallel-size 2, or convert it")
    assert f"convert_legacy.py --input {tmp_path} --output NEW_ROOT" in str(error.value)
    at_saved_layout = argparse.Namespace(tensor_model_parallel_size=1, pipeline_model_parallel_size=2)
    checkpointing._check_files_match_layout(str(iteration / "mp_rank_00_001" / "model_optim_rng.pt"), at_saved_layout)


def test_torch_format_refuses_another_pipeline_split():
    """Each rank's file holds its stages' layers under local indices: the split must match to load."""
    layout = dict(tensor_model_parallel_size=1, pipeline_model_parallel_size=2)
    saved = argparse.Namespace(**layout, virtual_stage_layer_counts=(1, 3))
    with pytest.raises(ValueError, match=r"saved with \(1, 3\) transformer layers per virtual pipeline stage but "
                                         r"this run places \(2, 2\).*--decoder-first/last-pipeline-num-layers"):
        checkpointing._check_layout_matches(saved, argparse.Namespace(**layout, virtual_stage_layer_counts=(2, 2)),
                                            "ckpt")
    checkpointing._check_layout_matches(saved, argparse.Namespace(**layout, virtual_stage_layer_counts=(1, 3)), "ckpt")
    checkpointing._check_layout_matches(argparse.Namespace(**layout), argparse.Namespace(**layout), "ckpt")


def test_torch_format_at_another_number_of_virtual_stages_names_the_interleaving_flag():
    layout = dict(tensor_model_parallel_size=1, pipeline_model_parallel_size=2)
    interleaved = argparse.Namespace(**layout, virtual_pipeline_model_parallel_size=2,
                                     virtual_stage_layer_counts=(1, 1, 1, 1))
    plain = argparse.Namespace(**layout, virtual_pipeline_model_parallel_size=None, virtual_stage_layer_counts=(2, 2))
    with pytest.raises(ValueError, match=r"places \(2, 2\); .* pass the split flags it was saved with \(saved with "
                                         r"--num-virtual-stages-per-pipeline-rank 2, this run has 1; --decoder-first"):
        checkpointing._check_layout_matches(interleaved, plain, "ckpt")
    with pytest.raises(ValueError, match=r"\(saved without an interleaved pipeline: no --num-virtual-stages-per-"
                                         r"pipeline-rank / --num-layers-per-virtual-pipeline-stage; --decoder-first"):
        checkpointing._check_layout_matches(plain, interleaved, "ckpt")


def test_unknown_format_is_rejected_only_when_saving_or_loading():
    args = argparse.Namespace(save=None, load=None, ckpt_format="zarr")
    checkpointing.check_checkpoint_format(args)  # no --save/--load: nothing to write
    args.save = "/tmp/ckpt"
    with pytest.raises(NotImplementedError, match="--ckpt-format zarr"):
        checkpointing.check_checkpoint_format(args)
    for name in ("torch", "torch_dist", "torch_dcp", "fsdp_dtensor"):
        checkpointing.check_checkpoint_format(argparse.Namespace(save="/tmp/c", load=None, ckpt_format=name))


# ---------------------------------------------------------------------------------------------------------
# Save / load on ranks (data parallel 2, or pipeline parallel 2)
# ---------------------------------------------------------------------------------------------------------


def _finetune_and_no_load(root):
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    parallel_state.initialize_model_parallel()
    model_parallel_cuda_manual_seed(5)
    model, optimizer, scheduler = trained_state(seed=3)
    checkpointing.save_checkpoint(4, model, optimizer, scheduler, checkpoint_args(root, consumed_train_samples=32))
    results = {}
    for flags in ({"finetune": True}, {"no_load_optim": True}):
        fresh_model, fresh_optimizer, fresh_scheduler = trained_state(seed=77)
        args = checkpoint_args(root, **flags)
        iteration = checkpointing.load_checkpoint(fresh_model, fresh_optimizer, fresh_scheduler, args)
        results[next(iter(flags))] = {
            "iteration": iteration,
            "consumed": args.consumed_train_samples,
            "weights_loaded": torch.equal(fresh_model.weight, model.weight),
            "scheduler_steps": fresh_scheduler.num_steps,
            "optimizer_untouched": fresh_optimizer.state_dict()["state"][0]["step"].item() == 1.0
            and not torch.equal(fresh_optimizer.state_dict()["state"][0]["exp_avg"],
                                optimizer.state_dict()["state"][0]["exp_avg"]),
        }
    mismatched = checkpoint_args(root, pipeline_model_parallel_size=2)
    with pytest.raises(ValueError, match="--pipeline-model-parallel-size 1 but this run uses 2"):
        checkpointing.load_checkpoint(*trained_state(seed=1), mismatched)
    return results


@pytest.mark.parametrize("world_size", [1])
def test_finetune_and_no_load_optim(tmp_path, world_size):
    (results,) = run_on_ranks(world_size, _finetune_and_no_load, str(tmp_path))
    assert results["finetune"] == {
        "iteration": 0, "consumed": 0, "weights_loaded": True, "scheduler_steps": 77, "optimizer_untouched": True,
    }  # fmt: skip
    assert results["no_load_optim"] == {
        "iteration": 4, "consumed": 32, "weights_loaded": True, "scheduler_steps": 77, "optimizer_untouched": True,
    }  # fmt: skip


def _load_release(root):
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    parallel_state.initialize_model_parallel()
    model_parallel_cuda_manual_seed(5)
    model, optimizer, scheduler = trained_state(seed=3)
    checkpointing.save_checkpoint(4, model, optimizer, scheduler, checkpoint_args(root, consumed_train_samples=32))
    # Upstream's released checkpoints: the tracker says "release" and the files are in release/.
    os.rename(os.path.join(root, "iter_0000004"), os.path.join(root, "release"))
    with open(os.path.join(root, checkpointing.TRACKER_FILENAME), "w") as stream:
        stream.write("release\n")
    fresh_model, fresh_optimizer, fresh_scheduler = trained_state(seed=77)
    fresh_exp_avg = fresh_optimizer.state_dict()["state"][0]["exp_avg"].clone()
    args = checkpoint_args(root)
    iteration = checkpointing.load_checkpoint(fresh_model, fresh_optimizer, fresh_scheduler, args)
    return {
        "tracker": checkpointing.read_tracker(root),
        "iteration": iteration,
        "consumed": args.consumed_train_samples,
        "weights_loaded": torch.equal(fresh_model.weight, model.weight),
        "scheduler_steps": fresh_scheduler.num_steps,
        "optimizer_untouched": torch.equal(fresh_optimizer.state_dict()["state"][0]["exp_avg"], fresh_exp_avg),
    }


def test_release_checkpoint_loads_weights_only_from_iteration_0(tmp_path):
    (result,) = run_on_ranks(1, _load_release, str(tmp_path))
    assert result == {"tracker": "release", "iteration": 0, "consumed": 0, "weights_loaded": True,
                      "scheduler_steps": 77, "optimizer_untouched": True}


def _load_what_was_not_saved(root, saved_distributed):
    import contextlib
    import io

    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    parallel_state.initialize_model_parallel()
    model_parallel_cuda_manual_seed(5)
    model, optimizer, scheduler = trained_state(seed=3)
    save_args = checkpoint_args(root, consumed_train_samples=32, no_save_optim=True, no_save_rng=True,
                      use_distributed_optimizer=saved_distributed)
    checkpointing.save_checkpoint(4, model, optimizer, scheduler, save_args)
    fresh_model, fresh_optimizer, fresh_scheduler = trained_state(seed=77)
    fresh_exp_avg = fresh_optimizer.state_dict()["state"][0]["exp_avg"].clone()
    expected_random = torch.rand(3)
    model_parallel_cuda_manual_seed(5)
    trained_state(seed=77)
    # The default flags, as a user resuming it would launch: what the checkpoint lacks is reported, not loaded.
    args = checkpoint_args(root, use_distributed_optimizer=saved_distributed)
    with contextlib.redirect_stdout(io.StringIO()) as printed:
        iteration = checkpointing.load_checkpoint(fresh_model, fresh_optimizer, fresh_scheduler, args)
    report = printed.getvalue()
    return {
        "iteration": iteration,
        "consumed": args.consumed_train_samples,
        "weights_loaded": torch.equal(fresh_model.weight, model.weight),
        "scheduler_steps": fresh_scheduler.num_steps,
        "optimizer_untouched": torch.equal(fresh_optimizer.state_dict()["state"][0]["exp_avg"], fresh_exp_avg),
        "rng_untouched": torch.equal(torch.rand(3), expected_random),
        "report": report,
    }


@pytest.mark.parametrize("saved_distributed", [False, True])
def test_load_of_checkpoint_saved_without_optimizer_and_rng(tmp_path, saved_distributed):
    (result,) = run_on_ranks(1, _load_what_was_not_saved, str(tmp_path), saved_distributed)
    report = result.pop("report")
    assert result == {"iteration": 4, "consumed": 32, "weights_loaded": True, "scheduler_steps": 77,
                      "optimizer_untouched": True, "rng_untouched": True}
    assert "(--ckpt-format torch): model, resuming at iteration 4; not loaded: optimizer and scheduler (the " \
        "checkpoint has none: saved with --no-save-optim), RNG state (the checkpoint has none: saved with " \
        "--no-save-rng)" in report


def _load_other_optimizer_layout(root, saved_distributed):
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel()
    saved_args = checkpoint_args(root, use_distributed_optimizer=saved_distributed)
    checkpointing.save_checkpoint(4, *trained_state(seed=3), saved_args)
    with pytest.raises(checkpointing.CheckpointLoadError) as error:
        loading_args = checkpoint_args(root, use_distributed_optimizer=not saved_distributed)
        checkpointing.load_checkpoint(*trained_state(seed=77), loading_args)
    return str(error.value)


@pytest.mark.parametrize("saved_distributed", [False, True])
def test_torch_format_optimizer_saved_in_the_other_layout_names_the_flag(tmp_path, saved_distributed):
    (message,) = run_on_ranks(1, _load_other_optimizer_layout, str(tmp_path), saved_distributed)
    expected = ("launch with --use-distributed-optimizer, or with --no-load-optim" if saved_distributed else
                "launch without --use-distributed-optimizer, or with --no-load-optim")
    assert expected in message and "iter_0000004" in message


def _load_distributed_optimizer_of_another_data_parallel_size(root):
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel()
    args = checkpoint_args(root, use_distributed_optimizer=True)
    checkpointing.save_checkpoint(4, *trained_state(seed=3), args)
    shards = os.path.join(root, "iter_0000004", "mp_rank_00")
    # As a save at data-parallel size 2 leaves it: a second rank's shard next to the first.
    os.link(os.path.join(shards, "distrib_optim_dp_rank_000.pt"), os.path.join(shards, "distrib_optim_dp_rank_001.pt"))
    model, optimizer, scheduler = trained_state(seed=77)
    weights_before = model.weight.detach().clone()
    with pytest.raises(checkpointing.CheckpointLoadError) as error:
        checkpointing.load_checkpoint(model, optimizer, scheduler, args)
    return str(error.value), torch.equal(model.weight, weights_before), scheduler.num_steps


def test_torch_format_distributed_optimizer_at_another_data_parallel_size_names_the_sizes(tmp_path):
    """Each rank's shard file cuts the parameters by the saved data-parallel size: a run of another size stops
    before loading anything, on every rank alike, instead of loading a shard cut for another rank."""
    ((message, model_untouched, scheduler_steps),) = run_on_ranks(
        1, _load_distributed_optimizer_of_another_data_parallel_size, str(tmp_path))
    assert "holds 2 distrib_optim_dp_rank_*.pt files (saved at data-parallel size 2), but this run has " \
        "data-parallel size 1" in message
    assert "--no-load-optim" in message and "convert_legacy.py" in message
    assert model_untouched and scheduler_steps == 77


# ---------------------------------------------------------------------------------------------------------
# Checkpoint flags
# ---------------------------------------------------------------------------------------------------------


def _checkpoint_flags(argv):
    from megatron.training.argument_groups import checkpoint as checkpoint_flags
    from megatron.training.arguments import build_parser

    args = build_parser().parse_args(argv.split())
    checkpoint_flags.validate(args)
    return args


@pytest.mark.parametrize(
    "argv, message",
    [
        ("--async-save --ckpt-format torch --save /c", "--async-save needs --ckpt-format torch_dist"),
        ("--use-persistent-ckpt-worker --save /c", "--use-persistent-ckpt-worker needs --async-save"),
        ("--keep-last-n 0 --save /c", "--keep-last-n must be positive"),
        ("--use-megatron-fsdp --ckpt-format torch --save /c", "--use-megatron-fsdp checkpoints need --ckpt-format"),
        ("--use-torch-fsdp2 --ckpt-format torch --load /c", "--use-torch-fsdp2 checkpoints need --ckpt-format"),
        ("--save /c --non-persistent-save-interval 2 --non-persistent-global-ckpt-dir /c",
         "^--non-persistent-global-ckpt-dir /c is --save: only the latest non-persistent checkpoint is kept there, so "
         "each non-persistent save would delete the persistent checkpoints of --save; give it a directory of its own"),
        ("--save /c --load /d --non-persistent-save-interval 2 --non-persistent-global-ckpt-dir /d/",
         "^--non-persistent-global-ckpt-dir /d/ is --load: .* persistent checkpoints of --load; give it a directory"),
    ],
)
def test_checkpoint_flag_rules_name_the_flags(argv, message):
    with pytest.raises(ValueError, match=message):
        _checkpoint_flags(argv)


def test_checkpoint_flags_accept_every_logical_format_and_strictness():
    from megatron.core.dist_checkpointing import STRICTNESS_CHOICES

    for name in ("torch_dist", "torch_dcp", "fsdp_dtensor"):
        args = _checkpoint_flags(f"--ckpt-format {name} --async-save --use-persistent-ckpt-worker --keep-last-n 2 "
                                 "--save /c")
        assert (args.async_save, args.use_persistent_ckpt_worker, args.keep_last_n) == (True, True, 2)
    assert _checkpoint_flags("").dist_ckpt_strictness == "assume_ok_unexpected"
    for mode in STRICTNESS_CHOICES:
        assert _checkpoint_flags(f"--dist-ckpt-strictness {mode}").dist_ckpt_strictness == mode


# What `--help` says each data-parallel wrapper takes, as enforced by validate_args.
FORMATS = ("torch", "torch_dist", "torch_dcp", "fsdp_dtensor")
WRAPPER_FORMATS = {
    "DDP, with or without --use-distributed-optimizer": {
        "": FORMATS, "--use-distributed-optimizer": FORMATS},
    "--use-megatron-fsdp": {"--use-megatron-fsdp": ("torch_dist", "torch_dcp", "fsdp_dtensor")},
    "--use-torch-fsdp2": {"--use-torch-fsdp2 --untie-embeddings-and-output-weights": ("torch_dist", "torch_dcp")},
}
SMALL_MODEL = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --micro-batch-size 2 "
               "--train-iters 10 --lr 1e-3 --mock-data --vocab-size 128")


def _validates(argv):
    from megatron.training.arguments import parse_args, validate_args

    try:
        validate_args(parse_args(args=f"{SMALL_MODEL} {argv}".split()))
    except ValueError:
        return False
    return True


def test_ckpt_format_help_states_the_formats_each_wrapper_takes(monkeypatch):
    from megatron.training.arguments import build_parser

    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    action = next(action for action in build_parser()._actions if "--ckpt-format" in action.option_strings)
    text = " ".join(action.help.split())
    for wrapper, cases in WRAPPER_FORMATS.items():
        accepted = next(iter(cases.values()))
        assert f"{wrapper}: {', '.join(accepted)}" in text, (wrapper, text)
        for flags, formats in cases.items():
            for name in FORMATS:
                assert _validates(f"{flags} --ckpt-format {name} --save /c") == (name in formats), (flags, name)
    assert "(torch is rejected when --save or --load is given)" in text
    assert _validates("--use-megatron-fsdp --ckpt-format torch")  # no checkpoint at all: accepted
    assert "(anything else is rejected, with or without --save/--load)" in text
    assert not _validates("--use-torch-fsdp2 --untie-embeddings-and-output-weights --ckpt-format fsdp_dtensor")
    assert "--async-save and --keep-last-n need torch_dist, torch_dcp or fsdp_dtensor" in text
    for name in FORMATS:
        assert _validates(f"--ckpt-format {name} --save /c --async-save") == (name != "torch")
        assert _validates(f"--ckpt-format {name} --save /c --keep-last-n 2") == (name != "torch")


def test_load_of_an_iteration_directory_says_how_to_resume_it(tmp_path, capsys):
    checkpointing.write_tracker(tmp_path, 2)
    iteration_dir = tmp_path / checkpointing.iteration_dir_name(2)
    iteration_dir.mkdir()
    args = argparse.Namespace(load=str(iteration_dir), ckpt_step=None, pretrained_checkpoint=None,
                              exit_on_missing_checkpoint=False)
    assert checkpointing._checkpoint_or_none(args) is None
    printed = capsys.readouterr().out
    assert (f"it looks like one iteration's directory: to resume it, pass its parent and the iteration, --load "
            f"{tmp_path} --ckpt-step 2; nothing was loaded") in printed
    args.exit_on_missing_checkpoint = True
    with pytest.raises(FileNotFoundError, match=f"--load {tmp_path} --ckpt-step 2 and --exit-on-missing"):
        checkpointing._checkpoint_or_none(args)


def test_load_without_tracker_names_the_iterations_there_and_ckpt_step(tmp_path, capsys):
    from megatron.training import checkpoint_sources

    for name in ("iter_0000004/mp_rank_00", "iter_0000008/mp_rank_00", "iter_0000012", "iter_0000016.tmp/mp_rank_00"):
        (tmp_path / name).mkdir(parents=True)
    args = argparse.Namespace(load=str(tmp_path), ckpt_step=None, pretrained_checkpoint=None,
                              non_persistent_global_ckpt_dir=None, exit_on_missing_checkpoint=False)
    assert checkpointing._checkpoint_or_none(args) is None
    assert (f"WARNING: --load {tmp_path}: no latest_checkpointed_iteration.txt in it (no complete checkpoint); it "
            "holds the checkpoints of iterations 4, 8: to resume one, pass --ckpt-step N, or write its iteration "
            f"into {tmp_path}/latest_checkpointed_iteration.txt; nothing was loaded") in capsys.readouterr().out
    # Only the directories that hold a checkpoint are named (iteration 12's is empty).
    args.ckpt_step = 12
    with pytest.raises(FileNotFoundError) as error:
        checkpoint_sources.checkpoint_to_load(args)
    assert str(error.value) == (f"--ckpt-step 12: {tmp_path}/iter_0000012 is not a checkpoint; the iterations under "
                                f"--load {tmp_path} are [4, 8]")


def test_torch_format_refuses_other_vocabulary_rows_naming_what_keeps_them():
    """A torch-format file holds its TP partition of the padded vocabulary: another row count (here a TP 2
    checkpoint written with --use-checkpoint-args from TP 1, 128 rows, loaded by a TP 2 run padding to 256) is
    refused before any tensor is read, naming both counts and the flags that give the saved rows."""
    import argparse

    from megatron.training.checkpointing import _check_layout_matches

    layout = dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=1)
    saved = argparse.Namespace(**layout, padded_vocab_size=128)
    run = argparse.Namespace(**layout, padded_vocab_size=256, make_vocab_size_divisible_by=128,
                             tokenizer_type="NullTokenizer", vocab_size=120)
    with pytest.raises(ValueError) as error:
        _check_layout_matches(saved, run, "ckpt/mp_rank_00/model_optim_rng.pt")
    assert str(error.value) == (
        "ckpt/mp_rank_00/model_optim_rng.pt holds 128 rows of the word embedding and output layer (its padded "
        "vocabulary) but this run builds 256 (--make-vocab-size-divisible-by 128 x TP 2); the torch format cannot "
        "change the vocabulary padding: launch with --use-checkpoint-args, which keeps the checkpoint's 128 rows, or "
        "--make-vocab-size-divisible-by 4, which pads this run's 121 tokens to 128 rows at TP 2, or convert it to "
        "torch_dist (tools/checkpoint/convert_legacy.py), which loads at another padding")
    run.padded_vocab_size = 128
    _check_layout_matches(saved, run, "ckpt/mp_rank_00/model_optim_rng.pt")


def test_release_tracker_is_older_than_any_non_persistent_checkpoint(tmp_path):
    from megatron.training import checkpoint_sources

    (tmp_path / "release").mkdir()
    (tmp_path / checkpointing.TRACKER_FILENAME).write_text("release")
    args = argparse.Namespace(load=str(tmp_path), ckpt_step=None, non_persistent_global_ckpt_dir=None)
    source = checkpoint_sources.checkpoint_to_load(args)
    assert (source.iteration, source.directory, source.non_persistent) == ("release", str(tmp_path / "release"), False)
    (tmp_path / "non_persistent" / "iter_0000003").mkdir(parents=True)
    checkpointing.write_tracker(tmp_path / "non_persistent", 3)
    source = checkpoint_sources.checkpoint_to_load(args)
    assert (source.iteration, source.non_persistent) == (3, True)


def _load_one_directory_save_another(root):
    from tests.unit_tests.dist_checkpointing.pretrain_helpers import run_pretrain

    first, second = f"{root}/first", f"{root}/second"
    run_pretrain(f"{root}/run0", f"--train-iters 4 --save {first} --save-interval 4 --ckpt-format torch")
    # Nothing is left to train (--train-iters 4 again): the loaded iteration still goes into the other --save.
    flags = "--train-iters 4 --save-interval 4 --ckpt-format torch"
    run_pretrain(f"{root}/run1", f"{flags} --load {first} --save {second}")
    # Loaded from --save itself: it is on disk already and is not written again.
    before = os.stat(os.path.join(second, "iter_0000004")).st_mtime_ns
    run_pretrain(f"{root}/run2", f"{flags} --load {second} --save {second}")
    return (checkpointing.read_tracker(second), os.stat(os.path.join(second, "iter_0000004")).st_mtime_ns == before)


def test_checkpoint_loaded_from_another_directory_is_saved_into_save_at_the_end(tmp_path):
    (result,) = run_on_ranks(1, _load_one_directory_save_another, str(tmp_path))
    assert result == (4, True)


class _LinearWithGatherInFlight(torch.nn.Linear):
    """A chunk whose post-step parameter gather has not landed yet: its weight holds the values before the step
    until `finish_param_sync`, as under --overlap-param-gather."""

    def start_gather(self, updated_weight):
        self.updated_weight = updated_weight

    def finish_param_sync(self):
        updated, self.updated_weight = getattr(self, "updated_weight", None), None
        if updated is not None:
            with torch.no_grad():
                self.weight.copy_(updated)


def _save_with_a_gather_in_flight(root, ckpt_format):
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    parallel_state.initialize_model_parallel()
    model_parallel_cuda_manual_seed(5)
    torch.manual_seed(0)
    model = _LinearWithGatherInFlight(4, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    updated = model.weight.detach() + 1.0
    model.start_gather(updated)
    weights_only = dict(ckpt_format=ckpt_format, no_save_optim=True, no_load_optim=True)
    checkpointing.save_checkpoint(2, model, optimizer, Scheduler(), checkpoint_args(root, **weights_only))
    fresh = _LinearWithGatherInFlight(4, 3)
    checkpointing.load_checkpoint(fresh, torch.optim.SGD(fresh.parameters(), lr=0.1), Scheduler(),
                                  checkpoint_args(root, **weights_only))
    return torch.equal(fresh.weight, updated)


@pytest.mark.parametrize("ckpt_format", ["torch", "torch_dist"])
def test_a_save_waits_for_the_parameter_gather_in_flight(tmp_path, ckpt_format):
    assert run_on_ranks(1, _save_with_a_gather_in_flight, str(tmp_path), ckpt_format) == [True]


def _save_random_init_at_one_rank(root):
    from megatron.core import parallel_state
    from megatron.training.initialize import set_random_seed

    parallel_state.initialize_model_parallel()
    set_random_seed(1234, data_parallel_random_init=True)
    model, optimizer, scheduler = trained_state(seed=3)
    checkpointing.save_checkpoint(4, model, optimizer, scheduler, checkpoint_args(root, data_parallel_random_init=True))
    return torch.get_rng_state()


def _load_random_init_at_two_ranks(root):
    import contextlib
    import io

    from megatron.core import parallel_state
    from megatron.training.initialize import set_random_seed

    parallel_state.initialize_model_parallel()
    set_random_seed(1234, data_parallel_random_init=True)
    model, optimizer, scheduler = trained_state(seed=77)
    seeded = torch.get_rng_state()
    with contextlib.redirect_stdout(io.StringIO()) as printed:
        checkpointing.load_checkpoint(model, optimizer, scheduler,
                                      checkpoint_args(root, data_parallel_random_init=True))
    return torch.get_rng_state(), seeded, printed.getvalue()


def test_ranks_beyond_the_saved_data_parallel_size_keep_their_seeded_streams(tmp_path):
    """torch format, --data-parallel-random-init, saved at DP1 and resumed at DP2: rank 0 takes the saved RNG state;
    rank 1 keeps its own seeded one (rank 0's would repeat its dropout masks) and the load report says so."""
    (saved,) = run_on_ranks(1, _save_random_init_at_one_rank, str(tmp_path))
    (rank0, _, report), (rank1, seeded1, _) = run_on_ranks(2, _load_random_init_at_two_ranks, str(tmp_path))
    assert torch.equal(rank0, saved) and torch.equal(rank1, seeded1) and not torch.equal(rank1, saved)
    assert "RNG state of data-parallel ranks 1 and above (saved at data-parallel size 1; under " \
        "--data-parallel-random-init they keep their own seeded streams)" in report


def _load_in_the_other_format(root):
    """Errors of loading a torch_dist checkpoint with --ckpt-format torch, and a torch one with torch_dist."""
    from megatron.core import parallel_state
    from megatron.core.dist_checkpointing import serialization

    parallel_state.initialize_model_parallel()
    torch_dist_root, torch_root = os.path.join(root, "torch_dist"), os.path.join(root, "torch")
    serialization.save({"w": torch.ones(2)}, os.path.join(torch_dist_root, "iter_0000004"))
    checkpointing.write_tracker(torch_dist_root, 4)
    model, optimizer, scheduler = trained_state(seed=3)
    checkpointing.save_checkpoint(4, model, optimizer, scheduler, checkpoint_args(torch_root))
    errors = []
    for directory, ckpt_format in ((torch_dist_root, "torch"), (torch_root, "torch_dist")):
        with pytest.raises(Exception) as error:
            checkpointing.load_checkpoint(model, optimizer, scheduler, checkpoint_args(directory,
                                                                                       ckpt_format=ckpt_format))
        errors.append(str(error.value))
    parallel_state.destroy_model_parallel()
    return errors


def test_a_checkpoint_of_the_other_format_names_the_flag_that_loads_it(tmp_path):
    (errors,) = run_on_ranks(1, _load_in_the_other_format, str(tmp_path))
    assert errors == [
        f"{tmp_path}/torch_dist/iter_0000004 is a torch_dist checkpoint; load it with --ckpt-format torch_dist, or "
        "pass --auto-detect-ckpt-format (which loads either format and saves in --ckpt-format)",
        f"{tmp_path}/torch/iter_0000004 is a --ckpt-format torch checkpoint; load it with --ckpt-format torch, or "
        "pass --auto-detect-ckpt-format (which loads either format and saves in --ckpt-format), or convert it with "
        "tools/checkpoint/convert_legacy.py"]
