"""Upstream's kernel-choice fields of TransformerConfig: accepted where the values are the same without the fused
kernel, refused with a message naming the field where this build cannot do what they ask."""

import pytest
import torch

from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
from megatron.core.transformer.kernel_choice_config import NO_OP_KERNEL_CHOICES
from megatron.core.transformer.transformer_block import TransformerBlock
from megatron.core.transformer.transformer_config import TransformerConfig

SHAPE = dict(num_layers=2, hidden_size=16, num_attention_heads=2, hidden_dropout=0.0, attention_dropout=0.0,
             init_seed=7)


def test_fused_kernel_fields_are_accepted_kept_and_change_nothing_computed():
    fused = {name: not default for name, default in NO_OP_KERNEL_CHOICES.items()}
    assert set(fused) == {"bias_activation_fusion", "bias_dropout_fusion", "masked_softmax_fusion",
                          "apply_rope_fusion", "persist_layer_norm", "memory_efficient_layer_norm",
                          "use_te_activation_func"}
    config = TransformerConfig(**SHAPE, gated_linear_unit=True, **fused, attention_softmax_in_fp32=True)
    assert all(getattr(config, name) is True for name in fused)
    model_parallel_cuda_manual_seed(1234)
    hidden = torch.randn(5, 2, 16, generator=torch.Generator().manual_seed(0))
    plain = TransformerBlock(TransformerConfig(**SHAPE, gated_linear_unit=True))(hidden)
    assert torch.equal(TransformerBlock(config)(hidden), plain)


def test_attention_softmax_in_fp32_false_is_refused_with_half_precision_only():
    config = TransformerConfig(**SHAPE)
    assert config.attention_softmax_in_fp32 is True  # upstream's default
    assert TransformerConfig(**SHAPE, attention_softmax_in_fp32=False).attention_softmax_in_fp32 is False  # fp32
    message = (r"^attention_softmax_in_fp32=False asks for the attention softmax in bf16 / fp16, which is not "
               r"implemented: attention here keeps the softmax in fp32 .*; pass attention_softmax_in_fp32=True or "
               r"leave it out$")
    for half in (dict(bf16=True, params_dtype=torch.bfloat16), dict(fp16=True, params_dtype=torch.float16)):
        with pytest.raises(ValueError, match=message):
            TransformerConfig(**SHAPE, **half, attention_softmax_in_fp32=False)
    # As upstream, query-key layer scaling turns the fp32 softmax on.
    scaled = TransformerConfig(**SHAPE, fp16=True, params_dtype=torch.float16, apply_query_key_layer_scaling=True,
                               attention_softmax_in_fp32=False)
    assert scaled.attention_softmax_in_fp32 is True


def test_tp_comm_overlap_is_refused_and_its_default_accepted():
    assert TransformerConfig(**SHAPE, tp_comm_overlap=False).tp_comm_overlap is False
    with pytest.raises(ValueError, match=r"^tp_comm_overlap=True \(--tp-comm-overlap\) needs Transformer Engine's "
                                         r"userbuffers, which this build does not set up: leave it False"):
        TransformerConfig(**SHAPE, tp_comm_overlap=True)
