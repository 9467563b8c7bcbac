"""Small pure helpers of the dataset layer: splits, `--data-path` blends, blending schedules, cache files.

Nothing here imports torch, so the preprocessing tools stay quick to start.
"""

import enum
import hashlib
import json
import os
import uuid

import numpy as np

from megatron.core.datasets.compiled_blending import build_blending_indices_compiled


class Split(enum.Enum):
    train = 0
    valid = 1
    test = 2


def sample_position(idx, size, what):
    """`idx` as a position in `[0, size)`: negative indices count from the end, as numpy's (and so upstream's
    datasets') do; anything else out of range raises IndexError naming `what`."""
    position = int(idx)
    if position < 0:
        position += size
    if not 0 <= position < size:
        raise IndexError(f"sample {idx} out of range for {what} of {size} samples")
    return position


def parse_split(split):
    """`"969,30,1"` (or `"98/2/0"`, or fewer numbers padded with zeros) -> three fractions summing to 1."""
    text = str(split).replace("/", ",")
    try:
        parts = [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"--split {split!r} must be comma-separated numbers, e.g. 969,30,1") from None
    if not 1 <= len(parts) <= 3:
        raise ValueError(f"--split {split!r} must have one to three numbers (train, valid, test)")
    if any(part < 0 for part in parts) or sum(parts) <= 0:
        raise ValueError(f"--split {split!r} must be non-negative numbers with a positive sum")
    parts += [0.0] * (3 - len(parts))
    total = sum(parts)
    return tuple(part / total for part in parts)


def split_document_ranges(num_documents, split_fractions):
    """[(begin, end)] document ranges for train, valid, test: contiguous, disjoint, covering everything.

    Boundaries are the rounded cumulative fractions, so each split gets its share within half a document.
    """
    cumulative = np.cumsum(split_fractions)
    bounds = [0] + [int(round(fraction * num_documents)) for fraction in cumulative[:-1]] + [num_documents]
    return [(bounds[i], bounds[i + 1]) for i in range(3)]


def blend_from_data_path(data_path):
    """`--data-path` values -> (prefixes, weights or None).

    Accepts `["prefix"]`, `["p1", "p2"]` (equal weights, returned as None) and `["0.3", "p1", "0.7", "p2"]`.
    """
    values = [str(value).strip() for value in data_path]
    if not values:
        raise ValueError("--data-path is empty; give one or more dataset prefixes (optionally with weights)")

    def is_number(text):
        try:
            float(text)
            return True
        except ValueError:
            return False

    if len(values) % 2 == 0 and all(is_number(value) for value in values[0::2]):
        weights = [float(value) for value in values[0::2]]
        return list(values[1::2]), weights
    if any(is_number(value) for value in values):
        raise ValueError(f"--data-path {' '.join(values)}: give either prefixes only or 'weight prefix' pairs")
    return values, None


def normalize_weights(weights, count):
    if weights is None:
        return np.full(count, 1.0 / count)
    weights = np.asarray(weights, dtype=np.float64)
    if weights.shape != (count,) or np.any(weights <= 0) or not np.all(np.isfinite(weights)):
        raise ValueError(f"--data-path weights {weights.tolist()} must be {count} positive numbers")
    return weights / weights.sum()


def build_blending_indices(weights, size):
    """Assign `size` blended samples to datasets: (dataset index, sample index within that dataset) arrays.

    Greedy, as Megatron-Core's `build_blending_indices`: sample i goes to the dataset furthest behind its target
    share `weight * max(i, 1)` (the samples placed before it; sample 0 counts as 1), ties to the lowest index, so
    a given blend serves the same datasets in the same order as upstream. After sample i is placed, each dataset's
    count is within one sample of `weight * max(i, 1)`.

    The weights are divided by their sum here, once: near-ties are decided by the last bit of the shares, so a
    caller that needs upstream's shares bit for bit passes what upstream's `BlendedDataset` normalises (the
    builder's once-normalised weights for a weighted `--data-path`, the datasets' sizes for one without weights).
    The loop runs compiled where a C compiler is available (`compiled_blending.py`), else in Python.
    """
    weights = [float(weight) for weight in normalize_weights(weights, len(weights))]
    index_dtype = np.int16 if len(weights) < 2**15 else np.int64
    compiled = build_blending_indices_compiled(weights, size, index_dtype)  # compiled_blending.py: same arrays
    if compiled is not None:
        return compiled
    return build_blending_indices_in_python(weights, size, index_dtype)


def build_blending_indices_in_python(weights, size, index_dtype):
    """The greedy loop of `build_blending_indices` over already normalised `weights`, in Python."""
    counts = [0] * len(weights)
    dataset_index = np.empty(size, dtype=index_dtype)
    dataset_sample_index = np.empty(size, dtype=np.int64)
    candidates = range(len(weights))
    for sample in range(size):
        placed = max(sample, 1)
        chosen = max(candidates, key=lambda d: weights[d] * placed - counts[d])
        dataset_index[sample] = chosen
        dataset_sample_index[sample] = counts[chosen]
        counts[chosen] += 1
    return dataset_index, dataset_sample_index


def description_hash(description):
    """Stable hash of a JSON-serialisable description (the cache key of index files)."""
    return hashlib.md5(json.dumps(description, sort_keys=True).encode("utf-8")).hexdigest()


def _write_atomically(path, mode, write):
    """`write(stream)` into a fresh file beside `path`, then renamed onto it.

    The file is created with the permissions the umask leaves (as `open` would), not `mkstemp`'s owner-only
    0600, so the other users and jobs that share a --data-cache-path can read the index files.
    """
    temporary = os.path.join(os.path.dirname(path), f".{uuid.uuid4().hex}.tmp")
    handle = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(handle, mode) as output:
            write(output)
        os.replace(temporary, path)
    except BaseException:
        if os.path.exists(temporary):
            os.unlink(temporary)
        raise


# Part of every index cache key: raise it whenever the arrays built for a description change (the epochs a dataset
# holds, the blending schedule, ...), so that a cache directory filled by earlier code is not served to this one.
INDEX_CACHE_FORMAT = 2


def load_or_build_indices(path_to_cache, kind, description, build):
    """Index arrays for `description`, from `path_to_cache` when present there, else from `build()`.

    `build()` returns {name: array}. Files are `<hash>-<kind>-<name>.npy` plus `<hash>-<kind>-description.json`,
    written through a temporary file and a rename so a concurrent reader never sees half a file. The hash covers
    `description` and `INDEX_CACHE_FORMAT`. Returns (arrays, loaded_from_cache).
    """
    if path_to_cache is None:
        return build(), False
    description = {**description, "index_cache_format": INDEX_CACHE_FORMAT}
    try:
        os.makedirs(path_to_cache, exist_ok=True)
    except OSError as error:
        raise OSError(f"--data-cache-path {path_to_cache}: cannot use it as the dataset index cache directory "
                      f"({error.strerror}): give a directory, or a path where one can be created") from error
    stem = os.path.join(path_to_cache, f"{description_hash(description)}-{kind}")
    description_path = f"{stem}-description.json"
    if os.path.isfile(description_path):
        with open(description_path) as description_file:
            names = json.load(description_file)["arrays"]
        paths = {name: f"{stem}-{name}.npy" for name in names}
        if all(os.path.isfile(path) for path in paths.values()):
            return {name: np.load(path, mmap_mode="r", allow_pickle=False) for name, path in paths.items()}, True
    arrays = build()
    for name, array in arrays.items():
        _write_atomically(f"{stem}-{name}.npy", "wb",
                          lambda output, array=array: np.save(output, np.asarray(array), allow_pickle=False))
    _write_atomically(description_path, "w", lambda output: json.dump(
        {"description": description, "arrays": sorted(arrays)}, output, indent=2, sort_keys=True))
    return arrays, False


def get_blend_from_list(blend):
    """Megatron-Core's name for the `--data-path` parser: None (no `--data-path`, e.g. `--mock-data`) gives None,
    as upstream's, so a provider may pass `args.data_path` through unconditionally."""
    return None if blend is None else blend_from_data_path(blend)


def compile_helpers():
    """Upstream compiles its C++ index helpers here; the indices are built with numpy, so there is nothing to
    compile and scripts that call this first keep working."""
