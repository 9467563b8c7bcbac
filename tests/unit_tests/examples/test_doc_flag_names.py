"""Every `--flag` the training docs quote is a flag of `pretrain_gpt.py`, or one of the few flags of another program
the doc names beside it (tools/preprocess_data.py, tools/checkpoint/*.py, the benchmark programs, upstream switches
the doc lists as not done). A misspelled or invented flag in the prose fails here."""

import re
from pathlib import Path

import pytest

from megatron.training.arguments import build_parser

DOCS = Path(__file__).resolve().parents[3] / "docs"

# A flag, not a prefix such as `--muon-*` or `--no-align-*`.
FLAG = re.compile(r"(?<![\w-])(--[a-z][a-z0-9_-]*[a-z0-9_])(?![\w*-]|-\*)")

PREPROCESS_DATA = {"--input", "--output-prefix", "--json-keys", "--workers", "--partitions",
                   "--keep-sequential-samples", "--split-sentences", "--lang", "--keep-newlines",
                   "--vocab-extra-ids", "--multimodal"}
CONVERT_CHECKPOINT = {"--to", "--from", "--input", "--output", "--hf-architecture", "--hf-dtype"}
UPSTREAM_CONVERT = {"--model-type", "--loader", "--saver", "--checkpoint-type", "--model-size", "--load-dir",
                    "--save-dir", "--target-tensor-parallel-size", "--target-pipeline-parallel-size",
                    "--target-tensor", "--true-vocab-size", "--megatron-path", "--max-queue-size", "--no-checking"}

TORCHRUN = {"--max-restarts", "--rdzv-backend", "--rdzv-endpoint", "--rdzv-id", "--nnodes", "--node-rank",
            "--nproc-per-node", "--master-addr", "--master-port", "--standalone"}

OTHER_PROGRAMS = {
    "training_flags.md": PREPROCESS_DATA | {"--to", "--from", "--world", "--wrappers"},
    "moe.md": {"--to"},  # convert_checkpoint.py --to hf
    "offloading.md": {"--arms", "--tiny", "--cpu-offloading-activations", "--cpu-offloading-weights"},
    "multi_token_prediction.md": set(),
    "checkpointing.md": CONVERT_CHECKPOINT | UPSTREAM_CONVERT | TORCHRUN,
}


@pytest.fixture(scope="module")
def pretrain_flags():
    return {option for action in build_parser()._actions for option in action.option_strings}


@pytest.mark.parametrize("doc", sorted(OTHER_PROGRAMS))
def test_quoted_flags_exist(doc, pretrain_flags):
    quoted = re.findall(r"`([^`]*)`", (DOCS / doc).read_text(), flags=re.S)
    flags = {flag for span in quoted for flag in FLAG.findall(span)}
    unknown = sorted(flags - pretrain_flags - OTHER_PROGRAMS[doc])
    assert unknown == [], f"docs/{doc} quotes flags pretrain_gpt.py does not have: {unknown}"


def test_flag_pattern_reads_names_not_prefixes():
    assert FLAG.findall("`--moe-router-bias` and `--muon-*`, `--no-align-*`, `--override-opt_param-scheduler`") == [
        "--moe-router-bias", "--override-opt_param-scheduler"]
