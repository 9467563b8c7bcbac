"""tools/checkpoint: inspect, torch.save / safetensors round trips, and legacy torch-format conversion.

A TP2 run (SwiGLU, untied output layer) writes the same state in both formats; the legacy conversion joins the
tensor-parallel partitions and must reproduce the torch_dist checkpoint's logical tensors exactly.
"""

import os
import re
import sys

import pytest
import torch

from tests.unit_tests.dist_checkpointing.pretrain_helpers import TrainingState
from tests.unit_tests.multiprocess_harness import run_on_ranks

TOOLS = os.path.join(os.path.dirname(__file__), "..", "..", "..", "tools", "checkpoint")


@pytest.fixture(scope="module")
def tools():
    sys.path.insert(0, os.path.abspath(TOOLS))
    import convert_checkpoint
    import convert_legacy
    import inspect_checkpoint

    yield convert_checkpoint, convert_legacy, inspect_checkpoint
    sys.path.remove(os.path.abspath(TOOLS))


def _save_both_formats(workdir, layout="--tensor-model-parallel-size 2"):
    from megatron.training import checkpointing

    state = TrainingState(f"{layout} --ckpt-format torch")
    state.train_steps(2)
    state.args.save = os.path.join(workdir, "legacy")
    checkpointing.save_checkpoint(2, state.model, state.optimizer, state.scheduler, state.args)
    state.args.ckpt_format, state.args.save = "torch_dist", os.path.join(workdir, "dist")
    checkpointing.save_checkpoint(2, state.model, state.optimizer, state.scheduler, state.args)
    state.close()


def test_checkpoint_tools(tmp_path, tools, capsys):
    from megatron.core.dist_checkpointing import offline, safetensors_format

    convert_checkpoint, convert_legacy, inspect_checkpoint = tools
    run_on_ranks(2, _save_both_formats, str(tmp_path))
    dist_root = str(tmp_path / "dist")
    reference = offline.read_checkpoint(os.path.join(dist_root, "iter_0000002"))
    model, optimizer, rest = offline.split_state(reference)
    # full SwiGLU fc1 (gate and up rows of 64 units), each TP rank having held 64 rows
    assert model["decoder.layers.3.mlp.linear_fc1.weight"].shape == (128, 32)
    assert rest["common"]["iteration"] == 2 and rest["common"]["layout"]["tensor_model_parallel_size"] == 2
    assert set(optimizer) >= {"optimizer.state.decoder.layers.0.mlp.linear_fc1.weight.exp_avg",
                              "optimizer.state.decoder.layers.0.mlp.linear_fc1.weight.exp_avg_sq"}

    # inspect
    lines = []
    inspect_checkpoint.inspect(dist_root, out=lines.append)
    text = "\n".join(lines)
    assert "iteration: 2" in text and "tensor_model_parallel_size: 2" in text and "wrapper: ddp" in text
    assert re.search(r"model\.decoder\.layers\.3\.mlp\.linear_fc1\.weight +float32 +128x32 +chunks=2", text)
    assert f"{len(model) + len(optimizer)} tensors" in text

    # torch.save and back: every key comes back equal
    convert_checkpoint.to_torch(dist_root, str(tmp_path / "full.pt"))
    saved = torch.load(tmp_path / "full.pt", weights_only=False)
    assert set(saved["model"]) == set(model) and all(v.dtype == torch.float32 for v in saved["model"].values())
    convert_checkpoint.from_torch(str(tmp_path / "full.pt"), str(tmp_path / "back"))
    back = offline.read_checkpoint(os.path.join(tmp_path, "back", "iter_0000002"))
    for key, value in reference.items():
        if key.startswith("rng_state."):
            assert key not in back
        elif torch.is_tensor(value):
            assert torch.equal(back[key], value), key
    assert back["scheduler"] == reference["scheduler"]
    assert back["optimizer.step"] == reference["optimizer.step"] == 2

    # safetensors and back (model only); the file is also readable by the safetensors package when installed
    path = str(tmp_path / "model.safetensors")
    convert_checkpoint.to_safetensors(dist_root, path)
    tensors, metadata = safetensors_format.load_file(path)
    assert metadata["iteration"] == "2" and all(torch.equal(tensors[k], v) for k, v in model.items())
    try:
        from safetensors.torch import load_file as reference_load_file
    except ImportError:
        reference_load_file = None
    if reference_load_file is not None:
        assert all(torch.equal(reference_load_file(path)[k], v) for k, v in model.items())
    convert_checkpoint.from_safetensors(path, str(tmp_path / "from_st"))
    from_st = offline.read_checkpoint(os.path.join(tmp_path, "from_st", "iter_0000002"))
    assert {k for k in from_st if k.startswith("model.")} == {f"model.{k}" for k in model}
    assert all(torch.equal(from_st[f"model.{k}"], v) for k, v in model.items())

    # legacy torch format -> logical: equal to what torch_dist wrote from the same state
    converted, iteration = convert_legacy.convert(str(tmp_path / "legacy"), str(tmp_path / "from_legacy"))
    assert iteration == 2 and set(converted) == set(model)
    for name, value in model.items():
        assert torch.equal(converted[name], value), name
    legacy_back = offline.read_checkpoint(os.path.join(tmp_path, "from_legacy", "iter_0000002"))
    assert legacy_back["scheduler"] == reference["scheduler"]


def test_legacy_conversion_of_pipeline_stages_with_tied_embeddings(tmp_path, tools):
    from megatron.core.dist_checkpointing import offline

    _, convert_legacy, _ = tools
    run_on_ranks(2, _save_both_formats, str(tmp_path), "TIED --pipeline-model-parallel-size 2")
    model, _, _ = offline.split_state(offline.read_checkpoint(os.path.join(tmp_path, "dist", "iter_0000002")))
    # Layers 2-3 come from the second stage; its tied output-layer copy is not a tensor of its own.
    assert "decoder.layers.3.mlp.linear_fc2.weight" in model and "output_layer.weight" not in model
    converted, _ = convert_legacy.convert(str(tmp_path / "legacy"), str(tmp_path / "from_legacy"))
    assert set(converted) == set(model)
    for name, value in model.items():
        assert torch.equal(converted[name], value), name
