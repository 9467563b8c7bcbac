"""Initial weights that do not depend on the parallel layout or on the order modules are built in.

Every module that draws random initial weights gets its own seed, derived from a base seed and the module's
identity in the whole model (for example layer 3's fc1), never from its position in a construction sequence.
A pipeline stage that does not build the embedding or the earlier layers therefore draws exactly the numbers a
single-rank model draws for the same modules, and a model built on the meta device reproduces the eager one
whatever order its modules are materialised in (Megatron-FSDP calls `reset_parameters()` unit by unit).

The draws happen under a fork of the CPU generator only: the tensor-parallel layers and the embeddings draw
their full master weight on the CPU, and the caller's generator state (dropout streams) is left untouched.
"""

import hashlib
import types
from contextlib import contextmanager

import torch

_SEED_MODULUS = 2**63


def resolve_base_init_seed(config) -> int:
    """`config.init_seed`, or the seed the default CPU generator was last seeded with when it is None."""
    init_seed = getattr(config, "init_seed", None)
    return int(init_seed) if init_seed is not None else int(torch.initial_seed())


def derive_init_seed(base_seed: int, *identity) -> int:
    """A seed for the module named by `identity` (strings / ints), stable across processes and runs."""
    text = "/".join(str(part) for part in (base_seed, *identity))
    digest = hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "little") % _SEED_MODULUS


@contextmanager
def initialization_rng(seed: int):
    """Run the body with the default CPU generator seeded with `seed`, restoring its previous state after."""
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(seed)
        yield


def _seeded_reset_parameters(module):
    with initialization_rng(module.init_seed):
        type(module).reset_parameters(module)


def build_with_init_seed(seed: int, build):
    """`build()` (a module whose random draws all happen in its `reset_parameters()`) drawn under `seed`.

    The returned module keeps the seed (`module.init_seed`) and its `reset_parameters()` re-seeds with it, so a
    later reset (meta-device materialisation) reproduces the values drawn at construction.
    """
    with initialization_rng(seed):
        module = build()
    module.init_seed = seed
    if hasattr(type(module), "reset_parameters"):
        module.reset_parameters = types.MethodType(_seeded_reset_parameters, module)
    return module


def reset_children_parameters(module: torch.nn.Module):
    """Call `reset_parameters()` of every strict submodule that owns parameters directly (each re-seeds itself)."""
    for submodule in module.modules():
        if submodule is module:
            continue
        if any(True for _ in submodule.parameters(recurse=False)) and hasattr(submodule, "reset_parameters"):
            submodule.reset_parameters()
