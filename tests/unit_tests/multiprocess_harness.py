"""Runs test bodies on a persistent pool of ranks joined by a gloo process group, or on torchrun's ranks.

Starting a process group costs seconds, so each world size gets one pool of worker processes that lives for
the whole pytest session (only one pool is alive at a time; `conftest.py` orders the tests by world size so
pools are rarely rebuilt). A test calls `run_on_ranks(world_size, fn, *args)`; `fn` must be a module-level
function (it is pickled by reference) and runs on every rank with `torch.distributed` initialised. The return
values come back as a list indexed by rank. A failure on any rank raises `MultiRankError` with every rank's
traceback; the pool is then torn down, because a rank may be stuck in a collective, and rebuilt on demand.

Under torchrun (`torchrun --nproc-per-node N -m pytest ...`) no pool is spawned: `run_on_ranks` runs `fn` once
across the launched ranks instead (see `harness/launched_world.py`), with the same results and errors.
"""

import os
import queue
import tempfile
from datetime import timedelta

import torch.multiprocessing as mp

from tests.unit_tests.harness import launched_world
from tests.unit_tests.harness.rank_task import MultiRankError, mark_pool_worker, run_rank_task

DEFAULT_TASK_TIMEOUT_S = 600
PROCESS_GROUP_TIMEOUT_S = 120
ERROR_GRACE_S = 5


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
    result_queue.put((rank, "ready", None))
    while True:
        task = task_queue.get()
        if task is None:
            break
        fn, args, kwargs = task
        status, value = run_rank_task(fn, args, kwargs)
        result_queue.put((rank, status, value))
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

    def _collect(self, what, timeout_s):
        results, errors = [None] * self.world_size, {}
        pending = set(range(self.world_size))
        while pending:
            try:
                rank, status, value = self._result_queue.get(timeout=timeout_s)
            except queue.Empty:
                if errors:
                    break
                dead = [r for r, p in enumerate(self._processes) if not p.is_alive()]
                raise MultiRankError(
                    f"{what}: no answer within {timeout_s}s from ranks {sorted(pending)} of {self.world_size}"
                    + (f"; ranks {dead} died" if dead else "")
                    + "".join(f"\n--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items()))
                )
            pending.discard(rank)
            if status == "error":
                errors[rank] = value
                # Other ranks may now be blocked in a collective: give them a moment to report their own
                # errors (often the root cause), then stop waiting.
                timeout_s = ERROR_GRACE_S
                continue
            results[rank] = value
        if errors:
            raise MultiRankError(
                f"{what} failed on ranks {sorted(errors)} of {self.world_size}:"
                + "".join(f"\n--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items()))
            )
        return results

    def run(self, fn, args, kwargs, timeout_s):
        for task_queue in self._task_queues:
            task_queue.put((fn, args, kwargs))
        return self._collect(getattr(fn, "__qualname__", repr(fn)), timeout_s)

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
