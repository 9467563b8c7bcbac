"""The optional-library guards: a failing import of any kind means "absent", and apex needs its CUDA extensions."""

import importlib
import sys
import types

import pytest

from megatron.core import optional_deps


@pytest.fixture
def fresh_guards():
    for guard in (optional_deps.have_transformer_engine, optional_deps.have_apex, optional_deps.have_modelopt):
        guard.cache_clear()
    yield
    for guard in (optional_deps.have_transformer_engine, optional_deps.have_apex, optional_deps.have_modelopt):
        guard.cache_clear()


def test_guard_treats_runtime_error_on_import_as_absent(fresh_guards, monkeypatch):
    real_import = importlib.import_module

    def import_raising_like_te_on_cpu(name, *args, **kwargs):
        if name.startswith("transformer_engine"):
            raise RuntimeError("Found empty transformer-engine meta package")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(optional_deps.importlib, "import_module", import_raising_like_te_on_cpu)
    assert optional_deps.HAVE_TE is False


def test_apex_package_without_cuda_extensions_is_absent(fresh_guards, monkeypatch):
    monkeypatch.setitem(sys.modules, "apex", types.ModuleType("apex"))
    for name in optional_deps.APEX_EXTENSION_MODULES:
        monkeypatch.delitem(sys.modules, name, raising=False)
    assert optional_deps.HAVE_APEX is False


def test_apex_with_its_extensions_is_present(fresh_guards, monkeypatch):
    for name in optional_deps.APEX_EXTENSION_MODULES:
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    assert optional_deps.HAVE_APEX is True


def test_guard_reports_an_importable_module_as_present(fresh_guards, monkeypatch):
    monkeypatch.setitem(sys.modules, "modelopt", types.ModuleType("modelopt"))
    monkeypatch.setitem(sys.modules, "modelopt.torch", types.ModuleType("modelopt.torch"))
    monkeypatch.setitem(sys.modules, "modelopt.torch.quantization", types.ModuleType("modelopt.torch.quantization"))
    assert optional_deps.HAVE_MODELOPT is True


def test_unknown_guard_name_raises_attribute_error():
    with pytest.raises(AttributeError, match="HAVE_NOTHING"):
        optional_deps.HAVE_NOTHING
