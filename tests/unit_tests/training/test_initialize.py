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
from megatron.training import get_timers
get_timers()("probe", log_level=0).start()  # upstream scripts time their own phases after initialize_megatron()
print("TIMERS", type(get_timers()).__name__, flush=True)
"""


def test_plain_python_runs_as_one_rank_without_torchrun_variables(tmp_path):
    env = {key: value for key, value in os.environ.items()
           if key not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    result = subprocess.run([sys.executable, "-c", ONE_RANK], cwd=tmp_path, env=dict(env, PYTHONPATH=REPO),
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    assert "WORLD 1 0 [1.0, 1.0, 1.0]" in result.stdout
    assert "TIMERS Timers" in result.stdout


def test_torchrun_variables_use_env_rendezvous(monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    assert _rendezvous(4) == {}


def test_several_ranks_without_a_launcher_are_told_to_use_torchrun(monkeypatch):
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    with pytest.raises(RuntimeError, match=r"WORLD_SIZE is 2 but MASTER_ADDR is not set: launch the ranks with "
                                           r"torchrun \(torchrun --nproc-per-node 2 pretrain_gpt.py"):
        _rendezvous(2)


def _store_of_attempt(monkeypatch, agent_store, attempt):
    """The store rank 0 of torchrun attempt `attempt` meets on (env:// reads MASTER_ADDR/PORT itself)."""
    from datetime import timedelta

    import torch.distributed as dist

    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", str(attempt))
    kwargs = _rendezvous(2, timedelta(seconds=5))
    if "store" in kwargs:
        return kwargs["store"]
    return dist.TCPStore("127.0.0.1", agent_store.port, 2, is_master=False, timeout=timedelta(seconds=5))


def test_a_restarted_attempt_does_not_read_the_keys_of_the_attempt_before(monkeypatch):
    """torchrun --max-restarts: the agent's store outlives the killed ranks; their addresses must not be read."""
    from datetime import timedelta

    import torch.distributed as dist

    agent_store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                timeout=timedelta(seconds=5))
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(agent_store.port))
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    first = _store_of_attempt(monkeypatch, agent_store, 0)
    first.set("rank_1_address", "127.0.0.1:41000")  # written by a rank that was then killed
    restarted = _store_of_attempt(monkeypatch, agent_store, 1)
    assert not restarted.check(["rank_1_address"])
    restarted.set("rank_1_address", "127.0.0.1:42000")
    assert restarted.get("rank_1_address") == b"127.0.0.1:42000"
    assert first.get("rank_1_address") == b"127.0.0.1:41000"
    assert _store_of_attempt(monkeypatch, agent_store, 2).check(["rank_1_address"]) is False
