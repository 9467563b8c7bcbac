"""examples/llama/train_llama_nemotron_nas_tiny_cpu.sh, with torchrun replaced by a program that records its
arguments: the flags pass pretrain_gpt.py's validation on 2 ranks and build the layers of the shipped config."""

import os
import stat
import subprocess
from pathlib import Path
from unittest import mock

from megatron.training.arguments import parse_args, validate_args
from megatron.training.model_config import core_transformer_config_from_args

REPO = Path(__file__).resolve().parents[3]
SCRIPT = REPO / "examples" / "llama" / "train_llama_nemotron_nas_tiny_cpu.sh"


def _recorded_flags(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    recorder = bin_dir / "torchrun"
    recorder.write_text('#!/usr/bin/env bash\nprintf "%s\\n" "$@" > "$TORCHRUN_ARGS"\n')
    recorder.chmod(recorder.stat().st_mode | stat.S_IEXEC)
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "stdlib_docs_text_document.idx").touch()  # the corpus counts as tokenized: no preprocessing
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "CACHE_DIR": str(cache),
           "OUTPUT_DIR": str(tmp_path / "out"), "TORCHRUN_ARGS": str(tmp_path / "args")}
    subprocess.run(["bash", str(SCRIPT)], env=env, check=True, capture_output=True)
    words = (tmp_path / "args").read_text().splitlines()
    return words[words.index("pretrain_gpt.py") + 1:]


def test_the_example_builds_the_layers_of_its_config(tmp_path):
    flags = _recorded_flags(tmp_path)
    with mock.patch.dict(os.environ, {"WORLD_SIZE": "2", "RANK": "0"}):
        args = validate_args(parse_args(args=flags))
    config = core_transformer_config_from_args(args)
    shapes = [(block.attention.num_query_groups if block.attention.is_attention else
               "linear" if block.attention.replace_with_linear else None,
               block.mlp.ffn_hidden_size if block.mlp.is_mlp else "linear" if block.mlp.replace_with_linear else None)
              for block in config.heterogeneous_block_configs]
    assert shapes == [(2, 512), (None, 256), ("linear", 512), (4, "linear")]
