"""The commands README.md, docs/*.md and the examples' READMEs give run the programs they name: a quoted
`tools/...` or `examples/...` command names a file (not a directory), and launches of the tiny CPU script choose
their data-parallel wrapper with DP_WRAPPER, which the script turns into the wrapper's flags; the FP8 README's
quantization launch gives the flags argument validation requires."""

import os
import re
from pathlib import Path
from unittest import mock

import pytest

REPO = Path(__file__).resolve().parents[3]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), *sorted((REPO / "examples").glob("*/README.md"))]

# `tools/checkpoint/convert_checkpoint.py --to hf`, `bash examples/gpt/train_gpt_tiny_cpu.sh --mtp-num-layers 1`:
# a repository path followed by a flag is a command line.
COMMAND = re.compile(r"(?<![\w/.-])((?:tools|examples)/[\w./-]*?)/? --[a-z]")
TINY_SCRIPT = re.compile(r"train_gpt_tiny_cpu\.sh((?:\\\n|[^\n`])*)")
WRAPPER_FLAGS = ("--use-distributed-optimizer", "--use-megatron-fsdp", "--use-torch-fsdp2", "--use-custom-fsdp")


def _doc_id(path):
    return str(path.relative_to(REPO))


@pytest.mark.parametrize("doc", DOCS, ids=_doc_id)
def test_quoted_commands_name_files(doc):
    text = doc.read_text()
    not_files = sorted({path for path in COMMAND.findall(text) if not (REPO / path).is_file()})
    assert not_files == [], f"{_doc_id(doc)} gives commands whose program is not a file: {not_files}"


@pytest.mark.parametrize("doc", DOCS, ids=_doc_id)
def test_tiny_script_launches_pick_the_wrapper_with_dp_wrapper(doc):
    launches = TINY_SCRIPT.findall(doc.read_text())
    wrong = [" ".join(args.split()) for args in launches if any(flag in args.split() for flag in WRAPPER_FLAGS)]
    assert wrong == [], (f"{_doc_id(doc)} passes a data-parallel wrapper flag to train_gpt_tiny_cpu.sh, which adds "
                         f"its own (Megatron-FSDP unless DP_WRAPPER=ddp|distopt|fsdp2 says otherwise): {wrong}")


def test_patterns_read_commands():
    assert COMMAND.findall("`tools/checkpoint --to hf`, `tools/checkpoint/convert.py --loader core`, "
                           "`examples/gpt/x.sh`") == ["tools/checkpoint", "tools/checkpoint/convert.py"]
    assert [a.split() for a in TINY_SCRIPT.findall("bash examples/gpt/train_gpt_tiny_cpu.sh --fp8-format hybrid \\\n"
                                                   "    --use-distributed-optimizer\n```")] == [
        ["--fp8-format", "hybrid", "\\", "--use-distributed-optimizer"]]


def test_fp8_readme_quantize_command_passes_argument_validation():
    """The PTQ launch in examples/fp8/README.md, its model placeholder filled in, gives every flag pretrain_gpt.py's
    validation requires (quantize.py validates as training does; its own flags are left to its tests)."""
    from megatron.training.arguments import parse_args, validate_args

    text = (REPO / "examples" / "fp8" / "README.md").read_text()
    launch = re.search(r"examples/post_training/quantize\.py((?:\\\n|[^\n])*)", text).group(1).replace("\\\n", " ")
    model = "--num-layers 2 --hidden-size 64 --num-attention-heads 2 --seq-length 32 --max-position-embeddings 32"
    argv = launch.replace("<the model's flags>", model).split()
    with mock.patch.dict(os.environ, {"WORLD_SIZE": "2", "RANK": "0"}):
        args = validate_args(parse_args(ignore_unknown_args=True, args=argv))
    assert (args.micro_batch_size, args.global_batch_size, args.train_iters, args.load) == (4, 8, 1, "CKPT")
