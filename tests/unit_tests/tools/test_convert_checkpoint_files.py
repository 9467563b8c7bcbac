"""`convert_checkpoint.py --to torch / --to safetensors` write their one file where `--output` says: its directory is
created when missing, and a directory given as `--output` is refused naming a file to write instead."""

import os

import pytest
import torch

WEIGHT = "decoder.final_layernorm.weight"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A torch_dist checkpoint of iteration 3 holding one model tensor; (its root, the tensor)."""
    from megatron.core.dist_checkpointing import offline

    root = str(tmp_path_factory.mktemp("checkpoint") / "root")
    weight = torch.arange(6, dtype=torch.float32)
    offline.write_checkpoint(root, 3, {f"model.{WEIGHT}": weight, "common": {"iteration": 3}}, {})
    return root, weight


def test_file_outputs_go_in_a_directory_that_did_not_exist(tools, checkpoint, tmp_path, capsys):
    from megatron.core.dist_checkpointing import safetensors_format

    convert_checkpoint, _ = tools
    root, weight = checkpoint
    full = tmp_path / "exports" / "torch" / "full.pt"
    convert_checkpoint.main(["--to", "torch", "--input", root, "--output", str(full)])
    assert torch.equal(torch.load(full, weights_only=False)["model"][WEIGHT], weight)
    single = tmp_path / "exports" / "st" / "model.safetensors"
    convert_checkpoint.main(["--to", "safetensors", "--input", root, "--output", str(single)])
    assert torch.equal(safetensors_format.load_file(str(single))[0][WEIGHT], weight)
    assert capsys.readouterr().out == f"wrote {full}\nwrote {single}\n"


@pytest.mark.parametrize("direction, suffix", [("torch", "pt"), ("safetensors", "safetensors")])
def test_a_directory_as_the_output_file_is_refused(tools, checkpoint, tmp_path, capsys, direction, suffix):
    convert_checkpoint, _ = tools
    with pytest.raises(SystemExit):
        convert_checkpoint.main(["--to", direction, "--input", checkpoint[0], "--output", str(tmp_path)])
    assert (f"error: --output {tmp_path}: a directory; --to {direction} writes one file, such as "
            f"{os.path.join(tmp_path, 'model.' + suffix)}") in capsys.readouterr().err
    assert os.listdir(tmp_path) == []
