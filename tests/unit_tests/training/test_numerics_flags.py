"""--cross-entropy-loss-fusion, --cross-entropy-fusion-impl and --apply-query-key-layer-scaling: parsed, checked
with upstream's rules, and passed to the model's TransformerConfig."""

from functools import partial

import pytest

from megatron.training.model_config import core_transformer_config_from_args
from tests.unit_tests.training import argument_checks

validated = partial(argument_checks.validated, world_size=2)


def test_flags_reach_the_transformer_config():
    config = core_transformer_config_from_args(validated(""))
    assert not config.cross_entropy_loss_fusion and not config.apply_query_key_layer_scaling
    args = validated("--cross-entropy-loss-fusion --cross-entropy-fusion-impl native --apply-query-key-layer-scaling")
    config = core_transformer_config_from_args(args)
    assert config.cross_entropy_loss_fusion and config.apply_query_key_layer_scaling


@pytest.mark.parametrize("extra, message", [
    ("--cross-entropy-loss-fusion --cross-entropy-fusion-impl te", "--cross-entropy-fusion-impl te needs Transformer"),
    ("--apply-query-key-layer-scaling --fp16 --context-parallel-size 2",
     "--apply-query-key-layer-scaling with --fp16 is not supported with --context-parallel-size > 1"),
])
def test_rules(extra, message):
    with pytest.raises(ValueError) as error:
        validated(extra)
    assert message in str(error.value)


def test_fp16_lm_cross_entropy_is_accepted_and_keeps_the_fp32_loss():
    from megatron.training.arguments import build_parser

    args = validated("--fp16 --fp16-lm-cross-entropy")
    assert args.fp16_lm_cross_entropy is True and validated("--fp16").fp16_lm_cross_entropy is False
    # As in Megatron-Core's GPT model the loss stays in fp32: the model config is the one without the flag.
    assert core_transformer_config_from_args(args) == core_transformer_config_from_args(validated("--fp16"))
    helps = {flag: action.help for action in build_parser()._actions for flag in action.option_strings}
    assert helps["--fp16-lm-cross-entropy"].startswith("Accepted for upstream scripts: ")


@pytest.mark.parametrize("cuda", [False, True])
def test_disable_bf16_reduced_precision_matmul_sets_the_cuda_switch(monkeypatch, cuda):
    import torch

    from megatron.training import accelerator, initialize

    monkeypatch.setattr(accelerator, "cuda_available", lambda: cuda)
    matmul = torch.backends.cuda.matmul
    monkeypatch.setattr(matmul, "allow_bf16_reduced_precision_reduction", True)  # restored after the test
    initialize.set_matmul_precision(validated(""))
    assert matmul.allow_bf16_reduced_precision_reduction is True
    args = validated("--disable-bf16-reduced-precision-matmul")
    assert args.disable_bf16_reduced_precision_matmul
    initialize.set_matmul_precision(args)
    # Set where CUDA runs the GEMMs; left alone on a CPU-only machine, where no matmul reads it.
    assert matmul.allow_bf16_reduced_precision_reduction is (not cuda)
