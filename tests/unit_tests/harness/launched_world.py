"""Multi-rank tests inside a torchrun launch: every launched rank runs pytest, each multi-rank body runs once.

`torchrun --nproc-per-node N -m pytest ...` starts N pytest sessions that collect the same tests in the same
order. `run_on_ranks(k, fn)` then runs `fn` on launched ranks 0..k-1, whose default process group is made a
world of exactly k ranks for it (rebuilt only when k or the backend changes, or after a failure); ranks k..N-1
only wait for the answers. Like pool workers, which all run what the one test process sent, every member runs
rank 0's function and arguments (each session has its own `tmp_path`, say). Every rank receives every rank's
result, so all sessions reach the same verdict and rank 0 alone can report. A test that needs more than N
ranks is skipped with the size it needs.

The ranks coordinate outside the test's process groups, through torchrun's rendezvous store: each rank
publishes which test it is in, every `run_on_ranks` call starts with all ranks meeting ("arrived" keys, which
also carry whether a rank wants the world rebuilt), and results travel as keys. A rank therefore never sits
in a collective for a peer that is not coming: a wait ends when the peer answers, when the peer is seen past
this test (it failed early on its own), or after the task timeout (then later multi-rank tests fail at once).
A rank whose task fails closes its connections first, so peers blocked in a collective with it stop at once.

Outside a rank task, `ensure_test_world()` gives tests written Megatron-Core's way
(`Utils.initialize_distributed()`) the whole launched world, or a one-rank world in a plain pytest session.
"""

import json
import os
import pickle
import time
from collections import Counter
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from tests.unit_tests.harness.rank_task import (
    MultiRankError,
    failure_message,
    inside_rank_task,
    reset_global_state,
    run_rank_task,
)

PROCESS_GROUP_TIMEOUT_S = 120
ARRIVAL_TIMEOUT_S = 600
# Ranks wait this long for each other at the end of the session: a rank that exits with a failure first
# makes torchrun stop the others, so ranks leave together however long the slowest one still runs.
FINISH_TIMEOUT_S = 1800
_STORE_PREFIX = "megatron-unit-tests"
_FINISHED = 1 << 60  # the position a rank publishes once its session is over
_ENV_KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")


def launch_from_environment(environ=None):
    """(rank, world size, local world size) when torchrun (or any env:// launcher) started this process."""
    environ = os.environ if environ is None else environ
    if "RANK" not in environ or "WORLD_SIZE" not in environ:
        return None
    world_size = int(environ["WORLD_SIZE"])
    return int(environ["RANK"]), world_size, int(environ.get("LOCAL_WORLD_SIZE", world_size))


def default_backend():
    """NCCL where a GPU is present, gloo otherwise."""
    return "nccl" if torch.cuda.is_available() else "gloo"


class LaunchedWorld:
    """This rank's view of the launched ranks, and the default process group it currently holds."""

    def __init__(self, rank, world_size, local_world_size, store):
        self.rank, self.world_size, self.local_world_size = rank, world_size, local_world_size
        self._store = dist.PrefixStore(_STORE_PREFIX, store)
        self._launch_env = {key: os.environ[key] for key in _ENV_KEYS if key in os.environ}
        self._current = None  # (size, backend) of the default process group built here, or None
        self._dirty = False  # a task failed on this world: rebuild it before the next one
        self._broken = None  # set once a rank stopped answering; later tasks fail at once
        self._test_index, self._test_id, self._step = -1, "", 0
        self.stats = Counter()
        self.outcomes = Counter()
        self.failed_tests = []
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, local_world_size)))
        self._base_threads = torch.get_num_threads()

    # ---------------------------------------------------------------------------------------- store protocol
    def enter_test(self, index, test_id):
        """Called as each test starts: keys of this test are scoped by `index`, peers can see where we are."""
        self._test_index, self._test_id, self._step = index, test_id, 0
        self._store.set(f"position/{self.rank}", str(index))

    def _next_key(self, kind):
        self._step += 1
        return f"test{self._test_index}/{kind}{self._step}"

    def _peer_position(self, rank):
        key = f"position/{rank}"
        return int(self._store.get(key)) if self._store.check([key]) else -1

    def _wait(self, keys_by_rank, timeout_s, what):
        """Wait until every rank's key exists.

        A peer seen past this test (it failed here on its own and went on) fails this test only, and the
        world is rebuilt before the next task; a peer silent for `timeout_s` ends multi-rank testing.
        """
        pending = dict(keys_by_rank)
        deadline = time.monotonic() + timeout_s
        pause, next_position_check = 0.0005, time.monotonic() + 0.2
        while pending:
            for rank in [r for r, key in pending.items() if self._store.check([key])]:
                del pending[rank]
            if not pending:
                return
            now = time.monotonic()
            if now >= next_position_check:
                next_position_check = now + 0.2
                # The key is looked at again after the position: a peer that answered and then went on is not gone.
                gone = sorted(r for r, key in pending.items()
                              if self._peer_position(r) > self._test_index and not self._store.check([key]))
                if gone:
                    self._dirty = True
                    raise MultiRankError(f"{what}: launched ranks {gone} left this test without answering "
                                         "(they failed or were skipped on their own; see their reports)")
            if now >= deadline:
                self._broken = (f"launched ranks {sorted(pending)} gave no answer within {timeout_s}s in "
                                f"{self._test_id} ({what}); later multi-rank tests cannot run in this launch")
                raise MultiRankError(self._broken)
            time.sleep(pause)
            pause = min(pause * 2, 0.02)

    # ---------------------------------------------------------------------------------------- worlds
    def ensure_world(self, size, backend):
        """Make the default process group a `size`-rank `backend` world on launched ranks 0..size-1.

        Every launched rank calls this at the same point of the same test. They meet in the store first and
        rebuild when any of them asks (another size or backend, or a failure since), so they always agree, and
        the old world is idle when it is torn down. Ranks >= size end up with no default process group.
        """
        if self._broken:
            raise MultiRankError(self._broken)
        key = self._next_key("world")
        wants_rebuild = self._current != (size, backend) or self._dirty
        self._store.set(f"{key}/arrived/{self.rank}", b"1" if wants_rebuild else b"0")
        arrivals = {r: f"{key}/arrived/{r}" for r in range(self.world_size)}
        self._wait(arrivals, ARRIVAL_TIMEOUT_S, f"building a {size}-rank world")
        if all(self._store.get(k) == b"0" for k in arrivals.values()):
            return
        self.release_world()
        if self.rank < size:
            if backend == "nccl":
                torch.cuda.set_device(self.rank % torch.cuda.device_count())
            dist.init_process_group(
                backend=backend,
                store=dist.PrefixStore(f"{key}/pg", self._store),
                rank=self.rank,
                world_size=size,
                timeout=timedelta(seconds=PROCESS_GROUP_TIMEOUT_S),
            )
        self._current, self._dirty = (size, backend), False
        self.stats["world builds"] += 1

    def release_world(self):
        """Drop the default process group, and first any model-parallel groups built on it."""
        reset_global_state()
        if dist.is_initialized():
            dist.destroy_process_group()
        self._current = None

    # ---------------------------------------------------------------------------------------- tasks
    def run(self, size, fn, args, kwargs, timeout_s):
        """`fn` on launched ranks 0..size-1 as a `size`-rank world; every rank returns the per-rank results."""
        import pytest

        if size > self.world_size:
            self.stats["tasks skipped for want of ranks"] += 1
            pytest.skip(f"needs a world of {size} ranks; torchrun launched {self.world_size} "
                        f"(run it with torchrun --nproc-per-node {size} or more, or without torchrun)")
        self.ensure_world(size, "gloo")
        what = getattr(fn, "__qualname__", repr(fn))
        key = self._next_key("task")
        if self.rank < size:
            fn, args, kwargs = self._task_of_rank_zero(key, (fn, args, kwargs), timeout_s)
            outcome = self._run_here(size, fn, args, kwargs)
            if outcome[0] == "error":
                # Peers may be blocked in a collective waiting for this rank: closing its connections ends
                # their wait at once instead of after the process-group timeout.
                self.release_world()
                self._dirty = True
            try:
                payload = pickle.dumps(outcome)
            except Exception as error:
                payload = pickle.dumps(("error", f"the result of {what} cannot be pickled: {error!r}"))
            self._store.set(f"{key}/result/{self.rank}", payload)
        self._wait({r: f"{key}/result/{r}" for r in range(size)}, timeout_s, what)
        outcomes = [pickle.loads(self._store.get(f"{key}/result/{r}")) for r in range(size)]
        self.stats["tasks"] += 1
        self.stats["tasks on a sub-group"] += size < self.world_size
        errors = {rank: value for rank, (status, value) in enumerate(outcomes) if status == "error"}
        if errors:
            self._dirty = True  # a rank may have left a collective half done: the next task gets a fresh world
            raise MultiRankError(failure_message(what, size, errors, note=f"launched world of {self.world_size}"))
        return [value for _, value in outcomes]

    def _task_of_rank_zero(self, key, task, timeout_s):
        """Every rank runs a copy of rank 0's (fn, args, kwargs), as pool workers run what the test process sent.

        The ranks' own arguments may differ (each pytest session has its own `tmp_path`, for instance), and
        rank 0 works on a copy too, so the test body's own objects stay untouched as they do with pools.
        """
        if self.rank == 0:
            try:
                message = pickle.dumps(("ok", task))
            except Exception as error:
                problem = f"the task {task[0]!r} and its arguments cannot be pickled: {error!r}"
                self._store.set(f"{key}/task", pickle.dumps(("error", problem)))
                raise MultiRankError(problem) from error
            self._store.set(f"{key}/task", message)
            return pickle.loads(message)[1]
        self._wait({0: f"{key}/task"}, timeout_s, "receiving the task")
        status, payload = pickle.loads(self._store.get(f"{key}/task"))
        if status == "error":
            raise MultiRankError(payload)
        return payload

    def shared_path(self, own_path):
        """Rank 0's `own_path` on every rank (the launched ranks share one machine's file system)."""
        key = self._next_key("path")
        if self.rank == 0:
            self._store.set(key, str(own_path))
            return own_path
        self._wait({0: key}, ARRIVAL_TIMEOUT_S, "receiving rank 0's tmp_path")
        return Path(self._store.get(key).decode())

    def _run_here(self, size, fn, args, kwargs):
        os.environ.update({"RANK": str(self.rank), "WORLD_SIZE": str(size), "LOCAL_RANK": str(self.rank),
                           "LOCAL_WORLD_SIZE": str(min(size, self.local_world_size))})
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // min(size, self.local_world_size)))
        reset_global_state()  # a failed test outside run_on_ranks may have left model-parallel groups behind
        try:
            return run_rank_task(fn, args, kwargs)
        finally:
            torch.set_num_threads(self._base_threads)
            os.environ.update(self._launch_env)

    # ---------------------------------------------------------------------------------------- session end
    def record_report(self, report):
        """Count outcomes the way pytest's summary does (a failing setup or teardown is an error)."""
        if report.when == "call" or report.outcome != "passed":
            outcome = "error" if report.failed and report.when != "call" else report.outcome
            self.outcomes[outcome] += 1
            if report.failed:
                self.failed_tests.append(report.nodeid)

    def finish(self):
        """Publish this rank's summary, wait for every rank's, and tear the process group down."""
        summary = {"outcomes": dict(self.outcomes), "failed": self.failed_tests[:20], "stats": dict(self.stats)}
        self._store.set(f"summary/{self.rank}", json.dumps(summary))
        self._store.set(f"position/{self.rank}", str(_FINISHED))
        self._test_index = _FINISHED
        keys = {r: f"summary/{r}" for r in range(self.world_size)}
        deadline, silent = time.monotonic() + FINISH_TIMEOUT_S, {}
        while not self._store.check(list(keys.values())) and time.monotonic() < deadline:
            time.sleep(0.02)
        for rank, key in keys.items():
            if not self._store.check([key]):
                silent[rank] = f"no summary within {FINISH_TIMEOUT_S}s"
        summaries = {r: json.loads(self._store.get(k)) for r, k in keys.items() if r not in silent}
        self.release_world()
        return summaries, silent


_launched = None
_single_process_world = False


def start_if_launched():
    """Join the launched ranks when this pytest session runs under torchrun; returns the LaunchedWorld or None."""
    global _launched
    launch = launch_from_environment()
    if launch is None or _launched is not None:
        return _launched
    store, _, _ = next(dist.rendezvous("env://"))
    _launched = LaunchedWorld(*launch, store)
    return _launched


def launched():
    """The LaunchedWorld of this session (None without torchrun)."""
    return _launched


_finished = None


def finish_launch():
    """Session end under torchrun: (summaries per rank, silent ranks); (None, None) otherwise."""
    global _launched, _finished
    if _launched is None:
        return None, None
    _finished, _launched = _launched, None
    return _finished.finish()


def leave_after_rank_zero():
    """The last step of a torchrun session: rank 0 says it has reported, the others wait for that.

    torchrun stops every rank as soon as one exits with a failure; a rank that left first could cut rank 0's
    report short.
    """
    global _finished
    if _finished is None:
        return
    world, _finished = _finished, None
    try:
        if world.rank == 0:
            world._store.set("rank-0-reported", b"1")
            return
        deadline = time.monotonic() + FINISH_TIMEOUT_S
        while not world._store.check(["rank-0-reported"]) and time.monotonic() < deadline:
            time.sleep(0.02)
    except Exception:
        pass  # rank 0 hosted the store and has exited: it has reported


def ensure_test_world(backend=None):
    """The default process group a test body outside `run_on_ranks` should use, built if needed.

    Inside a rank task (pool worker or torchrun task) the task's world is used as it is. Under torchrun it is
    the whole launched world. In a plain pytest session it is a one-rank world in this process, released by
    `release_single_process_world()` (conftest does so after each test module).
    """
    global _single_process_world
    backend = backend or default_backend()
    if inside_rank_task():
        if not dist.is_initialized():
            raise RuntimeError("this rank task has no default process group; it runs only on ranks of its world")
        return
    if _launched is not None:
        _launched.ensure_world(_launched.world_size, backend)
        return
    if not dist.is_initialized():
        if backend == "nccl":
            torch.cuda.set_device(0)
        dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1)
        _single_process_world = True


def release_single_process_world():
    """Tear down the one-rank world `ensure_test_world` made in a plain pytest session (no-op otherwise)."""
    global _single_process_world
    if _single_process_world:
        reset_global_state()
        if dist.is_initialized():
            dist.destroy_process_group()
        _single_process_world = False
