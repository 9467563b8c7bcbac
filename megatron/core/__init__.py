"""Megatron-Core-style building blocks: parallel state, tensor-parallel layers, GPT model, optimizer, FSDP.

Upstream's package-level names are offered lazily (importing the package stays cheap): `mpu` is
`parallel_state` and `InferenceParams` the static-batch key/value cache (`inference_params`).
"""

_LAZY_MODULES = {"mpu": "megatron.core.parallel_state"}
_LAZY_NAMES = {"InferenceParams": "megatron.core.inference_params"}


def __getattr__(name):
    import importlib

    if name in _LAZY_MODULES:
        return importlib.import_module(_LAZY_MODULES[name])
    if name in _LAZY_NAMES:
        return getattr(importlib.import_module(_LAZY_NAMES[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
