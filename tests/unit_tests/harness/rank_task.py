"""One multi-rank test body on one rank, the same way under the rank pools and under torchrun.

`run_rank_task` runs `fn`, turns any outcome (value, exception, pytest skip) into ("ok", value) or
("error", traceback), and undoes the global state a test body may leave behind (model-parallel groups).
While it runs, `inside_rank_task()` is true: helpers such as `Utils.initialize_distributed()` then use the
world the harness built for the task instead of building one.
"""

import sys
import traceback

_inside_rank_task = False


class MultiRankError(AssertionError):
    """A test body failed (or timed out) on at least one rank."""


def inside_rank_task():
    """True while a `run_on_ranks` body runs in this process (always true in a pool worker)."""
    return _inside_rank_task


def mark_pool_worker():
    """A pool worker only ever runs rank tasks."""
    global _inside_rank_task
    _inside_rank_task = True


def reset_global_state():
    """Undo per-test global state so the next task on this world starts clean."""
    parallel_state = sys.modules.get("megatron.core.parallel_state")
    if parallel_state is not None and parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()


def run_rank_task(fn, args, kwargs):
    """("ok", fn(*args, **kwargs)) or ("error", traceback); global state is reset either way."""
    global _inside_rank_task
    was_inside, _inside_rank_task = _inside_rank_task, True
    try:
        outcome = ("ok", fn(*args, **kwargs))
    except BaseException:  # report everything, including pytest's Skipped/Failed outcomes
        outcome = ("error", traceback.format_exc())
    finally:
        _inside_rank_task = was_inside
    try:
        reset_global_state()
    except Exception:
        if outcome[0] == "ok":
            outcome = ("error", "resetting the model-parallel state after the task failed:\n" + traceback.format_exc())
    return outcome


def failure_message(what, world_size, errors, silent_ranks=(), note=""):
    """One message for every rank's traceback (`errors`: rank -> traceback) and the ranks that never answered."""
    head = f"{what} failed on ranks {sorted(errors)} of {world_size}" if errors else f"{what} on {world_size} ranks"
    if silent_ranks:
        head += f"; no answer from ranks {sorted(silent_ranks)}"
    return head + (f" ({note})" if note else "") + ":" * bool(errors) + "".join(
        f"\n--- rank {rank} ---\n{tb}" for rank, tb in sorted(errors.items())
    )
