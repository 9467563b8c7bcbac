"""Example programs' `pretrain_gpt.py` launches with their ranks forked from the functional tests' launch server.

The server (`tests/functional_tests/fork_launcher.py`) imports torch and Megatron once per session and forks each
launch's ranks with the environment torchrun gives them; `tests/functional_tests/test_runner.py` holds it to a
torchrun launch's metrics bit for bit. A torchrun launch pays torchrun's agent and a fresh interpreter per rank
instead, each importing torch and Megatron: several CPU-seconds each on a small machine.
"""

import os
import subprocess
from pathlib import Path

from tests.functional_tests import fork_launcher as launchers

REPO_ROOT = Path(__file__).resolve().parents[3]
# The functional cases' environment: the server their session starts serves these launches too.
LAUNCH_ENV = {"PYTHONHASHSEED": "0"}
_KEY = tuple(sorted(LAUNCH_ENV.items()))


def start_server(env):
    """(the launch server for LAUNCH_ENV, whether this call started it); `env` is the environment it starts in."""
    started = _KEY not in launchers._launchers or not launchers._launchers[_KEY].alive()
    path = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    return launchers.launcher_for(LAUNCH_ENV, {**env, **LAUNCH_ENV, "PYTHONPATH": path}), started


def close_server():
    if _KEY in launchers._launchers:
        launchers._launchers.pop(_KEY).close()


def torchrun_ranks(command):
    """(ranks, pretrain_gpt.py's arguments) of a `python -m torch.distributed.run [options] pretrain_gpt.py ARGS`
    command line; raises ValueError for anything else."""
    command = [str(word) for word in command]
    script = str(launchers.SCRIPT)
    if command[1:3] != ["-m", "torch.distributed.run"] or script not in command:
        raise ValueError(f"not a torchrun launch of {script}: {command}")
    options = command[3:command.index(script)]
    ranks = 1
    for index, option in enumerate(options):
        if option.startswith("--nproc-per-node=") or option.startswith("--nproc_per_node="):
            ranks = int(option.split("=", 1)[1])
        elif option in ("--nproc-per-node", "--nproc_per_node"):
            ranks = int(options[index + 1])
    return ranks, command[command.index(script) + 1:]


def run_forked(server, command, cwd, log, timeout):
    """What `subprocess.run(command, capture_output=True, text=True)` of a torchrun launch of pretrain_gpt.py
    returns, the ranks forked from `server` and writing to `log` (the CompletedProcess's stderr is that log)."""
    ranks, argv = torchrun_ranks(command)
    Path(log).write_text("")
    answer = server.launch(argv, LAUNCH_ENV, ranks, cwd, log, timeout)
    if answer["timed_out"]:
        raise subprocess.TimeoutExpired(command, timeout, stderr=Path(log).read_text())
    returncode = next((code for code in answer["returncodes"] if code != 0), 0)
    return subprocess.CompletedProcess(command, returncode, "", Path(log).read_text())
