"""The upstream recipes' command line (examples/recipe_launch.sh): extra arguments are pretrain_gpt.py flags, and
upstream's positional arguments (checkpoint and TensorBoard directories, tokenizer, data) stop the script with the
environment variables that take their place here."""

import os
import subprocess
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[3]
# Each recipe and the variables that hold what upstream's version of it takes as positional arguments.
RECIPES = {
    "gpt3/train_gpt3_175b_distributed.sh": ("CHECKPOINT_DIR", "TENSORBOARD_DIR", "VOCAB_FILE", "MERGE_FILE",
                                            "DATA_PATH"),
    "llama/train_llama3_8b.sh": ("CHECKPOINT_DIR", "TENSORBOARD_DIR", "TOKENIZER_MODEL", "DATA_PATH"),
    "mixtral/train_mixtral_8x7b_distributed.sh": ("CHECKPOINT_DIR", "TOKENIZER_MODEL", "DATA_PATH"),
    "deepseek_v3/train_deepseek_v3_proxy.sh": ("CHECKPOINT_DIR", "OUTPUT_DIR", "TOKENIZER_MODEL", "DATA_PATH"),
    "gpt_oss/train_gpt_oss_20b.sh": ("CHECKPOINT_DIR", "TENSORBOARD_DIR", "TOKENIZER_MODEL", "DATA_PATH"),
    "megatron_fsdp/train_llama3_fsdp_cpu.sh": ("CHECKPOINT_DIR", "TENSORBOARD_DIR", "TOKENIZER_MODEL"),
}


def _run(script, *arguments):
    env = dict(os.environ, PRINT_ARGS="1", TINY="1")
    return subprocess.run(["bash", str(REPO_ROOT / "examples" / script), *arguments], env=env, capture_output=True,
                          text=True, timeout=60)


@pytest.mark.parametrize("script, variables", RECIPES.items())
def test_upstream_positional_arguments_name_the_environment_variables(script, variables):
    result = _run(script, "checkpoints/run1", "tensorboard_logs/run1", "MOCK", "MOCK")
    assert result.returncode == 2
    assert result.stdout == ""
    assert f"'checkpoints/run1' is not a pretrain_gpt.py flag. Upstream's positional arguments are environment " \
           f"variables here ({', '.join(variables)})" in result.stderr
    script_text = (REPO_ROOT / "examples" / script).read_text()
    for variable in variables:
        assert "${" + variable + ":" in script_text  # each named variable is one the script reads


@pytest.mark.parametrize("script", RECIPES)
def test_extra_flags_are_passed_on(script):
    result = _run(script, "--seed", "7")
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-2:] == ["--seed", "7"]
