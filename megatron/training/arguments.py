"""The command line of `pretrain_gpt.py`: `parse_args()` and `validate_args()`.

The flags themselves live in `megatron.training.argument_groups`, one module per concern (model, training,
parallelism, data, logging, checkpoint, data parallel / FSDP, FP8). Names, defaults and rules follow
Megatron-LM so existing launch scripts carry over.
"""

import argparse
import difflib
import re
import sys

from megatron.training import yaml_arguments
from megatron.training.argument_groups import ARGUMENT_GROUPS
from megatron.training.model_config import core_transformer_config_from_args  # also here: upstream's import path

__all__ = ["build_parser", "core_transformer_config_from_args", "parse_args", "validate_args"]

# Declared so launch scripts parse, but refused with what to use instead: never silently ignored.
NOT_IMPLEMENTED_FLAGS = (
    ("fp4_format", "--fp4-format", "NVFP4 training needs Transformer Engine's FP4 GEMMs (Blackwell GPUs), which this "
     "build does not run: drop --fp4-format (and --fp4-recipe), or train in FP8 with --fp8-format e4m3|hybrid "
     "--fp8-recipe tensorwise|delayed"),
)


# argparse takes "-1e-3" for a flag (its own pattern knows "-1" and "-0.5" only), so `--lr -1e-3` would fail with
# "expected one argument" instead of reaching the check that names the rule.
_NEGATIVE_NUMBER = re.compile(r"^-(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$")


# Upstream flags that pretrain_gpt.py does not take because another script here runs that job.
_SCRIPT_OF_FLAG = {
    "--export-kd-teacher-load": "examples/post_training/distill.py",
    "--export-kd-cfg": "examples/post_training/distill.py",
    "--export-quant-cfg": "examples/post_training/quantize.py",
    "--calib-size": "examples/post_training/quantize.py",
    "--target-ffn-hidden-size": "examples/post_training/prune.py",
    "--target-hidden-size": "examples/post_training/prune.py",
    "--target-num-attention-heads": "examples/post_training/prune.py",
}


def _flags_of_other_scripts(words):
    """'--x is a flag of S: run S with the same flags' for each unknown flag that another script here takes."""
    hints = [f"{flag} is a flag of {_SCRIPT_OF_FLAG[flag]}: run that script with the same flags instead"
             for flag in (word.split("=", 1)[0] for word in words) if flag in _SCRIPT_OF_FLAG]
    return "; ".join(hints)


class _MegatronArgumentParser(argparse.ArgumentParser):
    """argparse, whose error for an unknown flag names the closest known flag and says where all are listed."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._negative_number_matcher = _NEGATIVE_NUMBER

    def error(self, message):
        """The message alone, after a one-line usage: the full usage lists every flag (hundreds of lines per rank
        under torchrun) and would bury it."""
        if message.startswith("unrecognized arguments"):
            words = message.split(":", 1)[1].split()
            elsewhere = _flags_of_other_scripts(words)
            suggestions = self._closest_flags(words)
            message += (" (not a flag of pretrain_gpt.py: " + (elsewhere or "check its spelling" + suggestions)
                        + "; the flags it takes, with Megatron-LM's names, are listed by area in "
                        "docs/training_flags.md)")
        self.exit(2, f"usage: {self.prog} [flags] (--help lists them)\n{self.prog}: error: {message}\n")

    def _closest_flags(self, words):
        """'; did you mean --x?' for each unknown flag among `words` that is close to a known one."""
        known = [flag for flag in self._option_string_actions if flag.startswith("--")]
        unknown = [word.split("=", 1)[0] for word in words if word.startswith("--")]
        hints = []
        for flag in unknown:
            close = difflib.get_close_matches(flag, known, n=1, cutoff=0.75)
            if close:
                hints.append(f"did you mean {close[0]}" + (f" for {flag}?" if len(unknown) > 1 else "?"))
        return "; " + "; ".join(hints) if hints else ""


def build_parser(extra_args_provider=None):
    parser = _MegatronArgumentParser(description="Megatron-style GPT pretraining", allow_abbrev=False)
    for group in ARGUMENT_GROUPS:
        group.add_arguments(parser)
    yaml_arguments.add_arguments(parser)
    if extra_args_provider is not None:
        parser = extra_args_provider(parser) or parser
    return parser


def parse_args(extra_args_provider=None, ignore_unknown_args=False, args=None):
    """Parse `args` (default: `sys.argv[1:]`); unknown flags are an argparse error unless ignored. With
    --yaml-cfg FILE the file's keys come first and the flags given with it override them (`yaml_arguments`)."""
    parser = build_parser(extra_args_provider)
    args = yaml_arguments.with_yaml_arguments(parser, list(sys.argv[1:] if args is None else args))
    if ignore_unknown_args:
        parsed, _ = parser.parse_known_args(args)
    else:
        parsed = parser.parse_args(args)
    return parsed


def reject_unimplemented_features(args):
    for attribute, flag, advice in NOT_IMPLEMENTED_FLAGS:
        if getattr(args, attribute, None):
            raise ValueError(f"{flag} is not supported: {advice}")


def validate_args(args, defaults=None):
    """Check the flags against each other and fill in derived values (data_parallel_size, ffn size, ...).

    `defaults` (flag destination -> value) fills options the user left unset, as `pretrain(args_defaults=)`.
    World size and rank come from the launcher's WORLD_SIZE / RANK environment (1 / 0 without one).
    Raises ValueError naming the offending flags.
    """
    for name, value in (defaults or {}).items():
        if getattr(args, name, None) is None:
            setattr(args, name, value)
    for group in ARGUMENT_GROUPS:
        group.validate(args)
    reject_unimplemented_features(args)
    return args
