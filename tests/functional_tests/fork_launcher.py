"""Launches `pretrain_gpt.py` ranks by forking a process that has already imported torch and Megatron.

A torchrun launch of a functional case spends most of its time starting interpreters: the elastic agent and
every rank import torch and Megatron (seconds of CPU each on a small machine) before a 10-iteration run of a
tiny model that takes about as long. This launcher pays the imports once per pytest session: a server process
(`python -m tests.functional_tests.fork_launcher`, one per distinct case environment, since `PYTHONHASHSEED` is
fixed when an interpreter starts) imports what `pretrain_gpt.py` imports and then, for every launch, forks one
child per rank. Each child gets the environment torchrun gives a rank (`RANK`, `LOCAL_RANK`, `WORLD_SIZE`,
`LOCAL_WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`, ...), writes to the launch's log and runs `pretrain_gpt.py` as
`__main__`, exactly as torchrun's ranks do; rank 0 hosts the store of the process group (`env://`). As torchrun
does, the launch stops every rank when one fails, and reports each rank's exit code.

The server forks while it runs no threads of its own beyond those of the libraries it imported, which have
fork handlers (OpenBLAS), and before torch has started an intra-op thread pool. Training results are those of a
torchrun launch: `tests/functional_tests/test_runner.py` runs a case both ways and requires equal losses.

Protocol: one JSON request per line on stdin ({"argv", "env", "nproc", "cwd", "log", "timeout_s"}), one JSON
answer per line on stdout ({"returncodes": [...], "timed_out": bool, "cpu_s": CPU seconds of the ranks}).
"""

import json
import os
import runpy
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
SCRIPT = REPO_ROOT / "pretrain_gpt.py"
STOP_GRACE_S = 5.0


# ---- the server --------------------------------------------------------------------------------------------


def _free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _run_rank(rank, request, port):
    """In the forked child: become rank `rank` of the launch and run the script; never returns."""
    code = 1
    try:
        log_fd = os.open(request["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.dup2(log_fd, 1)
        os.dup2(log_fd, 2)
        os.close(log_fd)
        sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115 (the rank's whole life)
        sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
        nproc = request["nproc"]
        os.environ.update(request["env"])
        os.environ.update({
            "RANK": str(rank), "LOCAL_RANK": str(rank), "GROUP_RANK": "0", "ROLE_RANK": str(rank),
            "WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc), "ROLE_WORLD_SIZE": str(nproc),
            "GROUP_WORLD_SIZE": "1", "ROLE_NAME": "default", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
            "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0",
        })  # fmt: skip
        if nproc > 1:
            os.environ.setdefault("OMP_NUM_THREADS", "1")  # as torchrun sets it
        os.chdir(request["cwd"])
        sys.argv = [str(SCRIPT), *request["argv"]]
        runpy.run_path(str(SCRIPT), run_name="__main__")
        code = 0
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
    except BaseException:  # noqa: BLE001 (reported in the rank's log, as torchrun's ranks do)
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _stop(pids):
    for pid in pids:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass


def _launch(request):
    port = _free_port()
    children = {}
    for rank in range(request["nproc"]):
        pid = os.fork()
        if pid == 0:
            _run_rank(rank, request, port)
        children[pid] = rank
    returncodes = [None] * request["nproc"]
    cpu_s = 0.0
    deadline = time.monotonic() + request["timeout_s"]
    stop_at = None
    timed_out = False
    while children:
        pid, status, usage = os.wait4(-1, os.WNOHANG)
        if pid == 0:
            now = time.monotonic()
            if stop_at is None and now > deadline:
                timed_out, stop_at = True, now
                _stop(children)
            elif stop_at is not None and now > stop_at + STOP_GRACE_S:
                for child in children:
                    os.kill(child, signal.SIGKILL)
            time.sleep(0.02)
            continue
        if pid not in children:
            continue
        rank = children.pop(pid)
        cpu_s += usage.ru_utime + usage.ru_stime
        returncodes[rank] = os.waitstatus_to_exitcode(status)
        if returncodes[rank] != 0 and stop_at is None:
            stop_at = time.monotonic()  # one rank failed: stop the others, as torchrun does
            _stop(children)
    return {"returncodes": returncodes, "timed_out": timed_out, "cpu_s": cpu_s}


def serve():
    # What pretrain_gpt.py and the training loop import, so the forked ranks start with it loaded.
    sys.path.insert(0, str(REPO_ROOT))
    import tests.rank_preload  # noqa: F401

    answers = sys.stdout
    sys.stdout = sys.stderr  # only answers on the answer stream
    answers.write(json.dumps({"ready": os.getpid()}) + "\n")
    answers.flush()
    for line in sys.stdin:
        if not line.strip():
            continue
        answers.write(json.dumps(_launch(json.loads(line))) + "\n")
        answers.flush()


# ---- the client ------------------------------------------------------------------------------------------


class ForkLauncher:
    """A server process for one environment; `launch` runs one multi-rank launch and returns the exit codes."""

    def __init__(self, env):
        self._lock = threading.Lock()
        self._process = subprocess.Popen(
            [sys.executable, "-m", "tests.functional_tests.fork_launcher"],
            cwd=REPO_ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=None, text=True,
        )  # fmt: skip
        ready = self._process.stdout.readline()
        if not ready:
            raise RuntimeError(f"the fork launcher exited while starting (code {self._process.wait()})")

    def alive(self):
        return self._process.poll() is None

    def launch(self, argv, env, nproc, cwd, log, timeout_s):
        request = {"argv": argv, "env": env, "nproc": nproc, "cwd": str(cwd), "log": str(log), "timeout_s": timeout_s}
        with self._lock:
            self._process.stdin.write(json.dumps(request) + "\n")
            self._process.stdin.flush()
            answer = self._process.stdout.readline()
        if not answer:
            raise RuntimeError(f"the fork launcher died (code {self._process.wait()})")
        return json.loads(answer)

    def close(self):
        if self.alive():
            self._process.stdin.close()
            try:
                self._process.wait(timeout=3)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()


_launchers = {}


def launcher_for(case_env, env):
    """The session's server for a case environment (`case_env`, the case's ENV_VARS), started on first use with
    the full environment `env`. Keyed by the case environment alone: the ranks get it applied again, and the rest
    of the test process's environment (which tests may change) does not start another server."""
    key = tuple(sorted(case_env.items()))
    launcher = _launchers.get(key)
    if launcher is None or not launcher.alive():
        launcher = _launchers[key] = ForkLauncher(env)
    return launcher


def close_launchers():
    while _launchers:
        _launchers.popitem()[1].close()


if __name__ == "__main__":
    serve()
