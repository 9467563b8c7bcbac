"""QK-Clip's flags (--qk-clip, --qk-clip-alpha, --qk-clip-threshold, --log-max-attention-logit): upstream's
defaults, their way into TransformerConfig, the combinations refused, and the training log's field."""

import os

import pytest


def _validated(flags):
    from megatron.training.arguments import parse_args, validate_args
    from megatron.training.model_config import core_transformer_config_from_args

    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("RANK", "0")
    base = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --micro-batch-size 2 "
            "--train-iters 10 --lr 1e-3 --mock-data --vocab-size 64 ")
    return core_transformer_config_from_args(validate_args(parse_args(args=(base + flags).split())))


def test_flags_reach_the_transformer_config():
    defaults = _validated("")
    assert (defaults.qk_clip, defaults.qk_clip_alpha, defaults.qk_clip_threshold,
            defaults.log_max_attention_logit) == (False, 0.5, 100.0, False)
    config = _validated("--qk-clip --qk-clip-alpha 0.25 --qk-clip-threshold 50 --log-max-attention-logit "
                        "--optimizer adam")
    assert (config.qk_clip, config.qk_clip_alpha, config.qk_clip_threshold, config.log_max_attention_logit) == (
        True, 0.25, 50.0, True)


@pytest.mark.parametrize("flags,named", [
    ("--qk-clip --qk-clip-alpha 1.5", "--qk-clip-alpha"),
    ("--qk-clip --qk-clip-threshold 0", "--qk-clip-threshold"),
    ("--qk-clip --qk-layernorm", "--qk-layernorm"),
    ("--qk-clip --optimizer-cpu-offload --use-distributed-optimizer", "--optimizer-cpu-offload"),
])
def test_flag_rules(flags, named):
    with pytest.raises(ValueError, match=named):
        _validated(flags)


def test_log_line_shows_the_max_attention_logit():
    from megatron.training.training_log import format_log_line

    fields = dict(iteration=3, train_iters=10, consumed_samples=6, elapsed_ms_per_iteration=1.0, learning_rate=1e-3,
                  global_batch_size=2, losses={"lm loss": 2.0}, loss_scale=1.0, grad_norm=None, num_zeros=None,
                  skipped_iterations=0, nan_iterations=0)
    assert "max attention logit: 12.346 |" in format_log_line(**fields, max_attention_logit=12.3456)
    assert "max attention logit" not in format_log_line(**fields)
