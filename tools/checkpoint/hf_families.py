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
"""

from typing import Optional

from hf_errors import ConversionError
from hf_shape import ModelShape

GPT2, LLAMA, MISTRAL, QWEN2, QWEN3 = (
    "GPT2LMHeadModel", "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
# The rotary architectures, each with its config.json model_type.
LLAMA_RELATIVES = {LLAMA: "llama", MISTRAL: "mistral", QWEN2: "qwen2", QWEN3: "qwen3"}
ARCHITECTURES = (GPT2, *LLAMA_RELATIVES)
# Those whose attention output projection has a bias whenever config.json says attention_bias.
O_PROJ_BIAS_WITH_ATTENTION_BIAS = (LLAMA, QWEN3)
# HF activation_function -> our MLP activation flags; the first name of each is the one written.
GPT2_ACTIVATIONS = {"gelu": {}, "relu2": {"squared_relu": True}, "gelu_pytorch_tanh": {"openai_gelu": True},
                    "gelu_new": {"openai_gelu": True}}


def _gpt2_problems(shape: ModelShape):
    problems = []
    if shape.position_embedding_type == "rope":
        problems.append("--position-embedding-type rope: GPT-2 learns absolute positions")
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
    if architecture == QWEN3 and shape.add_bias_linear:
        return ["linear biases (no --disable-bias-linear): Qwen3, the architecture with query and key norms "
                "(--qk-layernorm), has no MLP biases"]
    if architecture == MISTRAL and shape.qkv_bias:
        flag = "--add-qkv-bias" if not shape.add_bias_linear else "linear biases (no --disable-bias-linear)"
        return [f"{flag}: MistralForCausalLM has no biases"]
    if architecture == QWEN2 and shape.add_bias_linear:
        return ["linear biases (no --disable-bias-linear): Qwen2ForCausalLM has biases on q, k and v only "
                "(--disable-bias-linear --add-qkv-bias)"]
    if architecture == QWEN2 and not shape.add_qkv_bias:
        return ["no --add-qkv-bias: Qwen2ForCausalLM's q, k and v projections always have biases"]
    return []


def _llama_problems(shape: ModelShape, architecture: str):
    problems = _bias_problems(shape, architecture)
    if shape.position_embedding_type != "rope":
        problems.append(f"--position-embedding-type {shape.position_embedding_type}: {architecture} rotates "
                        "(--position-embedding-type rope)")
    if shape.qk_layernorm != (architecture == QWEN3):
        problems.append(f"--qk-layernorm: {architecture} does not normalise query and key heads (Qwen3ForCausalLM "
                        "does)" if shape.qk_layernorm else "no --qk-layernorm: Qwen3ForCausalLM normalises query "
                        "and key heads")
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
    return problems


def architecture_for(shape: ModelShape, requested: Optional[str] = None,
                     requested_by: str = "as --hf-architecture asks") -> str:
    """The architecture to write: `requested` (--hf-architecture, or the one an import recorded; `requested_by`
    says which) or the one our flags pick (GPT2, LLAMA or QWEN3); ConversionError listing every flag that keeps
    the model from being written exactly as it."""
    if requested is not None and requested not in ARCHITECTURES:
        raise ConversionError(f"--hf-architecture {requested}: not one we write; choose one of "
                              f"{', '.join(ARCHITECTURES)}")
    rope = shape.position_embedding_type == "rope"
    architecture = requested or ((QWEN3 if shape.qk_layernorm else LLAMA) if rope else GPT2)
    problems = _gpt2_problems(shape) if architecture == GPT2 else _llama_problems(shape, architecture)
    if shape.apply_residual_connection_post_layernorm:
        problems.append("--apply-residual-connection-post-layernorm: GPT-2 and Llama add the un-normalised input "
                        "of attention and MLP back (pre-norm residual)")
    if problems:
        positions = "rotary positions (--position-embedding-type rope)" if rope else "learned absolute positions"
        why = requested_by if requested else f"the architecture for {positions}"
        raise ConversionError(f"this model cannot be written as a Hugging Face {architecture} ({why}) without "
                              "changing what it computes: " + "; ".join(problems))
    return architecture
