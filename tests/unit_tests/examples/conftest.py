"""Processes for the example programs' runs, forked from servers that have imported torch and Megatron once per
session instead of started as fresh interpreters that import them each."""

import functools
import os

import pytest
import torch.multiprocessing

from tests.unit_tests import multiprocess_harness
from tests.unit_tests.examples import forked_launches


@pytest.fixture(scope="session")
def launch_server():
    """The functional tests' launch server (`forked_launches.py`); closed at the end of the session if started
    here (a functional test session closes its own)."""
    server, started_here = forked_launches.start_server(dict(os.environ))
    yield server
    if started_here:
        forked_launches.close_server()


@pytest.fixture
def processes_from_the_fork_server(monkeypatch):
    """`torch.multiprocessing.spawn` starts its processes from the rank pools' fork server, which has imported
    torch and Megatron once per session; they run the same function with the same arguments."""
    multiprocess_harness._worker_context()  # the fork server with its preload
    monkeypatch.setattr(torch.multiprocessing, "spawn",
                        functools.partial(torch.multiprocessing.start_processes, start_method="forkserver"))
