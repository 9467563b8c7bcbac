"""The blending schedule's greedy loop (`utils.build_blending_indices`) compiled with the system's C compiler at
first use, as upstream compiles its dataset helpers, and called through ctypes: a blend of tens of millions of
samples takes seconds instead of minutes of Python. Where no compiler works the caller runs the Python loop,
which gives the same arrays.

The C code does the Python loop's arithmetic in the same order on IEEE doubles (`weight * placed - count`, no
fused multiply-add, ties to the lowest index), so both choose the same dataset for every sample. The shared
object is cached under `$XDG_CACHE_HOME/megatron_core` (default `~/.cache`), else the temporary directory, named
by the hash of the source, and written through a rename so that ranks compiling at once never load half a file.
"""

import ctypes
import hashlib
import os
import shlex
import shutil
import subprocess
import tempfile
import uuid
from typing import Optional

import numpy as np

_SOURCE = r"""
#include <stdint.h>

void build_blending_indices(const double *weights, int64_t count, int64_t size, int64_t *counts,
                            void *dataset_index, int32_t narrow_index, int64_t *dataset_sample_index) {
    int16_t *narrow = (int16_t *)dataset_index;
    int64_t *wide = (int64_t *)dataset_index;
    for (int64_t sample = 0; sample < size; ++sample) {
        double placed = sample > 1 ? (double)sample : 1.0;
        int64_t chosen = 0;
        double best = weights[0] * placed - (double)counts[0];
        for (int64_t dataset = 1; dataset < count; ++dataset) {
            double error = weights[dataset] * placed - (double)counts[dataset];
            if (error > best) {
                best = error;
                chosen = dataset;
            }
        }
        if (narrow_index) {
            narrow[sample] = (int16_t)chosen;
        } else {
            wide[sample] = chosen;
        }
        dataset_sample_index[sample] = counts[chosen];
        counts[chosen] += 1;
    }
}
"""

_COMPILE_FLAGS = ["-O2", "-shared", "-fPIC", "-ffp-contract=off", "-fno-fast-math"]
_UNTRIED = object()
_library = _UNTRIED


def _cache_directories():
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return [os.path.join(base, "megatron_core"), os.path.join(tempfile.gettempdir(), "megatron_core")]


def _compile_into(directory: str, name: str) -> Optional[str]:
    command = shlex.split(os.environ.get("CC") or "cc")  # $CC may carry options, e.g. "gcc -m64"
    compiler = shutil.which(command[0]) if command else None
    if compiler is None:
        return None
    os.makedirs(directory, exist_ok=True)
    target = os.path.join(directory, name)
    if os.path.isfile(target):
        return target
    stem = os.path.join(directory, f".{uuid.uuid4().hex}")
    with open(f"{stem}.c", "w") as source:
        source.write(_SOURCE)
    try:
        subprocess.run([compiler, *command[1:], *_COMPILE_FLAGS, "-o", f"{stem}.so", f"{stem}.c"], check=True,
                       capture_output=True, timeout=120)
        os.replace(f"{stem}.so", target)
    finally:
        for leftover in (f"{stem}.c", f"{stem}.so"):
            if os.path.exists(leftover):
                os.remove(leftover)
    return target


def _load():
    name = f"blending_{hashlib.sha256((_SOURCE + ' '.join(_COMPILE_FLAGS)).encode()).hexdigest()[:16]}.so"
    for directory in _cache_directories():
        try:
            path = _compile_into(directory, name)
            if path is None:
                return None
            library = ctypes.CDLL(path)
        except (OSError, subprocess.SubprocessError):
            continue
        function = library.build_blending_indices
        function.restype = None
        function.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
                             ctypes.c_int32, ctypes.c_void_p]
        return function
    return None


def compiled_blending_function():
    """The compiled loop, or None where it cannot be built (looked up once per process)."""
    global _library
    if _library is _UNTRIED:
        _library = _load()
    return _library


def build_blending_indices_compiled(normalised_weights, size, index_dtype):
    """(dataset index, sample index within that dataset) arrays from the compiled loop, or None without it.
    `normalised_weights`: the shares `utils.build_blending_indices` computed."""
    function = compiled_blending_function()
    if function is None:
        return None
    weights = np.ascontiguousarray(normalised_weights, dtype=np.float64)
    counts = np.zeros(len(weights), dtype=np.int64)
    dataset_index = np.empty(size, dtype=index_dtype)
    dataset_sample_index = np.empty(size, dtype=np.int64)
    narrow = dataset_index.dtype == np.int16
    if not narrow and dataset_index.dtype != np.int64:
        raise ValueError(f"the blending schedule's dataset index is int16 or int64, not {dataset_index.dtype}")
    function(weights.ctypes.data, len(weights), size, counts.ctypes.data, dataset_index.ctypes.data, int(narrow),
             dataset_sample_index.ctypes.data)
    return dataset_index, dataset_sample_index
