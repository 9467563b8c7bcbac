"""Session-wide test plumbing: the GPU marker, world-size ordering, torchrun launches and the rank pools' shutdown.

Under torchrun (`WORLD_SIZE`/`RANK` set) every launched rank runs this pytest session; multi-rank bodies run
once across the launched ranks (`tests/unit_tests/harness/launched_world.py`), only rank 0 writes to the
terminal, and rank 0's summary adds whether the other ranks agreed.
"""

import atexit
import gc
import os

# Before torch loads OpenMP, so that this process and every rank and run it starts read it. A process that has a
# thread per core (a one-rank training run: `set_cpu_threads` gives it every core) keeps its OpenMP workers
# spinning after each parallel region by default; on a small machine they take the cores the test's other
# processes need. Sleeping workers leave the results unchanged (the work is split by the thread count, not the
# wait policy): measured on 2 cores, three FSDP cases against their one-rank DDP twins took 10 instead of 24-30
# CPU seconds, with the same losses to the last bit.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import compileall  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

_REPO_ROOT = Path(__file__).resolve().parents[1]


def _write_bytecode_for_the_tree():
    """Bytecode for the repository's sources, as `.ci/run` writes it before the suite and pip for installed packages.

    Where PYTHONDONTWRITEBYTECODE is set (hosts that keep checkouts free of `__pycache__`), every interpreter the
    tests start (the rank pools' fork server, the functional launch servers, torchrun ranks, command-line tools)
    would compile Megatron again (0.7 CPU-seconds of `compile` in `import tests.rank_preload` on a slow 2-core
    host). An up-to-date tree costs 0.1 s here. This process writes bytecode too, which lets pytest keep the test
    modules it has rewritten for their asserts: the next session reads them instead of rewriting about 420
    modules, and collecting the suite took 13 instead of 25 CPU-seconds. A read-only checkout goes without:
    compileall skips what it cannot write (silently at quiet=2), and so does pytest.
    """
    for folder in ("megatron", "tools", "examples", "tests"):
        compileall.compile_dir(_REPO_ROOT / folder, quiet=2)
    compileall.compile_file(_REPO_ROOT / "pretrain_gpt.py", quiet=2)
    sys.dont_write_bytecode = False


_write_bytecode_for_the_tree()

import pytest  # noqa: E402
import torch  # noqa: E402

from tests.unit_tests.harness import launched_world  # noqa: E402
from tests.unit_tests.multiprocess_harness import shutdown_pools  # noqa: E402

_TEST_INDEX = pytest.StashKey[int]()
_peer_summaries = {}


def _declared_world_size(item):
    """The `world_size` parameter or marker of a multi-rank test; 0 for other tests."""
    callspec = getattr(item, "callspec", None)
    if callspec is not None and "world_size" in callspec.params:
        return int(callspec.params["world_size"])
    marker = item.get_closest_marker("world_size")
    return int(marker.args[0]) if marker else 0


def pytest_collection_modifyitems(config, items):
    """Skip GPU tests on CPU machines (with a reason) and group multi-rank tests by world size.

    Tests parametrised with a `world_size` argument run grouped by that size so the pool of ranks for one
    size is built once; the sort is stable, so the order within a size stays the file order. Every torchrun
    rank sorts the same way, so the position of a test is the same on all of them.
    """
    if not torch.cuda.is_available():
        skip_gpu = pytest.mark.skip(reason="needs a CUDA device; this machine has none")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip_gpu)

    items.sort(key=_declared_world_size)
    for index, item in enumerate(items):
        item.stash[_TEST_INDEX] = index


@pytest.hookimpl(trylast=True)
def pytest_configure(config):
    config.addinivalue_line("markers", "world_size(n): runs on a pool of n ranks (used to group tests)")
    world = launched_world.start_if_launched()
    if world is not None and world.rank != 0:
        _silence_terminal(config)


def _silence_terminal(config):
    """Ranks other than 0 report nothing themselves; rank 0's summary says whether they agreed."""
    from _pytest.terminal import TerminalReporter

    reporter = config.pluginmanager.getplugin("terminalreporter")
    if reporter is not None:
        config.pluginmanager.unregister(reporter)
        quiet = TerminalReporter(config, open(os.devnull, "w"))  # noqa: SIM115 (lives as long as the session)
        config.pluginmanager.register(quiet, "terminalreporter")


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    world = launched_world.launched()
    if world is not None:
        world.enter_test(item.stash.get(_TEST_INDEX, -1), item.nodeid)


def pytest_runtest_logreport(report):
    world = launched_world.launched()
    if world is not None:
        world.record_report(report)


@pytest.fixture
def tmp_path(request, tmp_path):
    """Under torchrun, a multi-rank test sees rank 0's `tmp_path` on every rank.

    Its rank functions run with rank 0's arguments, so the files they write are under rank 0's directory;
    the assertions every rank makes on them afterwards must look there too. Tests without a declared world
    size keep a directory per rank, since every rank runs them at the same time.
    """
    world = launched_world.launched()
    if world is None or _declared_world_size(request.node) == 0:
        return tmp_path
    return world.shared_path(tmp_path)


@pytest.fixture(autouse=True, scope="module")
def _release_single_process_world():
    """A one-rank world built by `Utils.initialize_distributed()` in a plain session ends with its module."""
    yield
    launched_world.release_single_process_world()


def pytest_collection_finish(session):
    # What collection imported (torch, Megatron, ~250 test modules) stays for the whole session: out of the
    # collector's reach, the full collections the session triggers walk only what the tests made since.
    gc.collect()
    gc.freeze()


def pytest_sessionfinish(session, exitstatus):
    # pytest's unraisable-exception check runs five full collections at exit; the session's objects are done.
    # They are handed back to the collector just before the interpreter's own last collection, so that
    # extension objects (triton's nanobind types) are freed there instead of being reported as leaked.
    gc.freeze()
    atexit.register(gc.unfreeze)
    shutdown_pools()
    launched_world.release_single_process_world()
    summaries, silent = launched_world.finish_launch()
    if summaries is not None:
        _peer_summaries.update(summaries=summaries, silent=silent)


def pytest_unconfigure(config):
    launched_world.leave_after_rank_zero()


def pytest_terminal_summary(terminalreporter):
    if not _peer_summaries:
        return
    summaries, silent = _peer_summaries["summaries"], _peer_summaries["silent"]
    write = terminalreporter.write_line
    own = summaries.get(0, {})
    stats = own.get("stats", {})
    write(
        f"torchrun: {len(summaries) + len(silent)} launched ranks; "
        f"{stats.get('tasks', 0)} multi-rank bodies ran once across them "
        f"({stats.get('tasks on a sub-group', 0)} on a sub-group), "
        f"{stats.get('tasks skipped for want of ranks', 0)} skipped for want of ranks, "
        f"{stats.get('world builds', 0)} process-group (re)builds"
    )
    for rank, summary in sorted(summaries.items()):
        if rank == 0:
            continue
        agrees = summary["outcomes"] == own.get("outcomes")
        counts = ", ".join(f"{n} {outcome}" for outcome, n in sorted(summary["outcomes"].items()))
        write(f"torchrun rank {rank}: {counts}" + ("" if agrees else "  <-- differs from rank 0"))
        for nodeid in summary["failed"]:
            write(f"  rank {rank} FAILED {nodeid}")
    for rank, why in sorted(silent.items()):
        write(f"torchrun rank {rank}: no summary ({why})")
