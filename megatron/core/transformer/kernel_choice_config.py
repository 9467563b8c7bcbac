"""Upstream `TransformerConfig` fields that pick a kernel, so that configs written for upstream Megatron-Core build
here and each field gets an honest answer.

Upstream uses them to choose fused Apex / Transformer Engine kernels (bias + activation, bias + dropout + add,
masked softmax, RoPE, persistent and memory-efficient LayerNorm, TE's activation functions) for values the torch
ops here compute too: they are accepted and kept, and change nothing that is computed. Two are more than a kernel
choice and are refused where this build cannot do what they ask:

- `attention_softmax_in_fp32` (upstream's default True): attention here keeps the softmax in fp32 with bf16 / fp16
  inputs (torch's scaled_dot_product_attention kernels keep its statistics in fp32, and the attention-sink and
  layer-scaled paths upcast), so True is what runs; False with bf16 / fp16 asks for a half-precision softmax, which
  is not implemented. As upstream, `apply_query_key_layer_scaling` sets it to True.
- `tp_comm_overlap` (upstream's `ModelParallelConfig` field): overlapping the tensor-parallel communication with the
  GEMMs needs Transformer Engine's userbuffers, which this build does not set up (as `--tp-comm-overlap`).
"""

from dataclasses import dataclass

import torch

# Fields accepted as a kernel choice: the values computed are the same with either setting (upstream defaults).
NO_OP_KERNEL_CHOICES = {
    "bias_activation_fusion": False,
    "bias_dropout_fusion": False,
    "masked_softmax_fusion": False,
    "apply_rope_fusion": False,
    "persist_layer_norm": False,
    "memory_efficient_layer_norm": False,
    "use_te_activation_func": False,
}


@dataclass(frozen=True, kw_only=True)
class KernelChoiceConfigMixin:
    """Upstream's kernel-choice fields of `TransformerConfig`; validated by `_validate_kernel_choices`."""

    bias_activation_fusion: bool = False
    """Upstream: fuse the bias add with the MLP activation (`--no-bias-gelu-fusion`, `--no-bias-swiglu-fusion`).
    Accepted: the torch ops compute the same values."""
    bias_dropout_fusion: bool = False
    """Upstream: fuse bias + dropout + residual add (`--no-bias-dropout-fusion`). Accepted: same values."""
    masked_softmax_fusion: bool = False
    """Upstream: the fused scale-mask-softmax kernel (`--no-masked-softmax-fusion`). Accepted: the softmax runs
    inside torch's scaled_dot_product_attention."""
    apply_rope_fusion: bool = False
    """Upstream: the fused RoPE kernel (`--no-rope-fusion`). Accepted: the torch rotation gives the same values."""
    persist_layer_norm: bool = False
    """Upstream: Apex's persistent LayerNorm kernel (`--no-persist-layer-norm`). Accepted: same values."""
    memory_efficient_layer_norm: bool = False
    """Upstream: Apex's LayerNorm that saves its output instead of its input for backward. Accepted: same values."""
    use_te_activation_func: bool = False
    """Upstream: Transformer Engine's activation modules (`--use-te-activation-func`). Accepted: the torch
    activation computes the same function."""
    attention_softmax_in_fp32: bool = True
    """The attention softmax runs in fp32 with bf16 / fp16 inputs (`--attention-softmax-in-fp32`); False is refused
    with bf16 / fp16 (a half-precision softmax is not implemented) and means nothing with fp32."""
    tp_comm_overlap: bool = False
    """Upstream: overlap tensor-parallel communication with the GEMMs (Transformer Engine userbuffers,
    `--tp-comm-overlap`); True is refused."""

    def _validate_kernel_choices(self):
        if self.apply_query_key_layer_scaling:
            object.__setattr__(self, "attention_softmax_in_fp32", True)  # as upstream: the scaling needs it
        half_precision = self.bf16 or self.fp16 or self.params_dtype in (torch.bfloat16, torch.float16)
        if not self.attention_softmax_in_fp32 and half_precision:
            raise ValueError("attention_softmax_in_fp32=False asks for the attention softmax in bf16 / fp16, which is "
                             "not implemented: attention here keeps the softmax in fp32 (as upstream's fused softmax "
                             "and Transformer Engine kernels do); pass attention_softmax_in_fp32=True or leave it out")
        if self.tp_comm_overlap:
            raise ValueError("tp_comm_overlap=True (--tp-comm-overlap) needs Transformer Engine's userbuffers, which "
                             "this build does not set up: leave it False; tensor-parallel communication then runs "
                             "between the GEMMs (same values)")
