"""Session-wide test plumbing: the GPU marker, world-size ordering and the rank pools' shutdown."""

import pytest
import torch

from tests.unit_tests.multiprocess_harness import shutdown_pools


def pytest_collection_modifyitems(config, items):
    """Skip GPU tests on CPU machines (with a reason) and group multi-rank tests by world size.

    Tests parametrised with a `world_size` argument run grouped by that size so the pool of ranks for one
    size is built once; the sort is stable, so the order within a size stays the file order.
    """
    if not torch.cuda.is_available():
        skip_gpu = pytest.mark.skip(reason="needs a CUDA device; this machine has none")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip_gpu)

    def world_size_of(item):
        callspec = getattr(item, "callspec", None)
        if callspec is not None and "world_size" in callspec.params:
            return int(callspec.params["world_size"])
        marker = item.get_closest_marker("world_size")
        return int(marker.args[0]) if marker else 0

    items.sort(key=world_size_of)


def pytest_configure(config):
    config.addinivalue_line("markers", "world_size(n): runs on a pool of n ranks (used to group tests)")


def pytest_sessionfinish(session, exitstatus):
    shutdown_pools()
