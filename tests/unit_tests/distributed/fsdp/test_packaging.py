"""The standalone package builds and imports on its own: `pip install megatron/core/distributed/fsdp/src` gives
`megatron_fsdp` with every module of the source tree, torch as its only dependency, and the version of
`package_info.py`; imported from the built wheel, it loads nothing of the `megatron` training stack."""

import email.parser
import importlib
import os
import shutil
import subprocess
import sys
import zipfile

import pytest

import megatron_fsdp

REPOSITORY = os.path.abspath(os.path.join(os.path.dirname(__file__), *[os.pardir] * 4))
SOURCE_ROOT = os.path.join(REPOSITORY, "megatron", "core", "distributed", "fsdp", "src")


def _source_modules():
    package_dir = os.path.join(SOURCE_ROOT, "megatron_fsdp")
    modules = set()
    for directory, _, files in os.walk(package_dir):
        for name in files:
            if name.endswith(".py"):
                modules.add(os.path.relpath(os.path.join(directory, name), SOURCE_ROOT).replace(os.sep, "/"))
    return modules


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    out = tmp_path_factory.mktemp("wheel")
    # setuptools writes its egg-info and build tree beside the sources: build from a copy, not in the repository.
    source = tmp_path_factory.mktemp("source") / "src"
    shutil.copytree(SOURCE_ROOT, source, ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "build", "*.egg-info"))
    result = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--quiet", "-w", str(out),
         str(source)],
        capture_output=True, text=True, cwd=source,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    wheels = list(out.glob("megatron_fsdp-*.whl"))
    assert len(wheels) == 1, os.listdir(out)
    return wheels[0]


def test_wheel_holds_every_module_and_depends_on_torch_only(wheel):
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        metadata_name = next(name for name in names if name.endswith(".dist-info/METADATA"))
        metadata = email.parser.Parser().parsestr(archive.read(metadata_name).decode())
    assert {name for name in names if name.endswith(".py")} == _source_modules()
    assert metadata["Name"] == "megatron-fsdp"
    assert metadata["Version"] == megatron_fsdp.package_info.__version__
    requirements = metadata.get_all("Requires-Dist") or []
    assert [requirement.split(">")[0].split("=")[0].strip() for requirement in requirements] == ["torch"]


def test_wheel_imports_without_the_training_stack(wheel, tmp_path):
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(tmp_path / "site")
    probe = (
        "import sys, megatron_fsdp\n"
        "print(megatron_fsdp.__file__)\n"
        "print(sorted(name for name in sys.modules if name == 'megatron' or name.startswith('megatron.')))\n"
        "print(megatron_fsdp.fully_shard.__module__, megatron_fsdp.__version__)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "site")}
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=tmp_path, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    location, stack_modules, api = result.stdout.splitlines()
    assert location.startswith(str(tmp_path / "site")), location
    assert stack_modules == "[]"
    assert api == f"megatron_fsdp.fully_shard {megatron_fsdp.package_info.__version__}"


def test_a_submodule_imports_without_the_rest_of_the_package(tmp_path):
    # Gloo worker processes import `megatron_fsdp.collectives` alone.
    probe = (
        "import sys, megatron_fsdp.collectives\n"
        "print(sorted(name for name in sys.modules if name.startswith('megatron_fsdp')))\n"
        "print('torch.distributed.tensor' in sys.modules)\n"
    )
    env = {**os.environ, "PYTHONPATH": SOURCE_ROOT}
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=tmp_path, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    loaded, dtensor_loaded = result.stdout.splitlines()
    assert loaded == str(["megatron_fsdp", "megatron_fsdp.collectives", "megatron_fsdp.package_info",
                          "megatron_fsdp.utils"])
    assert dtensor_loaded == "False"


def test_public_names_are_those_of_their_submodules(monkeypatch):
    homes = {"fully_shard": "fully_shard", "fully_shard_model": "fully_shard", "fully_shard_optimizer": "fully_shard",
             "MegatronFSDP": "megatron_fsdp", "FSDPDistributedIndex": "distributed_index",
             "MixedPrecisionPolicy": "mixed_precision",
             "NcclUserBuffers": "nccl_allocator", "GatherCodec": "gather_codec", "GatherCodecPolicy": "gather_codec",
             "DistributedDataParallelConfig": "distributed_data_parallel_config",
             "ShardingStrategy": "distributed_data_parallel_config", "clip_grad_norm_": "optimizer"}
    assert sorted(megatron_fsdp.__all__) == sorted(list(homes) + ["package_info"])
    for name, home in homes.items():
        assert getattr(megatron_fsdp, name) is getattr(importlib.import_module(f"megatron_fsdp.{home}"), name), name
    assert megatron_fsdp.utils is importlib.import_module("megatron_fsdp.utils")
    assert megatron_fsdp.utils.FSDPDistributedIndex is megatron_fsdp.FSDPDistributedIndex  # upstream's path
    # Importing the submodule `megatron_fsdp.fully_shard` sets the package attribute of that name to it; the
    # attribute stays the function, as `megatron_fsdp.fully_shard(model, optimizer, ...)` calls it.
    function = megatron_fsdp.fully_shard
    monkeypatch.setattr(megatron_fsdp, "fully_shard", sys.modules["megatron_fsdp.fully_shard"])
    assert megatron_fsdp.fully_shard is function
