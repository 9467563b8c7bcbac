"""Runs test bodies on a persistent pool of ranks joined by a gloo process group, or on torchrun's ranks.

Starting a process group costs seconds, so each world size gets one pool of worker processes that lives for
the whole pytest session (only one pool is alive at a time; `conftest.py` orders the tests by world size so
pools are rarely rebuilt). A test calls `run_on_ranks(world_size, fn, *args)`; `fn` must be a module-level
function (it is pickled by reference) and runs on every rank with `torch.distributed` initialised. The return
values come back as a list indexed by rank, so they must be picklable: plain Python values or detached CPU
tensors, not modules, process groups, DTensors, generators or lambdas. A failure on any rank raises
`MultiRankError` with every rank's traceback; so does a value that cannot be sent back, a task that cannot be
sent, and a rank that exits without answering. The pool is then torn down, because a rank may be stuck in a
collective, and rebuilt on demand.

Tasks and results cross the queues already pickled: a queue pickles in a background thread that only prints
what it cannot pickle and drops it, so the other side would wait for it until the task timeout.

Under torchrun (`torchrun --nproc-per-node N -m pytest ...`) no pool is spawned: `run_on_ranks` runs `fn` once
across the launched ranks instead (see `harness/launched_world.py`), with the same results and errors.
"""

import os
import pickle
import queue
import tempfile
import time
from datetime import timedelta
from multiprocessing.reduction import ForkingPickler

import torch.multiprocessing as mp

from tests.unit_tests.harness import launched_world
from tests.unit_tests.harness.rank_task import MultiRankError, failure_message, mark_pool_worker, run_rank_task

DEFAULT_TASK_TIMEOUT_S = 600
PROCESS_GROUP_TIMEOUT_S = 120
ERROR_GRACE_S = 5
LIVENESS_POLL_S = 0.5  # how often a wait for answers checks that the silent ranks are still alive


def _dumps(obj):
    """`obj` pickled the way a multiprocessing queue pickles it (tensors go through shared memory)."""
    return bytes(ForkingPickler.dumps(obj))


def _type_name(value):
    kind = type(value)
    return kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"


def _unpicklable_part(value, where, depth=3):
    """(where, value) of the innermost list/tuple/dict entry of `value` that cannot be pickled, else (where, value)."""
    if depth and isinstance(value, (list, tuple, dict)):
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for key, item in items:
            try:
                _dumps(item)
            except Exception:
                return _unpicklable_part(item, f"{where}[{key!r}]", depth - 1)
    return where, value


def _pickled_outcome(rank, what, outcome):
    """The bytes of ("ok", value) or ("error", traceback) that a rank sends back; an error if `value` cannot go."""
    try:
        return _dumps(outcome)
    except Exception as error:
        where, part = _unpicklable_part(outcome[1], "the value")
        return _dumps((
            "error",
            f"{what} returned a value that rank {rank} cannot send back to the test process: {where} is a "
            f"{_type_name(part)} that cannot be pickled ({type(error).__name__}: {error}). Return plain Python "
            "values or detached CPU tensors (tensor.detach().cpu()), not modules, process groups, DTensors, "
            "generators or lambdas.\n",
        ))


def _worker_main(rank, world_size, init_file, task_queue, result_queue):
    import torch
    import torch.distributed as dist

    mark_pool_worker()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    os.environ.update(
        {"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world_size)}
    )
    dist.init_process_group(
        backend="gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=PROCESS_GROUP_TIMEOUT_S),
    )
    result_queue.put((rank, _dumps(("ok", None))))
    while True:
        task = task_queue.get()
        if task is None:
            break
        try:
            fn, args, kwargs = pickle.loads(task)
        except Exception as error:
            result_queue.put((rank, _dumps(("error", f"the task could not be unpickled: {error!r}\n"))))
            continue
        outcome = run_rank_task(fn, args, kwargs)
        result_queue.put((rank, _pickled_outcome(rank, getattr(fn, "__qualname__", repr(fn)), outcome)))
    dist.destroy_process_group()


# Workers are forked from multiprocessing's fork server, which imports these once per session: a new pool's ranks
# start with torch and Megatron loaded (about 2 s of CPU per rank less than a fresh interpreter), as clean as
# spawned ones (the server runs no test code). Tests grouped by world size still rebuild pools when a test
# needs several sizes. pytest too: every test module imports it, and each rank imports the modules of the tasks
# it runs (about 0.3 s of CPU a rank, 29 CPU-seconds of the suite, before pytest was preloaded here).
FORK_SERVER_PRELOAD = ["tests.rank_preload", "pytest", "tests.unit_tests.multiprocess_harness"]
_context = None


def _worker_context():
    global _context
    if _context is None:
        _context = mp.get_context("forkserver")
        _context.set_forkserver_preload(FORK_SERVER_PRELOAD)
    return _context


class RankPool:
    """`world_size` worker processes that share one gloo process group."""

    def __init__(self, world_size):
        self.world_size = world_size
        context = _worker_context()
        handle, self._init_file = tempfile.mkstemp(prefix=f"pg_init_ws{world_size}_")
        os.close(handle)
        os.unlink(self._init_file)  # FileStore wants a path that does not exist yet
        self._task_queues = [context.Queue() for _ in range(world_size)]
        self._result_queue = context.Queue()
        self._processes = [
            context.Process(
                target=_worker_main,
                args=(rank, world_size, self._init_file, self._task_queues[rank], self._result_queue),
                daemon=True,
            )
            for rank in range(world_size)
        ]
        for process in self._processes:
            process.start()
        self._collect("ready", timeout_s=PROCESS_GROUP_TIMEOUT_S)

    def alive(self):
        return all(process.is_alive() for process in self._processes)

    def _next_answer(self, timeout_s):
        """(rank, status, value) from the result queue, or None after `timeout_s`."""
        try:
            rank, payload = self._result_queue.get(timeout=timeout_s)
        except queue.Empty:
            return None
        try:
            status, value = pickle.loads(payload)
        except Exception as error:
            return rank, "error", f"the value this rank sent back could not be unpickled here: {error!r}\n"
        return rank, status, value

    def _collect(self, what, timeout_s):
        results, errors = [None] * self.world_size, {}
        pending = set(range(self.world_size))
        deadline = time.monotonic() + timeout_s
        while pending:
            answer = self._next_answer(max(0.0, min(LIVENESS_POLL_S, deadline - time.monotonic())))
            if answer is not None:
                rank, status, value = answer
                pending.discard(rank)
                if status == "error":
                    errors[rank] = value
                    # Other ranks may now be blocked in a collective: give them a moment to report their own
                    # errors (often the root cause), then stop waiting.
                    deadline = min(deadline, time.monotonic() + ERROR_GRACE_S)
                else:
                    results[rank] = value
                continue
            # Nothing arrived: a rank that has exited will never answer, so stop waiting for it now.
            for rank in sorted(pending):
                process = self._processes[rank]
                if not process.is_alive():
                    pending.discard(rank)
                    errors[rank] = (f"the rank's process exited (exit code {process.exitcode}) during {what} "
                                    "without answering\n")
                    deadline = min(deadline, time.monotonic() + ERROR_GRACE_S)
            if pending and time.monotonic() >= deadline:
                if errors:
                    break
                raise MultiRankError(f"{what}: no answer within {timeout_s}s from ranks {sorted(pending)} "
                                     f"of {self.world_size}")
        if errors:
            raise MultiRankError(failure_message(what, self.world_size, errors, silent_ranks=pending))
        return results

    def run(self, fn, args, kwargs, timeout_s):
        what = getattr(fn, "__qualname__", repr(fn))
        # Pickled once per rank: a tensor argument is shared through a file descriptor that only one receiver
        # can take.
        tasks = []
        for _ in self._task_queues:
            try:
                tasks.append(_dumps((fn, args, kwargs)))
            except Exception as error:
                raise MultiRankError(
                    f"{what} and its arguments cannot be sent to the ranks: {type(error).__name__}: {error}. "
                    "The function must be defined at module level and its arguments picklable (plain Python "
                    "values or detached CPU tensors)."
                ) from error
        for task_queue, task in zip(self._task_queues, tasks):
            task_queue.put(task)
        return self._collect(what, timeout_s)

    def close(self, graceful=True):
        if graceful and self.alive():
            for task_queue in self._task_queues:
                task_queue.put(None)
            for process in self._processes:
                process.join(timeout=20)
        for process in self._processes:
            if process.is_alive():
                process.kill()
                process.join(timeout=5)
        if os.path.exists(self._init_file):
            os.unlink(self._init_file)


_live_pool = None


def run_on_ranks(world_size, fn, *args, timeout_s=DEFAULT_TASK_TIMEOUT_S, **kwargs):
    """Run `fn(*args, **kwargs)` on every rank of a `world_size` gloo group; returns the per-rank results."""
    global _live_pool
    if launched_world.launched() is not None:
        return launched_world.launched().run(world_size, fn, args, kwargs, timeout_s)
    if _live_pool is not None and (_live_pool.world_size != world_size or not _live_pool.alive()):
        _live_pool.close()
        _live_pool = None
    if _live_pool is None:
        _live_pool = RankPool(world_size)
    try:
        return _live_pool.run(fn, args, kwargs, timeout_s)
    except MultiRankError:
        _live_pool.close(graceful=False)
        _live_pool = None
        raise


def shutdown_pools():
    global _live_pool
    if _live_pool is not None:
        _live_pool.close()
        _live_pool = None
