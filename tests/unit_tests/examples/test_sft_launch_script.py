"""examples/gpt/sft_gpt_tiny_cpu.sh with torchrun replaced by a recorder: it writes the conversations once, starts
from the README run's checkpoint when there is one, and its flags pass pretrain_gpt.py's checks."""

import json
import os
import subprocess
from pathlib import Path

from megatron.training.arguments import parse_args, validate_args
from tests.unit_tests.examples.test_gpt_launch_scripts import _recording_torchrun

REPO = Path(__file__).resolve().parents[3]
SCRIPT = REPO / "examples" / "gpt" / "sft_gpt_tiny_cpu.sh"


def _launch(tmp_path):
    env = {**os.environ, "PATH": f"{_recording_torchrun(tmp_path)}{os.pathsep}{os.environ['PATH']}",
           "CACHE_DIR": str(tmp_path / "cache"), "TORCHRUN_ARGS": str(tmp_path / "args"), "WORLD_SIZE": "2"}
    result = subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, check=True)
    recorded = (tmp_path / "args").read_text().splitlines()
    return recorded[recorded.index("pretrain_gpt.py") + 1:], result.stdout


def test_the_script_fine_tunes_the_pretrained_checkpoint_on_the_built_conversations(tmp_path, monkeypatch):
    flags, stdout = _launch(tmp_path)
    assert "--pretrained-checkpoint" not in flags and "starting from random weights" in stdout
    conversations = tmp_path / "cache" / "stdlib_qa.jsonl"
    with open(conversations) as stream:
        assert len([json.loads(line)["messages"] for line in stream]) > 5000
    pretrained = tmp_path / "cache" / "run" / "checkpoints"
    pretrained.mkdir(parents=True)
    (pretrained / "latest_checkpointed_iteration.txt").write_text("200")
    flags, stdout = _launch(tmp_path)
    assert flags[flags.index("--pretrained-checkpoint") + 1] == str(pretrained)
    monkeypatch.setenv("WORLD_SIZE", "2")
    args = validate_args(parse_args(args=flags))
    assert args.sft and args.sft_packing and args.sft_tokenizer_prompt_format == "chatml"
    assert args.data_path == [str(conversations)] and args.load == args.save
    assert args.use_megatron_fsdp and args.micro_batch_size == 1
