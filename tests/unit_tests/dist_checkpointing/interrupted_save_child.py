"""Child process of test_safety: saves iteration 1, then dies (SIGKILL) in the middle of writing iteration 2.

test_safety forks it from the rank pools' fork server (`run_forked`, torch and Megatron already imported); by hand:
python -m tests.unit_tests.dist_checkpointing.interrupted_save_child ROOT {sync,async}
Writes ROOT/expected_weights.pt (the model at iteration 1) before starting the doomed save.
"""

import os
import signal
import sys
import time

import torch
import torch.distributed.checkpoint.filesystem as dcp_filesystem

from tests.unit_tests.dist_checkpointing.pretrain_helpers import TrainingState


def main(root, mode):
    from megatron.training import checkpointing

    async_flag = "--async-save" if mode == "async" else ""
    state = TrainingState(f"--use-distributed-optimizer --ckpt-format torch_dist --save {root} {async_flag}")
    state.train_steps(1)
    checkpointing.save_checkpoint(1, state.model, state.optimizer, state.scheduler, state.args)
    checkpointing.maybe_finalize_async_save(state.args, blocking=True)
    torch.save({name: param.detach().clone() for name, param in state.model[0].module.named_parameters()},
               os.path.join(root, "expected_weights.pt"))
    state.train_steps(1)
    real_write_item = dcp_filesystem._write_item
    written = {"items": 0}

    def write_then_die(*args, **kwargs):
        written["items"] += 1
        if written["items"] == 3:  # a few items are on disk, the file is incomplete
            os.kill(os.getpid(), signal.SIGKILL)
        return real_write_item(*args, **kwargs)

    dcp_filesystem._write_item = write_then_die
    checkpointing.save_checkpoint(2, state.model, state.optimizer, state.scheduler, state.args)
    while True:  # async: training goes on while the background write dies
        state.train_steps(1)
        time.sleep(0.01)


def run_forked(root, mode, port, log_path):
    """`main` as the one rank of its own world on `port`, with its output in `log_path`."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    torch.set_num_threads(1)
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(log, 1)
    os.dup2(log, 2)
    main(root, mode)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
