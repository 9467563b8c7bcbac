"""The layer-variant flags of argument_groups/model.py (--add-qkv-bias, --rotary-interleaved,
--rotary-seq-len-interpolation-factor, --apply-residual-connection-post-layernorm, --fp32-residual-connection,
--openai-gelu, --use-cpu-initialization, --embedding-init-method-std): they reach the TransformerConfig, and the
rules name the flags."""

import pytest
import torch

from megatron.core.transformer.utils import openai_gelu
from megatron.training.model_config import core_transformer_config_from_args
from tests.unit_tests.training.argument_checks import validated


def test_flags_reach_the_transformer_config():
    default = core_transformer_config_from_args(validated(""))
    assert not (default.add_qkv_bias or default.rotary_interleaved or default.fp32_residual_connection
                or default.apply_residual_connection_post_layernorm or default.use_cpu_initialization)
    assert default.rotary_seq_len_interpolation_factor is None and default.activation_func is not openai_gelu
    assert default.embedding_init_method_std is None and default.embedding_init_method is default.init_method
    config = core_transformer_config_from_args(validated(
        "--disable-bias-linear --add-qkv-bias --position-embedding-type rope --rotary-interleaved "
        "--rotary-seq-len-interpolation-factor 8 --apply-residual-connection-post-layernorm --bf16 "
        "--fp32-residual-connection --openai-gelu --use-cpu-initialization --embedding-init-method-std 0.5"))
    assert config.add_qkv_bias and not config.add_bias_linear and config.rotary_interleaved
    assert config.rotary_seq_len_interpolation_factor == 8.0 and config.apply_residual_connection_post_layernorm
    assert config.fp32_residual_connection and config.pipeline_dtype == torch.float32
    assert config.activation_func is openai_gelu and config.use_cpu_initialization
    assert config.embedding_init_method_std == 0.5 and config.embedding_init_method.std == 0.5
    assert config.init_method.std == 0.02  # --init-method-std's default: the other weights keep it


@pytest.mark.parametrize("extra, message", [
    ("--rotary-interleaved", "--rotary-interleaved shapes rotary position embeddings: it needs "
                             "--position-embedding-type rope"),
    ("--rotary-seq-len-interpolation-factor 2", "--rotary-seq-len-interpolation-factor shapes rotary"),
    ("--position-embedding-type rope --rotary-seq-len-interpolation-factor -1",
     "--rotary-seq-len-interpolation-factor must be positive"),
    ("--openai-gelu --swiglu", "--openai-gelu and --swiglu are exclusive"),
    ("--openai-gelu --squared-relu", "--openai-gelu and --squared-relu are exclusive"),
    ("--fp32-residual-connection", "--fp32-residual-connection keeps the residual in fp32 under --bf16 or --fp16"),
    ("--embedding-init-method-std 0", "--embedding-init-method-std must be positive"),
])
def test_rules_name_the_flags(extra, message):
    with pytest.raises(ValueError) as error:
        validated(extra)
    assert message in str(error.value)


def test_fp32_residual_connection_is_accepted_under_fsdp2():
    # FSDP2 leaves the layers' inputs in their dtype (test_bf16_wrapper_agreement.py checks the stream is fp32).
    args = validated("--bf16 --fp32-residual-connection --use-torch-fsdp2 --untie-embeddings-and-output-weights")
    assert args.fp32_residual_connection and args.use_torch_fsdp2
