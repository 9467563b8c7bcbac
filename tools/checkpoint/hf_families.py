"""Which Hugging Face architecture a model is written as, and what keeps a model from being one.

Learned absolute positions are GPT2LMHeadModel. Rotary positions are one of the Llama family, all RMSNorm, SwiGLU
and rotate-half RoPE with grouped-query attention; they differ in biases and norms:

| architecture | linear biases | query / key norms |
|---|---|---|
| LlamaForCausalLM | none, all (`attention_bias` + `mlp_bias`), or q/k/v with a zero o_proj bias | no |
| MistralForCausalLM | none | no |
| Qwen2ForCausalLM | q, k and v only (--add-qkv-bias --disable-bias-linear) | no |
| Qwen3ForCausalLM | none, or q, k, v and o_proj (`attention_bias`) | yes (--qk-layernorm) |

Our flags alone pick GPT-2, Llama or, with --qk-layernorm, Qwen3; Mistral and Qwen2 compute as Llama does, so a
model imported from one is written back as it (the import records the architecture) and any other model becomes
one when asked for by name (--hf-architecture), after the checks below.

With --num-experts the MLP of some or all layers is a Mixture-of-Experts layer: a router (softmax over the experts'
logits, top-k) and SwiGLU experts, none with biases. The three MoE architectures are the Llama relatives above
with such layers:

| architecture | attention as | MoE layers | top-k probabilities | shared expert |
|---|---|---|---|---|
| MixtralForCausalLM | Mistral | every layer | renormalised (no --moe-router-pre-softmax) | no |
| Qwen3MoeForCausalLM | Qwen3 | `decoder_sparse_step` / `mlp_only_layers` (--moe-layer-freq) | `norm_topk_prob` | no |
| Qwen2MoeForCausalLM | Qwen2 (q, k, v biases per `qkv_bias`) | as Qwen3-MoE | as Qwen3-MoE | gated, always |

HF renormalises the top-k of a softmax over all experts (`norm_topk_prob`, always for Mixtral): the same as our
softmax over the k chosen logits (no --moe-router-pre-softmax); without renormalisation it is
--moe-router-pre-softmax. Qwen2-MoE's shared expert is --moe-shared-expert-intermediate-size with
--moe-shared-expert-gate (sigmoid(x . w) times its output). Our flags pick Qwen2-MoE with shared experts, else
Qwen3-MoE with --qk-layernorm, else Mixtral.

GptOssForCausalLM (hf_gpt_oss.py) is a Llama with experts in every layer, biases, attention sinks, sliding-window
layers and a clamped quick-GeGLU; our flags pick it with --quick-geglu.

DeepseekV3ForCausalLM (hf_deepseek.py) has multi-latent attention, dense first layers, then MoE layers with shared
experts and a sigmoid router; our flags pick it with --multi-latent-attention.

NemotronHForCausalLM and Mamba2ForCausalLM (hf_hybrid.py) are the hybrid models of Mamba, attention and MLP layers;
--hybrid-override-pattern picks Mamba2 for Mamba layers only (when their inner width is a multiple of the hidden
size), else Nemotron-H.

DeciLMForCausalLM (hf_nemotron_nas.py, Llama-Nemotron) is a Llama whose layers each have their own shape; our flags
pick it with --heterogeneous-layers-config-path.
"""

from typing import Optional

from hf_deepseek import DEEPSEEK_V3, OWN_FORMATS, check_deepseek_architecture
from hf_errors import ConversionError
from hf_gpt_oss import GPT_OSS, gpt_oss_feature_problems, gpt_oss_problems
from hf_hybrid import HYBRID_ARCHITECTURES, check_hybrid_architecture, default_hybrid_architecture
from hf_nemotron_nas import NEMOTRON_NAS, check_nemotron_nas_architecture
from hf_shape import ModelShape

GPT2, LLAMA, MISTRAL, QWEN2, QWEN3 = (
    "GPT2LMHeadModel", "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
MIXTRAL, QWEN2_MOE, QWEN3_MOE = "MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"
# The rotary architectures, each with its config.json model_type.
LLAMA_RELATIVES = {LLAMA: "llama", MISTRAL: "mistral", QWEN2: "qwen2", QWEN3: "qwen3", MIXTRAL: "mixtral",
                   QWEN2_MOE: "qwen2_moe", QWEN3_MOE: "qwen3_moe"}
ARCHITECTURES = (GPT2, *LLAMA_RELATIVES, GPT_OSS, DEEPSEEK_V3, *HYBRID_ARCHITECTURES, NEMOTRON_NAS)
MOE_ARCHITECTURES = (MIXTRAL, QWEN2_MOE, QWEN3_MOE)
# The dense architecture whose attention, norms and biases each MoE architecture has.
DENSE_COUNTERPART = {MIXTRAL: MISTRAL, QWEN2_MOE: QWEN2, QWEN3_MOE: QWEN3}
# Those that normalise query and key heads (--qk-layernorm).
QK_NORM_ARCHITECTURES = (QWEN3, QWEN3_MOE)
# Those whose attention output projection has a bias whenever config.json says attention_bias.
O_PROJ_BIAS_WITH_ATTENTION_BIAS = (LLAMA, QWEN3, QWEN3_MOE)
# HF activation_function -> our MLP activation flags; the first name of each is the one written.
GPT2_ACTIVATIONS = {"gelu": {}, "relu2": {"squared_relu": True}, "gelu_pytorch_tanh": {"openai_gelu": True},
                    "gelu_new": {"openai_gelu": True}}


def _gpt2_problems(shape: ModelShape):
    problems = []
    if shape.position_embedding_type != "learned_absolute":
        problems.append(f"--position-embedding-type {shape.position_embedding_type}: GPT-2 learns absolute "
                        "positions")
    if shape.normalization != "LayerNorm":
        problems.append(f"--normalization {shape.normalization}: GPT-2 normalises with LayerNorm")
    if shape.swiglu:
        problems.append("--swiglu: GPT-2's MLP is not gated (a SwiGLU model with --position-embedding-type rope "
                        "exports as Llama)")
    if shape.num_query_groups != shape.num_attention_heads:
        problems.append(f"--num-query-groups {shape.num_query_groups}: GPT-2 has a key/value head per query head")
    if shape.kv_channels * shape.num_attention_heads != shape.hidden_size:
        problems.append(f"--kv-channels {shape.kv_channels}: GPT-2's heads are --hidden-size / "
                        "--num-attention-heads wide")
    if shape.qk_layernorm:
        problems.append("--qk-layernorm: GPT-2 does not normalise query and key heads (with RoPE such a model "
                        "exports as Qwen3)")
    return problems


def _bias_problems(shape: ModelShape, architecture: str):
    named, architecture = architecture, DENSE_COUNTERPART.get(architecture, architecture)
    if architecture == QWEN3 and shape.add_bias_linear:
        which = "Qwen3, the architecture with query and key norms (--qk-layernorm)," if named == QWEN3 else named
        return [f"linear biases (no --disable-bias-linear): {which} has no MLP biases"]
    if architecture == MISTRAL and shape.qkv_bias:
        flag = "--add-qkv-bias" if not shape.add_bias_linear else "linear biases (no --disable-bias-linear)"
        return [f"{flag}: {named} has no biases"]
    if architecture == QWEN2 and shape.add_bias_linear:
        return [f"linear biases (no --disable-bias-linear): {named} has biases on q, k and v only "
                "(--disable-bias-linear --add-qkv-bias)"]
    if named == QWEN2 and not shape.add_qkv_bias:  # Qwen2-MoE's config.json says whether (qkv_bias)
        return ["no --add-qkv-bias: Qwen2ForCausalLM's q, k and v projections always have biases"]
    return []


def _llama_problems(shape: ModelShape, architecture: str):
    problems = _bias_problems(shape, architecture)
    if shape.position_embedding_type not in ("rope", "yarn"):
        problems.append(f"--position-embedding-type {shape.position_embedding_type}: {architecture} rotates "
                        "(--position-embedding-type rope or yarn)")
    elif shape.position_embedding_type == "yarn" and \
            (shape.use_rope_scaling or shape.rotary_seq_len_interpolation_factor is not None):
        problems.append("--use-rope-scaling / --rotary-seq-len-interpolation-factor with --position-embedding-type "
                        "yarn: config.json holds one RoPE scaling")
    if shape.qk_layernorm != (architecture in QK_NORM_ARCHITECTURES):
        problems.append(f"--qk-layernorm: {architecture} does not normalise query and key heads (Qwen3ForCausalLM "
                        "and Qwen3MoeForCausalLM do)" if shape.qk_layernorm else f"no --qk-layernorm: {architecture} "
                        "normalises query and key heads")
    if shape.normalization != "RMSNorm":
        problems.append(f"--normalization {shape.normalization}: Llama normalises with RMSNorm")
    if not shape.swiglu:
        activation = ("--squared-relu" if shape.squared_relu else "--openai-gelu" if shape.openai_gelu
                      else "the GeLU MLP (no --swiglu)")
        problems.append(f"{activation}: Llama's MLP is SwiGLU (--swiglu)")
    if shape.rotary_percent != 1.0:
        problems.append(f"--rotary-percent {shape.rotary_percent}: Llama rotates every channel of a head")
    if shape.hidden_size % shape.num_attention_heads != 0:
        problems.append(f"--hidden-size {shape.hidden_size} is not a multiple of --num-attention-heads "
                        f"{shape.num_attention_heads}, which transformers' LlamaConfig rejects even with head_dim")
    if shape.use_rope_scaling and shape.rotary_seq_len_interpolation_factor is not None:
        problems.append(f"--rotary-seq-len-interpolation-factor {shape.rotary_seq_len_interpolation_factor} with "
                        "--use-rope-scaling: Llama's config.json holds one RoPE scaling ('linear' or 'llama3')")
    return problems + _moe_problems(shape, architecture)


def _moe_problems(shape: ModelShape, architecture: str):
    if architecture not in MOE_ARCHITECTURES:
        return [f"--num-experts {shape.num_experts}: {architecture} has no experts (MixtralForCausalLM, "
                "Qwen2MoeForCausalLM and Qwen3MoeForCausalLM do)"] if shape.num_experts else []
    if not shape.num_experts:
        return [f"no --num-experts: {architecture}'s layers have experts"]
    problems = []
    if not any(shape.moe_layers):
        problems.append(f"--moe-layer-freq {shape.moe_layer_freq}: no layer has experts")
    if architecture == MIXTRAL and not all(shape.moe_layers):
        problems.append(f"--moe-layer-freq {shape.moe_layer_freq}: every MixtralForCausalLM layer has experts "
                        "(Qwen3MoeForCausalLM and Qwen2MoeForCausalLM have dense layers too)")
    if architecture == MIXTRAL and shape.moe_router_pre_softmax:
        problems.append("--moe-router-pre-softmax: MixtralForCausalLM renormalises the top-k probabilities "
                        "(Qwen3MoeForCausalLM with norm_topk_prob false does not)")
    shared = shape.moe_shared_expert_intermediate_size
    if architecture == QWEN2_MOE and not (shared and shape.moe_shared_expert_gate):
        problems.append("no --moe-shared-expert-intermediate-size with --moe-shared-expert-gate: Qwen2MoeForCausalLM "
                        "always has a gated shared expert")
    if architecture != QWEN2_MOE and shared:
        problems.append(f"--moe-shared-expert-intermediate-size {shared}: {architecture} has no shared expert "
                        "(Qwen2MoeForCausalLM's is gated: --moe-shared-expert-gate)")
    return problems


def default_architecture(shape: ModelShape) -> str:
    """The architecture our flags pick: by hybrid or heterogeneous layers, position embedding, query / key norms
    and experts."""
    if shape.hybrid_layer_pattern is not None:
        return default_hybrid_architecture(shape)
    if shape.heterogeneous_layers_config_encoded_json is not None:
        return NEMOTRON_NAS
    if shape.multi_latent_attention:
        return DEEPSEEK_V3
    if shape.position_embedding_type not in ("rope", "yarn"):
        return GPT2
    if shape.quick_geglu:
        return GPT_OSS
    if shape.num_experts:
        if shape.moe_shared_expert_intermediate_size:
            return QWEN2_MOE
        return QWEN3_MOE if shape.qk_layernorm else MIXTRAL
    return QWEN3 if shape.qk_layernorm else LLAMA


def architecture_for(shape: ModelShape, requested: Optional[str] = None,
                     requested_by: str = "as --hf-architecture asks") -> str:
    """The architecture to write: `requested` (--hf-architecture, or the one an import recorded; `requested_by`
    says which) or the one our flags pick (`default_architecture`); ConversionError listing every flag that keeps
    the model from being written exactly as it."""
    if requested is not None and requested not in ARCHITECTURES:
        raise ConversionError(f"--hf-architecture {requested}: not one we write; choose one of "
                              f"{', '.join(ARCHITECTURES)}")
    rope = shape.position_embedding_type in ("rope", "yarn")
    architecture = requested or default_architecture(shape)
    if shape.hybrid_layer_pattern is not None or architecture in HYBRID_ARCHITECTURES:
        why = requested_by if requested else \
            f"the architecture for --hybrid-override-pattern {shape.hybrid_layer_pattern}"
        return check_hybrid_architecture(shape, architecture, why)
    if NEMOTRON_NAS in (architecture, default_architecture(shape)):
        why = requested_by if requested else "the architecture for --heterogeneous-layers-config-path"
        return check_nemotron_nas_architecture(shape, architecture, why)
    if DEEPSEEK_V3 in (architecture, default_architecture(shape)):
        why = requested_by if requested else "the architecture for multi-latent attention (--multi-latent-attention)"
        problems = gpt_oss_feature_problems(shape, DEEPSEEK_V3)
        if shape.position_embedding_type == "yarn":
            problems.append("--position-embedding-type yarn: DeepseekV3ForCausalLM's multi-latent attention rotates "
                            "with --rope-type yarn")
        return check_deepseek_architecture(shape, architecture, why, problems)
    problems = _gpt2_problems(shape) + _moe_problems(shape, GPT2) if architecture == GPT2 else \
        gpt_oss_problems(shape) if architecture == GPT_OSS else _llama_problems(shape, architecture)
    if architecture != GPT_OSS:
        problems += gpt_oss_feature_problems(shape, architecture)
    if shape.apply_residual_connection_post_layernorm:
        problems.append("--apply-residual-connection-post-layernorm: GPT-2 and Llama add the un-normalised input "
                        "of attention and MLP back (pre-norm residual)")
    if problems:
        positions = "learned absolute positions" if shape.position_embedding_type == "learned_absolute" else \
            f"--position-embedding-type {shape.position_embedding_type}" if not rope else \
            f"rotary positions (--position-embedding-type {shape.position_embedding_type})"
        positions += " and experts (--num-experts)" if shape.num_experts else ""
        why = requested_by if requested else f"the architecture for {positions}"
        raise ConversionError(f"this model cannot be written as a Hugging Face {architecture} ({why}) without "
                              "changing what it computes: " + "; ".join(problems) + f"; {OWN_FORMATS}")
    return architecture
