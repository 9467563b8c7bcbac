"""Bad input gets an error naming the tensor or file, and loading never writes into the checkpoint."""

import contextlib
import hashlib
import io
import os
import shutil

import pytest
import torch

from tests.unit_tests.dist_checkpointing.pretrain_helpers import TrainingState
from tests.unit_tests.multiprocess_harness import run_on_ranks


def _error_of(fn):
    try:
        fn()
    except Exception as exc:  # noqa: B902 - the test inspects whatever was raised
        return f"{type(exc).__name__}: {exc}"
    return None


def _load_into(extra_args, root, ckpt_format="torch_dist"):
    from megatron.training import checkpointing

    state = TrainingState(f"--ckpt-format {ckpt_format} --load {root} {extra_args}")
    try:
        output = io.StringIO()
        with contextlib.redirect_stdout(output):
            error = _error_of(lambda: checkpointing.load_checkpoint(state.model, state.optimizer, state.scheduler,
                                                                    state.args))
        return error, output.getvalue(), state.args.consumed_train_samples
    finally:
        state.close()


def _snapshot(root):
    """{path: sha256 of its contents} of every file under `root`."""
    def digest(path):
        with open(path, "rb") as stream:
            return hashlib.sha256(stream.read()).hexdigest()

    return {os.path.join(d, f): digest(os.path.join(d, f)) for d, _, fs in os.walk(root) for f in fs}


def _bad_inputs(workdir):
    from megatron.training import checkpointing

    rank = torch.distributed.get_rank()
    root = os.path.join(workdir, "good")
    state = TrainingState(f"--use-distributed-optimizer --ckpt-format torch_dist --save {root}")
    state.train_steps(2)
    checkpointing.save_checkpoint(3, state.model, state.optimizer, state.scheduler, state.args)
    state.close()
    before = _snapshot(root)
    results = {}
    results["hidden"] = _load_into("--hidden-size 48", root)[0]
    results["more_layers"] = _load_into("--num-layers 6", root)[0]
    results["fewer_layers_default"] = _load_into("--num-layers 2", root)[0]
    results["fewer_layers_raise_all"] = _load_into("--num-layers 2 --dist-ckpt-strictness raise_all", root)[0]
    error, printed, _ = _load_into("--num-layers 6 --dist-ckpt-strictness log_all", root)
    results["more_layers_log_all"] = (error, "decoder.layers.5" in printed)
    # Another model with the same tensor shapes: refused before anything is read, also under --finetune.
    results["heads"] = _load_into("--num-attention-heads 8", root)[0]
    results["heads_finetune"] = _load_into("--num-attention-heads 8 --finetune", root)[0]
    results["layernorm_1p_rmsnorm"] = _load_into("--apply-layernorm-1p --normalization RMSNorm", root)[0]
    results["qkv_bias_post_layernorm"] = _load_into("--add-qkv-bias --apply-residual-connection-post-layernorm",
                                                    root)[0]
    results["vocab"] = _load_into("--vocab-size 100", root)[0]  # still 128 rows after padding
    results["unchanged"] = _snapshot(root) == before
    # Another expert count changes the router's and the experts' shapes: the error names the flag, not a tensor.
    moe_root = os.path.join(workdir, "moe")
    state = TrainingState(f"--num-experts 4 --ckpt-format torch_dist --save {moe_root}")
    checkpointing.save_checkpoint(1, state.model, state.optimizer, state.scheduler, state.args)
    state.close()
    results["experts"] = _load_into("--num-experts 2", moe_root)[0]

    # Partial loads say what they skipped; without optimizer state the main weights follow the loaded model.
    state = TrainingState(f"--use-distributed-optimizer --ckpt-format torch_dist --load {root} --no-load-optim")
    output = io.StringIO()
    with contextlib.redirect_stdout(output):
        iteration = checkpointing.load_checkpoint(state.model, state.optimizer, state.scheduler, state.args)
    main_follows_model = all(
        torch.equal(shard.main_param, shard.model_param.detach().reshape(-1)[shard.param_start:shard.param_end])
        for shard in state.optimizer._shards)
    results["no_load_optim"] = (iteration, output.getvalue() if rank == 0 else None, main_follows_model,
                                len(state.optimizer.optimizer.state))
    state.close()
    error, printed, consumed = _load_into("--finetune", root)
    results["finetune"] = (error, printed if rank == 0 else None, consumed)

    # Damaged copies: truncated index, missing shard file, truncated shard file.
    damaged = {}
    for kind in ("metadata", "shard", "truncated_shard"):
        copy = os.path.join(workdir, kind)
        if rank == 0:
            shutil.copytree(root, copy)
            iteration_dir = os.path.join(copy, "iter_0000003")
            shutil.copytree(iteration_dir, os.path.join(copy, "iter_0000001"))  # an earlier one, intact
            if kind == "metadata":
                path = os.path.join(iteration_dir, ".metadata")
                with open(path, "r+b") as stream:
                    stream.truncate(os.path.getsize(path) // 2)
            elif kind == "shard":
                os.remove(os.path.join(iteration_dir, "__1_0.distcp"))
            else:
                path = os.path.join(iteration_dir, "__1_0.distcp")
                with open(path, "r+b") as stream:
                    stream.truncate(os.path.getsize(path) * 2 // 3)
        torch.distributed.barrier()
        damaged[kind] = _load_into("--use-distributed-optimizer", copy)[0]
    results.update(damaged)

    # --load of a directory that does not exist: says so, loads nothing, starts from scratch.
    error, printed, consumed = _load_into("", os.path.join(workdir, "does_not_exist"))
    results["missing_dir"] = (error, printed if rank == 0 else None, consumed)
    error, printed, consumed = _load_into("", os.path.join(workdir, "does_not_exist"), ckpt_format="torch")
    results["missing_dir_torch"] = (error, printed if rank == 0 else None)

    # Legacy torch format: a truncated model_optim_rng.pt names the file.
    legacy = os.path.join(workdir, "legacy")
    state = TrainingState(f"--ckpt-format torch --save {legacy}")
    checkpointing.save_checkpoint(2, state.model, state.optimizer, state.scheduler, state.args)
    state.close()
    legacy_before = _snapshot(legacy)
    results["heads_torch"] = _load_into("--num-attention-heads 8", legacy, ckpt_format="torch")[0]
    results["legacy_unchanged"] = _snapshot(legacy) == legacy_before
    model_file = os.path.join(legacy, "iter_0000002", "mp_rank_00", "model_optim_rng.pt")
    torch.distributed.barrier()  # every rank has finished reading the intact file (a refused load syncs nothing)
    if rank == 0:
        with open(model_file, "r+b") as stream:
            stream.truncate(os.path.getsize(model_file) // 3)
    torch.distributed.barrier()
    results["truncated_torch"] = _load_into("", legacy, ckpt_format="torch")[0]
    results["wrong_format"] = _load_into("", root, ckpt_format="torch")[0]
    results["model_file"] = model_file
    return results


@pytest.mark.parametrize("world_size", [2])
def test_bad_inputs_get_errors_naming_tensor_or_file(tmp_path, world_size):
    results = run_on_ranks(world_size, _bad_inputs, str(tmp_path))
    first = results[0]
    # Another width is reported by its flags (the swiglu width and the head size follow --hidden-size), before
    # any tensor's shape is compared.
    assert first["hidden"].startswith("CheckpointError: checkpoint ")
    assert ("holds another model than this run builds: --hidden-size: 32 in the checkpoint, 48 in this run; "
            "--kv-channels: 8 in the checkpoint, 12 in this run; --ffn-hidden-size: 64 in the checkpoint, 128 in "
            "this run.") in first["hidden"]
    assert "launch with the checkpoint's --hidden-size 32, --kv-channels 8, --ffn-hidden-size 64" in first["hidden"]
    for result in results:
        assert result["experts"].startswith("CheckpointError: checkpoint "), result["experts"]
        assert ("holds another model than this run builds: --num-experts: 4 in the checkpoint, 2 in this run."
                in result["experts"])
        assert "launch with the checkpoint's --num-experts 4" in result["experts"]
        assert "has shape" not in result["experts"]
    assert "not in the checkpoint" in first["more_layers"] and "decoder.layers.4" in first["more_layers"]
    assert first["fewer_layers_default"] is None  # unexpected keys are fine by default (assume_ok_unexpected)
    assert "not in the model" in first["fewer_layers_raise_all"] and "decoder.layers.2" in first[
        "fewer_layers_raise_all"]
    assert first["more_layers_log_all"] == (None, True)
    for case in ("heads", "heads_finetune", "heads_torch"):  # linear_qkv is (96, 32) either way
        for result in results:
            assert result[case] is not None and result[case].startswith("CheckpointError: checkpoint "), case
            assert ("holds another model than this run builds: --num-attention-heads: 4 in the checkpoint, 8 in "
                    "this run; --kv-channels: 8 in the checkpoint, 4 in this run.") in result[case], case
            assert "launch with the checkpoint's --num-attention-heads 4, --kv-channels 8" in result[case], case
    assert "iter_0000002/mp_rank_00/model_optim_rng.pt holds another model" in first["heads_torch"]
    assert ("--normalization: LayerNorm in the checkpoint, RMSNorm in this run; --apply-layernorm-1p: not set in "
            "the checkpoint, set in this run") in first["layernorm_1p_rmsnorm"]
    assert "--normalization LayerNorm, no --apply-layernorm-1p" in first["layernorm_1p_rmsnorm"]
    assert ("--add-qkv-bias: not set in the checkpoint, set in this run; --apply-residual-connection-post-layernorm: "
            "not set in the checkpoint, set in this run") in first["qkv_bias_post_layernorm"]
    # NullTokenizer --vocab-size N: N text ids and the eod
    assert ("vocabulary size (the tokenizer's, before padding; --vocab-size + 1 with NullTokenizer): "
            f"{120 + 1} in the checkpoint, {100 + 1} in this run") in first["vocab"]
    assert ("launch with the checkpoint's --tokenizer-type NullTokenizer --vocab-size 120 (121 tokens with the "
            "end-of-document id)") in first["vocab"]
    assert first["unchanged"] and first["legacy_unchanged"]
    assert ".metadata is truncated or damaged" in first["metadata"]
    for kind in ("metadata", "shard", "truncated_shard"):
        assert (f"to resume the checkpoint before it, pass --load {tmp_path / kind} --ckpt-step 1 (the earlier "
                "iterations there: 1)") in first[kind], first[kind]
    assert all("__1_0.distcp" in result["shard"] and "missing or damaged" in result["shard"] for result in results)
    for result in results:  # every rank names the file, whichever rank's read failed
        assert "missing or damaged: " in result["truncated_shard"]
        assert "iter_0000003/__1_0.distcp is truncated (" in result["truncated_shard"], result["truncated_shard"]
    iteration, printed, main_follows_model, optimizer_states = first["no_load_optim"]
    assert (iteration, main_follows_model, optimizer_states) == (3, True, 0)
    assert "not loaded: optimizer and scheduler (--no-load-optim)" in printed
    error, printed, consumed = first["finetune"]
    assert error is None and consumed == 0
    assert "not loaded: optimizer and scheduler (--finetune); RNG state (--finetune)" in printed
    assert "iteration and consumed samples (--finetune starts at 0)" in printed
    assert results[0]["missing_dir"][0] is None and results[0]["missing_dir"][2] == 0
    assert "does_not_exist: the directory does not exist; nothing was loaded" in results[0]["missing_dir"][1]
    assert "nothing was loaded" in results[0]["missing_dir_torch"][1]
    assert first["model_file"] in first["truncated_torch"] and "truncated or damaged" in first["truncated_torch"]
    assert (f"there is no earlier checkpoint under {tmp_path / 'legacy'}: train from scratch or --load another "
            "checkpoint") in first["truncated_torch"]
    assert "is a torch_dist checkpoint; load it with --ckpt-format torch_dist" in first["wrong_format"]
