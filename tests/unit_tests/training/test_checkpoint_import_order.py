"""The checkpoint path reads top-down: every import (module-level or inside a function) among its modules points
down this list, so no module builds, writes or names checkpoint state by calling back into one above it."""

import ast
import importlib.util

import pytest

TOP_DOWN = [
    "megatron.training.checkpointing",  # --save / --load: dispatch by format, the torch format
    "megatron.training.local_checkpoint",  # --non-persistent-ckpt-type local: per-rank save and load
    "megatron.training.local_checkpoint_files",  # its files: temporary directory, rename, what is complete
    "megatron.training.local_checkpoint_pieces",  # its pieces: which rank stores which, filling targets
    "megatron.training.dist_checkpoint",  # the logical format: writes and reads
    "megatron.training.checkpoint_state",  # builds the run's logical state and load targets
    "megatron.core.dist_checkpointing.wrappers",  # picks the builder of each wrapper
    "megatron.core.dist_checkpointing.fsdp_state",  # Megatron-FSDP chunks
    "megatron.core.dist_checkpointing.optimizer_state",  # optimizer of DDP / FSDP2 chunks
    "megatron.core.dist_checkpointing.model_state",  # models of DDP / FSDP2 chunks
    "megatron.core.dist_checkpointing.logical_names",  # names and placements (no tensor data)
    "megatron.core.dist_checkpointing.logical_tensor",  # boxes of a logical tensor
    "megatron.core.dist_checkpointing.checkpoint_directory",  # tracker, iteration directories, publishing
    "megatron.training.random_state",
]


def _imported_modules(module_name):
    """Every module `module_name` imports, at module level or inside functions."""
    tree = ast.parse(open(importlib.util.find_spec(module_name).origin).read())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


@pytest.mark.parametrize("module_name", TOP_DOWN)
def test_checkpoint_modules_only_import_modules_below_them(module_name):
    position = TOP_DOWN.index(module_name)
    upward = sorted(name for name in _imported_modules(module_name) if name in TOP_DOWN[:position])
    assert upward == [], f"{module_name} imports {upward}, which sit above it on the checkpoint path"
