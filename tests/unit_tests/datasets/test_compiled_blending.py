"""The compiled blending loop gives the Python loop's arrays, and the Python loop serves where no compiler works."""

import numpy as np
import pytest

from megatron.core.datasets import compiled_blending, utils

# Equal shares (ties every few samples), shares one ulp apart, a single dataset, many datasets.
WEIGHT_SETS = [[1.0], [1.0, 1.0, 1.0], [0.3, 0.7], [1 / 3, 1 / 3, 1 / 3], [0.5, np.nextafter(0.5, 1.0)],
               list(np.random.default_rng(0).random(5) + 1e-3), list(np.random.default_rng(1).random(40) + 1e-3)]


@pytest.fixture
def fresh_library(monkeypatch, tmp_path):
    """Compile into a directory of the test's own, looked up again in this test."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(compiled_blending, "_library", compiled_blending._UNTRIED)
    monkeypatch.setattr(compiled_blending.tempfile, "gettempdir", lambda: str(tmp_path / "tmp"))
    return tmp_path


@pytest.mark.parametrize("weights", WEIGHT_SETS, ids=lambda weights: f"{len(weights)}-datasets")
def test_compiled_loop_gives_the_python_loops_arrays(weights, fresh_library):
    if compiled_blending.compiled_blending_function() is None:
        pytest.skip("no working C compiler on this machine: the Python loop serves (tested below)")
    shares = [float(weight) for weight in utils.normalize_weights(weights, len(weights))]
    for size in (0, 1, 2, 3, 4097):
        for index_dtype in (np.int16, np.int64):
            expected = utils.build_blending_indices_in_python(shares, size, index_dtype)
            compiled = compiled_blending.build_blending_indices_compiled(shares, size, index_dtype)
            for want, got in zip(expected, compiled, strict=True):
                assert got.dtype == want.dtype and np.array_equal(got, want), (weights, size, index_dtype)
    # build_blending_indices itself takes the compiled path; its shares are each dataset's within one sample.
    dataset_index, sample_index = utils.build_blending_indices(weights, 4097)
    counts = np.bincount(dataset_index, minlength=len(weights))
    assert np.all(np.abs(counts - np.asarray(shares) * 4096) <= 1.0)
    assert all(np.array_equal(sample_index[dataset_index == d], np.arange(counts[d])) for d in range(len(weights)))
    compiled_files = list((fresh_library / "cache" / "megatron_core").iterdir())
    assert [path.suffix for path in compiled_files] == [".so"]  # no source or half-written object left behind


def test_without_a_compiler_the_python_loop_serves(fresh_library, monkeypatch):
    monkeypatch.setenv("CC", str(fresh_library / "no-such-compiler"))
    assert compiled_blending.compiled_blending_function() is None
    shares = [float(weight) for weight in utils.normalize_weights([0.2, 0.3, 0.5], 3)]
    expected = utils.build_blending_indices_in_python(shares, 500, np.int16)
    for want, got in zip(expected, utils.build_blending_indices([0.2, 0.3, 0.5], 500), strict=True):
        assert np.array_equal(got, want) and got.dtype == want.dtype
    assert not (fresh_library / "cache" / "megatron_core").exists()
