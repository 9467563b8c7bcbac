"""`--async-save`: checkpoint writes that run in the background while training goes on.

The training thread stages the state (a CPU snapshot: training may change the tensors right after), then a
worker thread writes it into the checkpoint's temporary directory. Its collectives (DCP's planning and its
final gather) run on a process group of their own, so they never interleave with training's. The checkpoint
is published (renamed into place, tracker updated) only once every rank's write has succeeded, which all
ranks agree on in the training thread (`maybe_finalize`, called once per iteration, and `finalize(blocking)`
before exit); a failed write on any rank is reported and the checkpoint is dropped, the previous one stays the
latest. `--use-persistent-ckpt-worker` keeps one worker thread for the whole run instead of one per save.
"""

import concurrent.futures
import threading
import traceback
from typing import Callable, Optional

import torch
import torch.distributed as dist


class PendingSave:
    def __init__(self, future, publish: Callable[[bool], None], description: str):
        self.future = future
        self.publish = publish
        self.description = description


class AsyncCheckpointQueue:
    """At most one checkpoint write in flight; finalised collectively in the training thread."""

    def __init__(self, device, persistent_worker: bool = False):
        self.device = torch.device(device)
        self.persistent_worker = persistent_worker
        self._executor = None
        self._pending: Optional[PendingSave] = None
        self._group = None

    @property
    def process_group(self):
        """The group the background writes communicate on (gloo: they move only small plans and metadata)."""
        if self._group is None and dist.is_initialized():
            self._group = dist.new_group(backend="gloo")
        return self._group

    def schedule(self, write: Callable[[], None], publish: Callable[[bool], None], description: str):
        """Run `write()` in the background; `publish(succeeded)` runs on every rank once all have finished."""
        self.finalize(blocking=True)
        self.process_group  # create it now, on every rank, in the training thread
        if self.persistent_worker:
            if self._executor is None:
                self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="ckpt-writer")
            future = self._executor.submit(write)
        else:
            future = concurrent.futures.Future()

            def run():
                try:
                    future.set_result(write())
                except BaseException as exc:  # noqa: B902 - reported by finalize, on the training thread
                    exc.formatted_traceback = traceback.format_exc()
                    future.set_exception(exc)

            threading.Thread(target=run, name="ckpt-writer", daemon=True).start()
        self._pending = PendingSave(future, publish, description)

    @property
    def pending(self) -> bool:
        return self._pending is not None

    def _all_ranks(self, flag: bool, op) -> bool:
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return flag
        value = torch.tensor([1.0 if flag else 0.0], device=self.device)
        dist.all_reduce(value, op=op)
        return value.item() > 0.5

    def maybe_finalize(self) -> bool:
        """Publish the pending save if every rank's write is done; returns True when one was finalised."""
        return self.finalize(blocking=False)

    def finalize(self, blocking: bool) -> bool:
        if self._pending is None:
            return False
        pending = self._pending
        if blocking:
            concurrent.futures.wait([pending.future])
        elif not self._all_ranks(pending.future.done(), dist.ReduceOp.MIN):
            return False
        error = pending.future.exception()
        if error is not None:
            rank = dist.get_rank() if dist.is_initialized() else 0
            detail = getattr(error, "formatted_traceback", None) or "".join(
                traceback.format_exception(type(error), error, error.__traceback__))
            print(f"rank {rank}: background write of {pending.description} failed: {type(error).__name__}: "
                  f"{error}\n{detail}", flush=True)
        succeeded = self._all_ranks(error is None, dist.ReduceOp.MIN)
        self._pending = None
        pending.publish(succeeded)
        return True

    def close(self):
        self.finalize(blocking=True)
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None

    def abandon(self):
        """Forget the queue without a collective (the end of a run, whose process groups go next): a write still
        pending (a run that failed) is never published, so the latest checkpoint stays the previous one."""
        self._pending = None
        self._group = None
        if self._executor is not None:
            self._executor.shutdown(wait=False)
            self._executor = None
