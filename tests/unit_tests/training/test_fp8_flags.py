"""The delayed-scaling flags under another FP8 recipe: accepted as upstream, with a warning that names them."""

import warnings

import pytest

from tests.unit_tests.training.argument_checks import BASE, validated


def _warnings(extra):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        validated(extra, base=f"{BASE} --fp8-format hybrid")
    return [str(warning.message) for warning in caught if "delayed scaling" in str(warning.message)]


def test_delayed_scaling_flags_under_tensorwise_warn_naming_them():
    messages = _warnings("--fp8-recipe tensorwise --fp8-margin 2 --fp8-amax-compute-algo max")
    assert len(messages) == 1
    assert messages[0].startswith("--fp8-amax-compute-algo, --fp8-margin: flags of delayed scaling, without "
                                   "effect under --fp8-recipe tensorwise")
    assert "--fp8-amax-history-len" not in messages[0]


@pytest.mark.parametrize("extra", ["--fp8-recipe tensorwise", "--fp8-recipe delayed --fp8-margin 2 "
                                   "--fp8-amax-history-len 16 --fp8-amax-compute-algo max"])
def test_no_warning_where_the_flags_apply_or_are_left_alone(extra):
    assert _warnings(extra) == []


@pytest.mark.parametrize("flag", ["--fp8-dot-product-attention", "--fp8-multi-head-attention"])
def test_fp8_attention_flags_are_parsed_and_refused_naming_the_flag(flag):
    from megatron.training.model_config import core_transformer_config_from_args

    args = validated(f"--fp8-format hybrid --fp8-recipe tensorwise {flag}")
    with pytest.raises(ValueError, match=f"^{flag} is not supported: it needs Transformer Engine's fused attention"):
        core_transformer_config_from_args(args)
    assert core_transformer_config_from_args(validated("--fp8-format hybrid")).fp8_multi_head_attention is False


def test_fp8_param_gather_under_fsdp2_is_refused_naming_fsdp2():
    with pytest.raises(ValueError, match="^--fp8-param-gather is not supported with --use-torch-fsdp2"):
        validated("--fp8-format hybrid --fp8-param-gather --use-torch-fsdp2 --untie-embeddings-and-output-weights "
                  "--ckpt-format torch_dist", world_size=2)
