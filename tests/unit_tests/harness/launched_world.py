"""Multi-rank tests inside a torchrun launch: every launched rank runs pytest, each multi-rank body runs once.

`torchrun --nproc-per-node N -m pytest ...` starts N pytest sessions that collect the same tests in the same
order. `run_on_ranks(k, fn)` then runs `fn` on launched ranks 0..k-1, whose default process group is made a
world of exactly k ranks for it (rebuilt only when k or the backend changes, or after a failure); ranks k..N-1
only wait for the answers. Every rank receives every rank's result, so all sessions reach the same verdict
and rank 0 alone can report. A test that needs more than N ranks is skipped with the size it needs.

The ranks coordinate outside the test's process groups, through torchrun's rendezvous store: each rank
publishes which test it is in, "arrived" keys gate every world (re)build, and results travel as keys. A rank
therefore never sits in a collective for a peer that is not coming: a wait ends when the peer answers, when
the peer is seen to have moved past this test (it failed early on its own), or after the task timeout.

Outside a rank task, `ensure_test_world()` gives upstream-style tests (`Utils.initialize_distributed()`) the
whole launched world, or a one-rank world in a plain `python -m pytest` session.
"""

import json
import os
import pickle
import time
from collections import Counter
from datetime import timedelta

import torch
import torch.distributed as dist

from tests.unit_tests.harness.rank_task import MultiRankError, failure_message, inside_rank_task, run_rank_task

PROCESS_GROUP_TIMEOUT_S = 120
ARRIVAL_TIMEOUT_S = 600
FINISH_TIMEOUT_S = 120
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

    def _wait(self, keys_by_rank, timeout_s):
        """Wait until every rank's key exists; returns the ranks that never answered (empty when all did)."""
        pending = dict(keys_by_rank)
        deadline = time.monotonic() + timeout_s
        pause, next_position_check = 0.0005, time.monotonic() + 1.0
        while pending:
            for rank in [r for r, key in pending.items() if self._store.check([key])]:
                del pending[rank]
            if not pending:
                break
            now = time.monotonic()
            if now >= next_position_check:
                next_position_check = now + 1.0
                gone = [r for r in pending if self._peer_position(r) > self._test_index]
                if gone:
                    return {r: "left this test without answering (it failed or stopped on its own)" for r in gone}
            if now >= deadline:
                return {r: f"no answer within {timeout_s}s" for r in pending}
            time.sleep(pause)
            pause = min(pause * 2, 0.02)
        return {}

    def _raise_broken(self, what, silent):
        details = "; ".join(f"rank {r}: {why}" for r, why in sorted(silent.items()))
        self._broken = (f"launched rank(s) {sorted(silent)} stopped answering in {self._test_id} ({what}: {details}); "
                        "later multi-rank tests cannot run in this launch")
        raise MultiRankError(self._broken)

    # ---------------------------------------------------------------------------------------- worlds
    def ensure_world(self, size, backend):
        """Make the default process group a `size`-rank `backend` world on launched ranks 0..size-1.

        Every launched rank calls this at the same point of the same test; ranks >= size end up with no
        default process group. All ranks meet in the store first, so the old world is idle when it is torn down.
        """
        if self._broken:
            raise MultiRankError(self._broken)
        if self._current == (size, backend) and not self._dirty:
            return
        key = self._next_key("world")
        self._store.set(f"{key}/arrived/{self.rank}", b"1")
        silent = self._wait({r: f"{key}/arrived/{r}" for r in range(self.world_size)}, ARRIVAL_TIMEOUT_S)
        if silent:
            self._raise_broken(f"building a {size}-rank world", silent)
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
            outcome = self._run_here(size, fn, args, kwargs)
            try:
                payload = pickle.dumps(outcome)
            except Exception as error:
                payload = pickle.dumps(("error", f"the result of {what} cannot be pickled: {error!r}"))
            self._store.set(f"{key}/result/{self.rank}", payload)
        silent = self._wait({r: f"{key}/result/{r}" for r in range(size)}, timeout_s)
        if silent:
            self._raise_broken(what, silent)
        outcomes = [pickle.loads(self._store.get(f"{key}/result/{r}")) for r in range(size)]
        self.stats["tasks"] += 1
        self.stats["tasks on a sub-group"] += size < self.world_size
        errors = {rank: value for rank, (status, value) in enumerate(outcomes) if status == "error"}
        if errors:
            self._dirty = True  # a rank may have left a collective half done: the next task gets a fresh world
            raise MultiRankError(failure_message(what, size, errors, note=f"launched world of {self.world_size}"))
        return [value for _, value in outcomes]

    def _run_here(self, size, fn, args, kwargs):
        os.environ.update({"RANK": str(self.rank), "WORLD_SIZE": str(size), "LOCAL_RANK": str(self.rank),
                           "LOCAL_WORLD_SIZE": str(min(size, self.local_world_size))})
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // min(size, self.local_world_size)))
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
        silent = self._wait(keys, FINISH_TIMEOUT_S)
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


def finish_launch():
    """Session end under torchrun: (summaries per rank, silent ranks); (None, None) otherwise."""
    global _launched
    if _launched is None:
        return None, None
    world, _launched = _launched, None
    return world.finish()


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
        from tests.unit_tests.harness.rank_task import reset_global_state

        reset_global_state()
        if dist.is_initialized():
            dist.destroy_process_group()
        _single_process_world = False
