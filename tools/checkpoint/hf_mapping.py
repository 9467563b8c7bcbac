"""Our logical GPT checkpoint <-> a Hugging Face causal LM: which architecture, its config.json, its tensors.

Hugging Face architectures cover the models pretrain_gpt.py builds, chosen by the position embedding:

- learned absolute positions -> GPT2LMHeadModel: LayerNorm, exact GeLU (`activation_function: "gelu"`), the
  tanh approximation of --openai-gelu ("gelu_pytorch_tanh", the very torch op; HF's GPT-2 default "gelu_new"
  computes the same formula by hand and reads back as --openai-gelu too) or squared ReLU ("relu2"), one
  key/value head per query head. HF's GPT-2 uses Conv1D, whose weight is the transpose of a Linear's, and its
  fused `c_attn` holds q | k | v as three blocks of hidden_size rows. GPT-2 always has biases: a model trained
  with --disable-bias-linear is written with zero biases (but for the QKV bias of --add-qkv-bias), which compute
  the same.
- rotary positions -> LlamaForCausalLM: RMSNorm, SwiGLU as gate_proj / up_proj / down_proj, separate q/k/v
  projections with grouped-query attention, biases per `attention_bias` / `mlp_bias` (--add-qkv-bias alone is
  `attention_bias` with a zero o_proj bias). HF's Llama rotates channel i with channel i + head_dim / 2 ("rotate
  half"), as our RoPE does by default; with --rotary-interleaved ours rotates channels 2i and 2i + 1 instead, and
  q and k rows are permuted within each head (2i -> i, 2i + 1 -> i + head_dim / 2), which gives the same
  attention scores. --use-rope-scaling is HF's `rope_type: "llama3"` with the low / high frequency factors 1 and 4
  and the original context of 8192 positions that our rotary embedding fixes; other values of those are refused.
  --rotary-seq-len-interpolation-factor is `rope_type: "linear"` (positions divided by the factor).
  With --qk-layernorm the model is a Qwen3ForCausalLM: a Llama whose query and key heads pass through one RMSNorm
  over head_dim each (q_norm / k_norm) before RoPE, as ours do; it has no MLP biases. Mistral (without a sliding
  window, no biases) and Qwen2 (biases on q, k and v only: --add-qkv-bias) compute as Llama does; a model imported
  from one is written back as it, and --hf-architecture names one for any model that fits (hf_families.py).
- rotary positions with --num-experts -> MixtralForCausalLM (every layer MoE, renormalised top-k),
  Qwen3MoeForCausalLM (--qk-layernorm; dense layers per `decoder_sparse_step` / `mlp_only_layers`,
  `norm_topk_prob` the opposite of --moe-router-pre-softmax) or Qwen2MoeForCausalLM (a gated shared expert:
  --moe-shared-expert-intermediate-size --moe-shared-expert-gate): the router weight and each expert's
  gate / up / down projections under its global index (hf_moe.py). Router options HF does not have are refused
  (hf_unsupported.py).

The word embedding and an untied output layer carry vocabulary padding rows, which HF's model must not see.

With --apply-layernorm-1p a norm stores gamma - 1 and scales by 1 + weight; HF gets gamma = weight + 1, the
very fp32 value our forward computes. What HF has no place for goes to `megatron_extras.safetensors` beside
the model, so the way back is bit-exact: the padding rows, FP8 amax buffers, the stored gamma - 1 of
zero-centred norms (used where they still give HF's gamma, so a weight changed in HF wins) and, in its
metadata, the flags config.json cannot say. A directory without it (a model from elsewhere) imports too.
Anything else that HF cannot compute the same way is refused, naming the flag. The weights are written in the
dtype the checkpoint trained in (--bf16: bfloat16), and read back in fp32.

Hybrid models (--hybrid-override-pattern: Mamba-2, attention and MLP layers) are NemotronHForCausalLM, or with
Mamba layers only Mamba2ForCausalLM (hf_hybrid.py, hf_hybrid_tensors.py): their mixer's in_proj rows and conv1d
channels are permuted between HF's kind-major order and our group-major one.

Heterogeneous models (--heterogeneous-layers-config-path: each layer's query groups and MLP width, or its attention
or MLP dropped or one linear) are Llama-Nemotron's DeciLMForCausalLM (hf_nemotron_nas.py), whose config.json's
block_configs the checkpoint keeps as its layers' JSON.

The conversion, one job per file: hf_shape.py (the model flags), hf_families.py (which architecture),
hf_config.py (config.json both ways, the weights' dtype), hf_rope.py (RoPE in config.json), hf_moe.py (experts:
config keys and tensors), hf_layouts.py (fused rows, tensor names), hf_export_tensors.py and hf_import_tensors.py
(the tensors each way). This module gathers their public names.
"""

from hf_config import (
    CONFIG_FILE,
    EXTRAS_FILE,
    GPT2_RECORDED_CONFIG_KEYS,
    HF_DTYPES,
    MODEL_FILE,
    MODEL_INDEX_FILE,
    TOKEN_ID_KEYS,
    dtype_of_tensors,
    extras_metadata,
    hf_config,
    shape_from_hf_config,
    training_dtype,
)
from hf_errors import ConversionError
from hf_export_tensors import to_hf_tensors
from hf_families import (
    ARCHITECTURES,
    GPT2,
    GPT2_ACTIVATIONS,
    LLAMA,
    LLAMA_RELATIVES,
    MISTRAL,
    MIXTRAL,
    MOE_ARCHITECTURES,
    QWEN2,
    QWEN2_MOE,
    QWEN3,
    QWEN3_MOE,
    architecture_for,
)
from hf_import_tensors import from_hf_tensors
from hf_layouts import (
    FP8_BUFFER_SUFFIXES,
    OUTPUT_LAYER,
    PADDING_SUFFIX,
    POSITION_EMBEDDING,
    WORD_EMBEDDING,
    fuse_gate_up,
    fuse_qkv,
    split_gate_up,
    split_qkv,
)
from hf_gpt_oss import RECORDED_CONFIG_KEYS as GPT_OSS_RECORDED_CONFIG_KEYS
from hf_hybrid import MAMBA2, NEMOTRON_H
from hf_nemotron_nas import NEMOTRON_NAS
from hf_moe import RECORDED_CONFIG_KEYS as MOE_RECORDED_CONFIG_KEYS
from hf_shape import ModelShape

# The config.json keys an import records for --to hf to write back (those our flags do not say).
RECORDED_CONFIG_KEYS = MOE_RECORDED_CONFIG_KEYS + GPT2_RECORDED_CONFIG_KEYS + GPT_OSS_RECORDED_CONFIG_KEYS

__all__ = [
    "ARCHITECTURES", "CONFIG_FILE", "EXTRAS_FILE", "FP8_BUFFER_SUFFIXES", "GPT2", "GPT2_ACTIVATIONS", "HF_DTYPES",
    "LLAMA", "LLAMA_RELATIVES", "MAMBA2", "MISTRAL", "MIXTRAL", "MODEL_FILE", "MODEL_INDEX_FILE", "MOE_ARCHITECTURES",
    "NEMOTRON_H", "NEMOTRON_NAS", "OUTPUT_LAYER", "PADDING_SUFFIX", "POSITION_EMBEDDING", "QWEN2", "QWEN2_MOE",
    "QWEN3", "QWEN3_MOE", "RECORDED_CONFIG_KEYS", "TOKEN_ID_KEYS", "WORD_EMBEDDING", "ConversionError", "ModelShape",
    "architecture_for", "dtype_of_tensors", "extras_metadata", "from_hf_tensors", "fuse_gate_up", "fuse_qkv",
    "hf_config", "shape_from_hf_config", "split_gate_up", "split_qkv", "to_hf_tensors", "training_dtype",
]
