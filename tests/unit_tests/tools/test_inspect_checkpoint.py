"""tools/checkpoint/inspect_checkpoint.py on directories without metadata.json and on legacy torch-format ones."""

import os
import shutil
import sys

import pytest
import torch

TOOLS = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "..", "tools", "checkpoint"))
LAYOUT = {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 1, "data_parallel_size": 3,
          "world_size": 6, "wrapper": "megatron_fsdp:optim_grads_params", "ckpt_format": "torch_dist"}


@pytest.fixture(scope="module")
def inspect_checkpoint():
    sys.path.insert(0, TOOLS)
    import inspect_checkpoint

    yield inspect_checkpoint
    sys.path.remove(TOOLS)


def _inspect(tool, path):
    lines = []
    rows = tool.inspect(str(path), out=lines.append)
    return rows, "\n".join(lines)


def test_layout_comes_from_common_without_metadata_json(tmp_path, inspect_checkpoint):
    from megatron.core.dist_checkpointing import offline

    state = {"model.embedding.word_embeddings.weight": torch.arange(12.0).view(4, 3),
             "common": {"iteration": 7, "layout": LAYOUT}}
    offline.write_checkpoint(str(tmp_path), 7, state, LAYOUT)
    assert "iteration: 7\nlayout (from metadata.json):" in _inspect(inspect_checkpoint, tmp_path)[1]
    os.remove(tmp_path / "iter_0000007" / "metadata.json")  # e.g. a copy of the DCP files alone
    rows, text = _inspect(inspect_checkpoint, tmp_path)
    assert "iteration: 7\nlayout (from the checkpoint's common entry (no metadata.json)):" in text
    for key, value in LAYOUT.items():
        assert f"\n  {key}: {value}\n" in text
    assert rows == [("common", None, "object", 1), ("model.embedding.word_embeddings.weight", (4, 3), "float32", 1)]


def test_legacy_directory_is_named_with_the_conversion_command(tmp_path, inspect_checkpoint):
    for rank in ("mp_rank_00", "mp_rank_01"):
        os.makedirs(tmp_path / "iter_0000002" / rank)
        torch.save({"model": {"w": torch.zeros(2)}}, tmp_path / "iter_0000002" / rank / "model_optim_rng.pt")
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("2")
    rows, text = _inspect(inspect_checkpoint, tmp_path)
    assert rows == []
    assert ("legacy --ckpt-format torch checkpoint: one directory per model-parallel rank (mp_rank_00, "
            "mp_rank_01), not the logical torch_dist format") in text
    assert f"python tools/checkpoint/convert_legacy.py --input {tmp_path} --output NEW_ROOT" in text
    size = os.path.getsize(tmp_path / "iter_0000002" / "mp_rank_01" / "model_optim_rng.pt")
    assert f"mp_rank_01/model_optim_rng.pt  {size} bytes" in text
    # The iteration directory itself says the same.
    shutil.copytree(tmp_path / "iter_0000002", tmp_path / "copy")
    _, text = _inspect(inspect_checkpoint, tmp_path / "copy")
    assert f"--input {tmp_path / 'copy'} --output NEW_ROOT" in text


def test_other_directories_and_files_are_named_with_what_to_run(tmp_path, inspect_checkpoint):
    hf_dir, empty_dir, a_file = tmp_path / "hf", tmp_path / "empty", tmp_path / "full.pt"
    os.makedirs(hf_dir)
    os.makedirs(empty_dir)
    (hf_dir / "config.json").write_text("{}")
    a_file.write_bytes(b"not a directory")
    for path, expected in [
        (hf_dir, f"checkpoint {hf_dir}: a Hugging Face model directory, not a torch_dist checkpoint; import it with: "
                 f"python tools/checkpoint/convert_checkpoint.py --from hf --input {hf_dir} --output NEW_ROOT"),
        (empty_dir, f"checkpoint {empty_dir}: not a torch_dist checkpoint ({empty_dir} has no .metadata); give the "
                    "root that --save wrote"),
        (a_file, f"checkpoint {a_file}: a file, not a checkpoint directory"),
    ]:
        with pytest.raises(SystemExit) as exit_info:
            inspect_checkpoint.main([str(path)])
        assert exit_info.value.code.startswith(expected), exit_info.value.code
