"""One guard per optional accelerator library: `HAVE_TE`, `HAVE_APEX`, `HAVE_MODELOPT`.

Each is computed on first access (importing modelopt alone takes seconds) and is False on any failure:
transformer-engine raises RuntimeError, not ImportError, on machines without CUDA, and apex is only useful
when its CUDA extensions are built, so apex is detected by those extension modules, not by its package name.
"""

import functools
import importlib
import importlib.util

APEX_EXTENSION_MODULES = ("fused_layer_norm_cuda", "amp_C")


def _imports(module_name):
    try:
        importlib.import_module(module_name)
        return True
    except Exception:  # ImportError, and RuntimeError from GPU libraries on CPU-only machines
        return False


@functools.cache
def have_transformer_engine():
    return _imports("transformer_engine.pytorch")


@functools.cache
def have_apex():
    return all(_imports(name) for name in APEX_EXTENSION_MODULES)


@functools.cache
def have_modelopt():
    return _imports("modelopt.torch.quantization")


def modelopt_installed():
    """Whether modelopt and the packages it imports undeclared are installed, without importing them (fast
    enough for test-collection-time skip conditions; `HAVE_MODELOPT` is the authoritative import check)."""
    return all(importlib.util.find_spec(name) is not None for name in ("modelopt", "requests", "huggingface_hub"))


_GUARDS = {"HAVE_TE": have_transformer_engine, "HAVE_APEX": have_apex, "HAVE_MODELOPT": have_modelopt}


def __getattr__(name):
    if name in _GUARDS:
        return _GUARDS[name]()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
