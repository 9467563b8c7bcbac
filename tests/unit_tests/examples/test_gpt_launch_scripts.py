"""The launch scripts of examples/gpt/, with torchrun replaced by a program that records the flags and the
environment it is given: the tiny CPU script launched again resumes the same command from its checkpoints and
trains another command afresh; the multi-node template's flags pass pretrain_gpt.py's checks under the wrappers
it names."""

import os
import stat
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
SCRIPT = REPO / "examples" / "gpt" / "train_gpt_tiny_cpu.sh"
MULTINODE_SCRIPT = REPO / "examples" / "gpt" / "train_gpt_multinode.sh"


def _recording_torchrun(tmp_path):
    """A torchrun that writes CUDA_DEVICE_MAX_CONNECTIONS (or `unset`) and then its arguments, one a line."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    recorder = bin_dir / "torchrun"
    recorder.write_text('#!/usr/bin/env bash\n'
                        'printf "%s\\n" "${CUDA_DEVICE_MAX_CONNECTIONS-unset}" "$@" > "$TORCHRUN_ARGS"\n')
    recorder.chmod(recorder.stat().st_mode | stat.S_IEXEC)
    return bin_dir


def _launch(tmp_path, extra_env=None, args=()):
    """Runs the script with a recording torchrun; returns (the flags torchrun got, the script's stdout)."""
    bin_dir = _recording_torchrun(tmp_path)
    cache = tmp_path / "cache"
    cache.mkdir(exist_ok=True)
    (cache / "stdlib_docs_text_document.idx").touch()  # the corpus counts as tokenized: no preprocessing
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "CACHE_DIR": str(cache),
           "OUTPUT_DIR": str(tmp_path / "out"), "TRAIN_ITERS": "20", "TORCHRUN_ARGS": str(tmp_path / "args"),
           **(extra_env or {})}
    result = subprocess.run(["bash", str(SCRIPT), *args], env=env, capture_output=True, text=True, check=True)
    return (tmp_path / "args").read_text().splitlines()[1:], result.stdout


def _save_checkpoint(tmp_path, iteration):
    checkpoints = tmp_path / "out" / "checkpoints"
    checkpoints.mkdir(parents=True, exist_ok=True)
    (checkpoints / "latest_checkpointed_iteration.txt").write_text(str(iteration))
    (tmp_path / "out" / "metrics.jsonl").write_text('{"iteration": 1}\n')


def _load_flag(flags):
    return flags[flags.index("--load") + 1] if "--load" in flags else None


def test_same_command_resumes_from_its_checkpoints(tmp_path):
    flags, _ = _launch(tmp_path)
    assert _load_flag(flags) is None
    assert flags[flags.index("--save") + 1] == str(tmp_path / "out" / "checkpoints")

    _save_checkpoint(tmp_path, 10)
    flags, stdout = _launch(tmp_path)
    assert _load_flag(flags) == str(tmp_path / "out" / "checkpoints")
    assert "resuming" in stdout
    # The resumed run appends to the metrics of the iterations it continues.
    assert (tmp_path / "out" / "metrics.jsonl").read_text() == '{"iteration": 1}\n'


def test_another_command_trains_afresh(tmp_path):
    _launch(tmp_path)
    _save_checkpoint(tmp_path, 10)
    for env, args in (({"DP_WRAPPER": "ddp"}, ()), ({}, ("--num-experts", "4")), ({"TRAIN_ITERS": "30"}, ())):
        flags, stdout = _launch(tmp_path, env, args)
        assert _load_flag(flags) is None, (env, args)
        assert "another command" in stdout
        assert not (tmp_path / "out" / "metrics.jsonl").exists()
        assert not (tmp_path / "out" / "checkpoints" / "latest_checkpointed_iteration.txt").exists()
        _save_checkpoint(tmp_path, 10)
    # The last command launched again resumes.
    flags, _ = _launch(tmp_path, {"TRAIN_ITERS": "30"})
    assert _load_flag(flags) == str(tmp_path / "out" / "checkpoints")


def test_multinode_template_flags_pass_the_checks_under_megatron_fsdp(tmp_path, monkeypatch):
    from megatron.training.argument_groups import data_parallel
    from megatron.training.arguments import parse_args, validate_args

    env = {key: value for key, value in os.environ.items()
           if not key.startswith("SLURM_") and key not in ("CUDA_DEVICE_MAX_CONNECTIONS", "NNODES", "MASTER_ADDR")}
    env.update(PATH=f"{_recording_torchrun(tmp_path)}{os.pathsep}{os.environ['PATH']}",
               TORCHRUN_ARGS=str(tmp_path / "args"), CHECKPOINT_DIR=str(tmp_path / "checkpoints"),
               TENSORBOARD_DIR=str(tmp_path / "tensorboard"), GPUS_PER_NODE="8")
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setattr(data_parallel, "_cuda_visible", lambda: True)  # the template's GPU machine
    for wrapper_args in (["--use-megatron-fsdp"], []):
        subprocess.run(["bash", str(MULTINODE_SCRIPT), *wrapper_args], env=env, check=True)
        recorded = (tmp_path / "args").read_text().splitlines()
        connections, flags = recorded[0], recorded[recorded.index("pretrain_gpt.py") + 1:]
        if connections == "unset":
            monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
        else:
            monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", connections)
        args = validate_args(parse_args(args=flags))
        assert args.use_megatron_fsdp == bool(wrapper_args)
        # Tensor parallelism without Megatron-FSDP keeps its one ordered connection.
        assert connections == ("unset" if wrapper_args else "1")
        assert args.load == args.save == str(tmp_path / "checkpoints")
