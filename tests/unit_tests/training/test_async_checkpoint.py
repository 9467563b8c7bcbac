"""`--async-save` across runs: a process that calls pretrain() twice (each creating and destroying the default
process group) saves in the background in both; the second run's writes must not use the first run's group."""

import os
import socket
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

TWO_RUNS = """
import sys
import pretrain_gpt
from megatron.core.enums import ModelType
from megatron.training.checkpointing import read_tracker
from megatron.training.training import pretrain
from tests.unit_tests.dist_checkpointing.pretrain_helpers import tiny_gpt_argv

for root in sys.argv[1:]:
    argv = tiny_gpt_argv(f"--train-iters 2 --global-batch-size 2 --save {root} --save-interval 1 --async-save "
                         "--ckpt-format torch_dist")
    pretrain(pretrain_gpt.train_valid_test_datasets_provider, pretrain_gpt.model_provider,
             ModelType.encoder_or_decoder, pretrain_gpt.forward_step, argv=argv.split())
    print("TRACKER", root, read_tracker(root), flush=True)
"""


def _free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_background_saves_work_in_a_second_pretrain_of_the_process(tmp_path):
    roots = [str(tmp_path / "first"), str(tmp_path / "second")]
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0", WORLD_SIZE="1",
               LOCAL_RANK="0", OMP_NUM_THREADS="1")
    result = subprocess.run([sys.executable, "-c", TWO_RUNS, *roots], cwd=REPO, env=env, capture_output=True,
                            text=True, timeout=240)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]
    assert "NOT saved" not in output, output[-3000:]
    for root in roots:
        assert f"TRACKER {root} 2" in output
        # Scheduling is not saving: the save line comes from the background write's completion.
        assert f"scheduled a background save of iteration 1 to {root} (--async-save)" in output
        assert "successfully saved checkpoint" not in output
        assert f"saved checkpoint of iteration 1 to {root} (--ckpt-format torch_dist)" in output
        assert sorted(os.listdir(root)) == ["iter_0000001", "iter_0000002", "latest_checkpointed_iteration.txt",
                                            "metrics.jsonl"]
