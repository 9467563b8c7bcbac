"""How the ranks meet: torchrun's env:// variables, or one rank on an in-process store when launched with plain
`python` (no MASTER_ADDR)."""

import os
import subprocess
import sys

import pytest

from megatron.training.initialize import _rendezvous

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

ONE_RANK = """
import torch.distributed as dist
from megatron.training.initialize import initialize_megatron
args = initialize_megatron(args="--num-layers 1 --hidden-size 16 --num-attention-heads 2 --seq-length 16 "
                                "--max-position-embeddings 16 --micro-batch-size 1 --global-batch-size 1 "
                                "--train-iters 1 --lr 1e-3 --mock-data --tokenizer-type NullTokenizer --vocab-size 64".split())
tensor = __import__("torch").ones(3)
dist.all_reduce(tensor)
print("WORLD", dist.get_world_size(), dist.get_rank(), tensor.tolist(), flush=True)
"""


def test_plain_python_runs_as_one_rank_without_torchrun_variables(tmp_path):
    env = {key: value for key, value in os.environ.items()
           if key not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    result = subprocess.run([sys.executable, "-c", ONE_RANK], cwd=tmp_path, env=dict(env, PYTHONPATH=REPO),
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    assert "WORLD 1 0 [1.0, 1.0, 1.0]" in result.stdout


def test_torchrun_variables_use_env_rendezvous(monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    assert _rendezvous(4) == {}


def test_several_ranks_without_a_launcher_are_told_to_use_torchrun(monkeypatch):
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    with pytest.raises(RuntimeError, match=r"WORLD_SIZE is 2 but MASTER_ADDR is not set: launch the ranks with "
                                           r"torchrun \(torchrun --nproc-per-node 2 pretrain_gpt.py"):
        _rendezvous(2)
