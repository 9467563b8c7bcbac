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
  window) and Qwen2 (biases on q, k and v only: --add-qkv-bias) compute as Llama does and import as it.

Our fused layouts (megatron/core/transformer/attention.py, mlp.py): linear_qkv's rows are `[groups, (q_0 ..
q_{m-1} | k | v), head_dim]` with m query heads per group, query head g * m + j being group g's j-th; SwiGLU's
linear_fc1 rows interleave gate and up per unit, `[gate_0, up_0, gate_1, up_1, ...]`. The word embedding and
an untied output layer carry vocabulary padding rows, which HF's model must not see.

With --apply-layernorm-1p a norm stores gamma - 1 and scales by 1 + weight; HF gets gamma = weight + 1, the
very fp32 value our forward computes. What HF has no place for goes to `megatron_extras.safetensors` beside
the model, so the way back is bit-exact: the padding rows, FP8 amax buffers, the stored gamma - 1 of
zero-centred norms (used where they still give HF's gamma, so a weight changed in HF wins) and, in its
metadata, the flags config.json cannot say. A directory without it (a model from elsewhere) imports too.
Anything else that HF cannot compute the same way is refused, naming the flag.
"""

import argparse
import dataclasses
import json
from typing import Dict, Optional, Tuple

import torch

from hf_errors import ConversionError
from hf_rope import hf_rope_config, rope_flags_of_config

GPT2, LLAMA, QWEN3 = "GPT2LMHeadModel", "LlamaForCausalLM", "Qwen3ForCausalLM"
# Architectures that compute as Llama does (RMSNorm, SwiGLU, rotate-half RoPE): architecture -> model_type.
# Qwen3 adds an RMSNorm on each query and key head (--qk-layernorm).
LLAMA_RELATIVES = {LLAMA: "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2", QWEN3: "qwen3"}
MODEL_FILE, MODEL_INDEX_FILE, CONFIG_FILE = "model.safetensors", "model.safetensors.index.json", "config.json"
EXTRAS_FILE = "megatron_extras.safetensors"
PADDING_SUFFIX = ".vocab_padding"
FP8_BUFFER_SUFFIXES = (".fp8_amax_history", ".fp8_amax_recorded_count")
WORD_EMBEDDING, POSITION_EMBEDDING, OUTPUT_LAYER = (
    "embedding.word_embeddings.weight", "embedding.position_embeddings.weight", "output_layer.weight")
# HF activation_function -> our MLP activation flags; the first name of each is the one written.
GPT2_ACTIVATIONS = {"gelu": {}, "relu2": {"squared_relu": True}, "gelu_pytorch_tanh": {"openai_gelu": True},
                    "gelu_new": {"openai_gelu": True}}


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """The model flags a conversion needs, named as pretrain_gpt.py's arguments are."""

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    kv_channels: int
    ffn_hidden_size: int
    vocab_size: int
    """The tokenizer's vocabulary: rows HF's embedding has."""
    padded_vocab_size: int
    """Rows of our embedding (vocab_size rounded up by --make-vocab-size-divisible-by x TP)."""
    max_position_embeddings: int
    position_embedding_type: str = "learned_absolute"
    rotary_percent: float = 1.0
    rotary_base: float = 10000
    use_rope_scaling: bool = False
    rope_scaling_factor: float = 8.0
    rotary_interleaved: bool = False
    rotary_seq_len_interpolation_factor: Optional[float] = None
    normalization: str = "LayerNorm"
    norm_epsilon: float = 1e-5
    apply_layernorm_1p: bool = False
    swiglu: bool = False
    squared_relu: bool = False
    openai_gelu: bool = False
    add_bias_linear: bool = True
    add_qkv_bias: bool = False
    apply_residual_connection_post_layernorm: bool = False
    qk_layernorm: bool = False
    untie_embeddings_and_output_weights: bool = False
    init_method_std: float = 0.02
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0

    # Flags newer than some checkpoints: arguments saved without them had their default.
    ADDED_LATER = ("use_rope_scaling", "rope_scaling_factor", "rotary_interleaved",
                   "rotary_seq_len_interpolation_factor", "openai_gelu", "add_qkv_bias",
                   "apply_residual_connection_post_layernorm")

    def __post_init__(self):
        if not 0 < self.vocab_size <= self.padded_vocab_size:
            raise ConversionError(f"vocabulary size {self.vocab_size} (--vocab-size) must be between 1 and the "
                                  f"{self.padded_vocab_size} rows of the word embedding")

    @classmethod
    def from_args(cls, args, vocab_size: int, padded_vocab_size: int) -> "ModelShape":
        """The shape of a checkpoint from the training arguments it recorded."""
        values = {"vocab_size": vocab_size, "padded_vocab_size": padded_vocab_size}
        for field in dataclasses.fields(cls):
            if field.name not in values:
                if not hasattr(args, field.name) and field.name in cls.ADDED_LATER:
                    continue
                if not hasattr(args, field.name):
                    raise ConversionError(f"the checkpoint's arguments lack '{field.name}' (written by an older "
                                          "version?); cannot tell the model's shape")
                values[field.name] = getattr(args, field.name)
        return cls(**values)

    def to_args(self) -> argparse.Namespace:
        """Arguments to record in a converted checkpoint, so that it converts again and training checks (or, with
        --use-checkpoint-args, takes) its model flags. No tokenizer: HF's is not one of ours, so the run's own
        --tokenizer-type and --vocab-size stay (the checkpoint's vocabulary size is recorded beside the args)."""
        model_flags = {name: value for name, value in dataclasses.asdict(self).items()
                       if name not in ("vocab_size", "padded_vocab_size")}
        return argparse.Namespace(**model_flags,
                                  group_query_attention=self.num_query_groups != self.num_attention_heads)

    def training_flags(self) -> str:
        """pretrain_gpt.py's model flags that build this model (what --use-checkpoint-args takes from it)."""
        flags = [f"--num-layers {self.num_layers}", f"--hidden-size {self.hidden_size}",
                 f"--ffn-hidden-size {self.ffn_hidden_size}", f"--num-attention-heads {self.num_attention_heads}"]
        if self.num_query_groups != self.num_attention_heads:
            flags.append(f"--group-query-attention --num-query-groups {self.num_query_groups}")
        if self.kv_channels * self.num_attention_heads != self.hidden_size:
            flags.append(f"--kv-channels {self.kv_channels}")
        flags += [f"--max-position-embeddings {self.max_position_embeddings}",
                  f"--position-embedding-type {self.position_embedding_type}"]
        if self.position_embedding_type == "rope":
            base = float(self.rotary_base)  # an int flag: HF's rope_theta is a float, 1e6 say
            flags.append(f"--rotary-base {int(base) if base.is_integer() else base!r}")
            if self.rotary_percent != 1.0:
                flags.append(f"--rotary-percent {self.rotary_percent:g}")
            if self.use_rope_scaling:
                flags.append(f"--use-rope-scaling --rope-scaling-factor {self.rope_scaling_factor:g}")
            if self.rotary_seq_len_interpolation_factor is not None:
                flags.append(f"--rotary-seq-len-interpolation-factor {self.rotary_seq_len_interpolation_factor:g}")
        flags += [f"--normalization {self.normalization}", f"--norm-epsilon {self.norm_epsilon:g}"]
        switches = ("rotary_interleaved", "apply_layernorm_1p", "swiglu", "squared_relu", "openai_gelu",
                    "add_qkv_bias", "apply_residual_connection_post_layernorm", "qk_layernorm",
                    "untie_embeddings_and_output_weights")
        flags += ["--" + name.replace("_", "-") for name in switches if getattr(self, name)]
        if not self.add_bias_linear:
            flags.append("--disable-bias-linear")
        return " ".join(flags)

    @property
    def heads_per_group(self) -> int:
        return self.num_attention_heads // self.num_query_groups

    @property
    def qkv_bias(self) -> bool:
        """Whether linear_qkv has a bias (every linear layer's, or --add-qkv-bias alone)."""
        return self.add_bias_linear or self.add_qkv_bias


# ----------------------------------------------------------------------------------------------------------
# Which architecture, and config.json both ways
# ----------------------------------------------------------------------------------------------------------


def _gpt2_problems(shape: ModelShape):
    problems = []
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
    return problems


def _llama_problems(shape: ModelShape, architecture: str):
    problems = []
    if architecture == QWEN3 and shape.add_bias_linear:
        problems.append("linear biases (no --disable-bias-linear): Qwen3, the architecture with query and key norms "
                        "(--qk-layernorm), has no MLP biases")
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


def architecture_for(shape: ModelShape) -> str:
    """GPT2 or LLAMA, or ConversionError listing every flag that keeps the model from being written exactly."""
    if shape.position_embedding_type == "rope":
        architecture = QWEN3 if shape.qk_layernorm else LLAMA
        problems = _llama_problems(shape, architecture)
        positions = "rotary positions (--position-embedding-type rope)"
    else:
        architecture, problems = GPT2, _gpt2_problems(shape)
        positions = "learned absolute positions"
        if shape.qk_layernorm:
            problems.append("--qk-layernorm: GPT-2 does not normalise query and key heads (with RoPE such a model "
                            "exports as Qwen3)")
    if shape.apply_residual_connection_post_layernorm:
        problems.append("--apply-residual-connection-post-layernorm: GPT-2 and Llama add the un-normalised input "
                        "of attention and MLP back (pre-norm residual)")
    if problems:
        raise ConversionError(
            f"this model cannot be written as a Hugging Face {architecture} (the architecture for {positions}) "
            "without changing what it computes: " + "; ".join(problems))
    return architecture


def hf_config(shape: ModelShape, architecture: str) -> dict:
    """config.json of the Hugging Face model (fp32 weights; no tokenizer ids: ours are not GPT-2's or Llama's)."""
    common = {"architectures": [architecture], "vocab_size": shape.vocab_size,
              "initializer_range": shape.init_method_std, "tie_word_embeddings":
              not shape.untie_embeddings_and_output_weights, "use_cache": True, "bos_token_id": None,
              "eos_token_id": None, "pad_token_id": None, "dtype": "float32", "torch_dtype": "float32"}
    if architecture == GPT2:
        flags = {"squared_relu": shape.squared_relu, "openai_gelu": shape.openai_gelu}
        activation = next(name for name, set_flags in GPT2_ACTIVATIONS.items()
                          if {flag: set_flags.get(flag, False) for flag in flags} == flags)
        return {"model_type": "gpt2", **common, "n_positions": shape.max_position_embeddings,
                "n_embd": shape.hidden_size, "n_layer": shape.num_layers, "n_head": shape.num_attention_heads,
                "n_inner": shape.ffn_hidden_size, "activation_function": activation,
                "layer_norm_epsilon": shape.norm_epsilon, "resid_pdrop": shape.hidden_dropout,
                "embd_pdrop": shape.hidden_dropout, "attn_pdrop": shape.attention_dropout,
                "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False,
                "reorder_and_upcast_attn": False}
    llama = {"model_type": LLAMA_RELATIVES[architecture], **common, "hidden_size": shape.hidden_size,
            "intermediate_size": shape.ffn_hidden_size, "num_hidden_layers": shape.num_layers,
            "num_attention_heads": shape.num_attention_heads, "num_key_value_heads": shape.num_query_groups,
            "head_dim": shape.kv_channels, "hidden_act": "silu",
            "max_position_embeddings": shape.max_position_embeddings, "rms_norm_eps": shape.norm_epsilon,
            "rope_theta": float(shape.rotary_base), **hf_rope_config(shape),
            "attention_bias": shape.qkv_bias, "mlp_bias": shape.add_bias_linear,
            "attention_dropout": shape.attention_dropout}
    if architecture == QWEN3:  # no mlp_bias (always none); full attention in every layer
        del llama["mlp_bias"]
        llama.update(use_sliding_window=False, sliding_window=None)
    return llama


def extras_metadata(shape: ModelShape, iteration: int) -> Dict[str, str]:
    return {"format": "megatron_hf_extras", "iteration": str(iteration),
            "megatron_model": json.dumps(dataclasses.asdict(shape))}


def _require(config, key, path):
    if key not in config:
        raise ConversionError(f"{path}: config.json has no '{key}'")
    return config[key]


def _architecture_of_config(config, path):
    """GPT2, LLAMA or QWEN3: the mapping that reads the directory (Mistral and Qwen2 are read as Llama)."""
    names = config.get("architectures") or []
    if GPT2 in names or config.get("model_type") == "gpt2":
        return GPT2
    if QWEN3 in names or config.get("model_type") == LLAMA_RELATIVES[QWEN3]:
        return QWEN3
    if any(name in names for name in LLAMA_RELATIVES) or config.get("model_type") in LLAMA_RELATIVES.values():
        return LLAMA
    raise ConversionError(f"{path}: config.json describes {names or config.get('model_type')!r}; only "
                          f"{', '.join((GPT2, *LLAMA_RELATIVES))} convert to our GPT model")


def _llama_biases(config, path):
    """(attention_bias, mlp_bias) of a Llama, Mistral or Qwen2 config.json, after refusing sliding-window
    attention, which our attention does not have."""
    window, positions = config.get("sliding_window"), config.get("max_position_embeddings")
    layer_types = config.get("layer_types") or []
    if any(kind != "full_attention" for kind in layer_types) or config.get("use_sliding_window"):
        raise ConversionError(f"{path}: sliding-window attention (config.json use_sliding_window / layer_types "
                              f"{sorted(set(layer_types))}): our attention is causal over the whole sequence")
    if config.get("model_type") == "mistral" and window is not None and (positions is None or window < positions):
        raise ConversionError(f"{path}: sliding_window {window} below max_position_embeddings {positions}: our "
                              "attention is causal over the whole sequence (Mistral with sliding_window null, or "
                              "a window covering every position, imports)")
    if config.get("model_type") == "qwen2":
        return True, False  # Qwen2's q, k and v projections have biases, its other linear layers none
    if config.get("model_type") == "qwen3":
        return bool(config.get("attention_bias", False)), False  # Qwen3's MLP has no biases
    return bool(config.get("attention_bias", False)), bool(config.get("mlp_bias", False))


def shape_from_hf_config(config: dict, path: str, recorded: Optional[dict], padded_vocab_size: int,
                         apply_layernorm_1p: bool) -> Tuple[ModelShape, str]:
    """(shape, architecture) of a Hugging Face directory. config.json decides everything it says; `recorded`
    (the extras' megatron_model, None for a model from elsewhere) adds what it cannot say; `padded_vocab_size`
    and `apply_layernorm_1p` are used where nothing is recorded."""
    architecture = _architecture_of_config(config, path)
    recorded = recorded or {}
    vocab_size = _require(config, "vocab_size", path)
    values = {"vocab_size": vocab_size, "init_method_std": config.get("initializer_range", 0.02),
              "padded_vocab_size": recorded.get("padded_vocab_size", padded_vocab_size),
              "apply_layernorm_1p": recorded.get("apply_layernorm_1p", apply_layernorm_1p)}
    if architecture == GPT2:
        activation = config.get("activation_function", "gelu_new")
        if activation not in GPT2_ACTIVATIONS:
            raise ConversionError(f"{path}: activation_function '{activation}' has no counterpart in our MLP (exact "
                                  "GeLU is 'gelu', --openai-gelu is 'gelu_pytorch_tanh' or 'gelu_new', "
                                  "--squared-relu is 'relu2')")
        if not config.get("scale_attn_weights", True) or config.get("scale_attn_by_inverse_layer_idx", False):
            raise ConversionError(f"{path}: scale_attn_weights false or scale_attn_by_inverse_layer_idx true: our "
                                  "attention scales by 1 / sqrt(head_dim) only")
        hidden, heads = _require(config, "n_embd", path), _require(config, "n_head", path)
        values.update(
            num_layers=_require(config, "n_layer", path), hidden_size=hidden, num_attention_heads=heads,
            num_query_groups=heads, kv_channels=hidden // heads, ffn_hidden_size=config.get("n_inner") or 4 * hidden,
            max_position_embeddings=_require(config, "n_positions", path), normalization="LayerNorm",
            norm_epsilon=config.get("layer_norm_epsilon", 1e-5), **GPT2_ACTIVATIONS[activation],
            add_bias_linear=recorded.get("add_bias_linear", True), add_qkv_bias=recorded.get("add_qkv_bias", False),
            untie_embeddings_and_output_weights=not config.get("tie_word_embeddings", True),
            hidden_dropout=config.get("resid_pdrop", 0.0), attention_dropout=config.get("attn_pdrop", 0.0))
    else:
        if config.get("hidden_act", "silu") != "silu":
            raise ConversionError(f"{path}: hidden_act '{config['hidden_act']}': our gated MLP is SwiGLU (silu)")
        attention_bias, mlp_bias = _llama_biases(config, path)
        if mlp_bias and not attention_bias:
            raise ConversionError(f"{path}: mlp_bias true with attention_bias false; our linear layers all have "
                                  "biases, none (--disable-bias-linear) or only the QKV one (--add-qkv-bias)")
        hidden, heads = _require(config, "hidden_size", path), _require(config, "num_attention_heads", path)
        values.update(
            num_layers=_require(config, "num_hidden_layers", path), hidden_size=hidden, num_attention_heads=heads,
            num_query_groups=config.get("num_key_value_heads") or heads,
            kv_channels=config.get("head_dim") or hidden // heads,
            ffn_hidden_size=_require(config, "intermediate_size", path),
            max_position_embeddings=_require(config, "max_position_embeddings", path),
            position_embedding_type="rope", **rope_flags_of_config(config, path),
            rotary_interleaved=recorded.get("rotary_interleaved", False), normalization="RMSNorm",
            qk_layernorm=architecture == QWEN3,
            norm_epsilon=config.get("rms_norm_eps", 1e-6), swiglu=True, add_bias_linear=mlp_bias,
            add_qkv_bias=attention_bias and not mlp_bias,
            untie_embeddings_and_output_weights=not config.get("tie_word_embeddings", False),
            hidden_dropout=recorded.get("hidden_dropout", 0.0), attention_dropout=config.get("attention_dropout", 0.0))
    if values["padded_vocab_size"] < vocab_size:
        raise ConversionError(f"{path}: vocab_size {vocab_size} in config.json exceeds the recorded padded "
                              f"vocabulary ({values['padded_vocab_size']}); delete {EXTRAS_FILE} to pad anew")
    return ModelShape(**values), architecture


# ----------------------------------------------------------------------------------------------------------
# Tensor layouts
# ----------------------------------------------------------------------------------------------------------


def split_qkv(fused: torch.Tensor, shape: ModelShape):
    """linear_qkv's weight or bias -> (q, k, v), each with heads in order (query head h = g * m + j)."""
    groups, per_group, head_dim = shape.num_query_groups, shape.heads_per_group, shape.kv_channels
    blocks = fused.reshape(groups, per_group + 2, head_dim, *fused.shape[1:])
    rest = fused.shape[1:]
    query = blocks[:, :per_group].reshape(groups * per_group * head_dim, *rest)
    return query, blocks[:, per_group].reshape(groups * head_dim, *rest), \
        blocks[:, per_group + 1].reshape(groups * head_dim, *rest)


def fuse_qkv(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, shape: ModelShape) -> torch.Tensor:
    groups, per_group, head_dim = shape.num_query_groups, shape.heads_per_group, shape.kv_channels
    rest = query.shape[1:]
    blocks = (query.reshape(groups, per_group, head_dim, *rest), key.reshape(groups, 1, head_dim, *rest),
              value.reshape(groups, 1, head_dim, *rest))
    return torch.cat(blocks, dim=1).reshape(-1, *rest)


def split_gate_up(fc1: torch.Tensor):
    """SwiGLU linear_fc1's weight or bias -> (gate, up)."""
    return fc1[0::2], fc1[1::2]


def fuse_gate_up(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return torch.stack((gate, up), dim=1).reshape(-1, *gate.shape[1:])


class _Source:
    """Named tensors taken one at a time; what is missing or has the wrong shape is an error naming it."""

    def __init__(self, tensors: Dict[str, torch.Tensor], where: str, described_by: str):
        self.tensors, self.where, self.described_by = dict(tensors), where, described_by

    def take(self, name: str, shape=None) -> torch.Tensor:
        if name not in self.tensors:
            raise ConversionError(f"{self.where} has no tensor '{name}'")
        tensor = self.tensors.pop(name)
        if shape is not None and tuple(tensor.shape) != tuple(shape):
            raise ConversionError(f"{self.where}: '{name}' has shape {tuple(tensor.shape)}, the model "
                                  f"{self.described_by} describes needs {tuple(shape)}")
        return tensor


# ----------------------------------------------------------------------------------------------------------
# Ours -> Hugging Face
# ----------------------------------------------------------------------------------------------------------


def _query_key_rows(rows: torch.Tensor, shape: ModelShape, to_hf: bool) -> torch.Tensor:
    """q or k rows (weight or bias) in HF's rotate-half channel order (`to_hf`) or back in ours: with
    --rotary-interleaved each head's channels 2i, 2i + 1 become i, i + head_dim / 2 (the same permutation of q
    and k keeps every attention score), otherwise they are the same."""
    if not shape.rotary_interleaved:
        return rows
    head_dim, rest = shape.kv_channels, rows.shape[1:]
    heads = rows.reshape(-1, *((head_dim // 2, 2) if to_hf else (2, head_dim // 2)), *rest)
    return heads.transpose(1, 2).reshape(rows.shape)


def to_hf_tensors(model: Dict[str, torch.Tensor], shape: ModelShape, architecture: str):
    """(HF tensors by HF name, extras by our name) of our fp32 model tensors by logical name."""
    source, hf, extras = _Source(model, "the checkpoint", "its recorded arguments"), {}, {}
    qkv_rows = (shape.num_attention_heads + 2 * shape.num_query_groups) * shape.kv_channels

    def norm(name):
        weight = source.take(name)
        if not shape.apply_layernorm_1p or name.endswith(".bias"):
            return weight
        extras[name] = weight
        return weight + 1

    def bias(name, rows):
        return source.take(name) if shape.add_bias_linear else torch.zeros(rows)

    vocab = shape.vocab_size

    def unpadded(name):
        table = source.take(name, (shape.padded_vocab_size, shape.hidden_size))
        extras[name + PADDING_SUFFIX] = table[vocab:]
        return table[:vocab]

    gpt2 = architecture == GPT2
    if gpt2:
        hf["transformer.wte.weight"] = unpadded(WORD_EMBEDDING)
        hf["transformer.wpe.weight"] = source.take(POSITION_EMBEDDING)
    else:
        hf["model.embed_tokens.weight"] = unpadded(WORD_EMBEDDING)
    hidden, ffn = shape.hidden_size, shape.ffn_hidden_size
    for index in range(shape.num_layers):
        ours = f"decoder.layers.{index}."
        if gpt2:
            theirs = f"transformer.h.{index}."
            for norm_name, hf_norm in (("input_layernorm", "ln_1"), ("pre_mlp_layernorm", "ln_2")):
                for kind in ("weight", "bias"):
                    hf[f"{theirs}{hf_norm}.{kind}"] = norm(f"{ours}{norm_name}.{kind}")
            qkv = split_qkv(source.take(ours + "self_attention.linear_qkv.weight", (qkv_rows, hidden)), shape)
            hf[theirs + "attn.c_attn.weight"] = torch.cat(qkv).t()
            hf[theirs + "attn.c_attn.bias"] = (
                torch.cat(split_qkv(source.take(ours + "self_attention.linear_qkv.bias"), shape))
                if shape.qkv_bias else torch.zeros(3 * hidden))
            hf[theirs + "attn.c_proj.weight"] = source.take(ours + "self_attention.linear_proj.weight").t()
            hf[theirs + "attn.c_proj.bias"] = bias(ours + "self_attention.linear_proj.bias", hidden)
            hf[theirs + "mlp.c_fc.weight"] = source.take(ours + "mlp.linear_fc1.weight").t()
            hf[theirs + "mlp.c_fc.bias"] = bias(ours + "mlp.linear_fc1.bias", ffn)
            hf[theirs + "mlp.c_proj.weight"] = source.take(ours + "mlp.linear_fc2.weight").t()
            hf[theirs + "mlp.c_proj.bias"] = bias(ours + "mlp.linear_fc2.bias", hidden)
            continue
        theirs = f"model.layers.{index}."
        hf[theirs + "input_layernorm.weight"] = norm(ours + "input_layernorm.weight")
        hf[theirs + "post_attention_layernorm.weight"] = norm(ours + "pre_mlp_layernorm.weight")
        if shape.qk_layernorm:  # one norm over head_dim, its channels in the order of the q and k rows
            for our_norm, hf_norm in (("q_layernorm", "q_norm"), ("k_layernorm", "k_norm")):
                hf[f"{theirs}self_attn.{hf_norm}.weight"] = _query_key_rows(
                    norm(f"{ours}self_attention.{our_norm}.weight"), shape, to_hf=True)
        linears = {"self_attention.linear_proj": "self_attn.o_proj", "mlp.linear_fc2": "mlp.down_proj"}
        for kind in ("weight", "bias") if shape.qkv_bias else ("weight",):
            columns = (hidden,) if kind == "weight" else ()
            query, key, value = split_qkv(source.take(f"{ours}self_attention.linear_qkv.{kind}", (qkv_rows, *columns)),
                                          shape)
            hf[f"{theirs}self_attn.q_proj.{kind}"] = _query_key_rows(query, shape, to_hf=True)
            hf[f"{theirs}self_attn.k_proj.{kind}"] = _query_key_rows(key, shape, to_hf=True)
            hf[f"{theirs}self_attn.v_proj.{kind}"] = value
        if not shape.add_bias_linear and shape.add_qkv_bias:  # attention_bias gives o_proj a bias too
            hf[theirs + "self_attn.o_proj.bias"] = torch.zeros(hidden)
        for kind in ("weight", "bias") if shape.add_bias_linear else ("weight",):
            gate, up = split_gate_up(source.take(f"{ours}mlp.linear_fc1.{kind}"))
            hf[f"{theirs}mlp.gate_proj.{kind}"], hf[f"{theirs}mlp.up_proj.{kind}"] = gate, up
            for our_linear, hf_linear in linears.items():
                hf[f"{theirs}{hf_linear}.{kind}"] = source.take(f"{ours}{our_linear}.{kind}")
    final_norm = "transformer.ln_f" if gpt2 else "model.norm"
    for kind in ("weight", "bias") if gpt2 else ("weight",):
        hf[f"{final_norm}.{kind}"] = norm(f"decoder.final_layernorm.{kind}")
    if shape.untie_embeddings_and_output_weights:
        hf["lm_head.weight"] = unpadded(OUTPUT_LAYER)
    for name in list(source.tensors):
        if name.endswith(FP8_BUFFER_SUFFIXES):
            extras[name] = source.take(name)
    if source.tensors:
        raise ConversionError(f"the checkpoint's tensors {sorted(source.tensors)[:4]} have no place in a Hugging "
                              f"Face {architecture} built from its arguments; were they written by another model?")
    return {name: tensor.contiguous() for name, tensor in hf.items()}, \
        {name: tensor.contiguous() for name, tensor in extras.items()}


# ----------------------------------------------------------------------------------------------------------
# Hugging Face -> ours
# ----------------------------------------------------------------------------------------------------------


def _with_gpt2_prefix(tensors):
    """GPT2LMHeadModel names; a GPT2Model file (names without 'transformer.') reads the same."""
    return {name if name.startswith(("transformer.", "lm_head.")) else "transformer." + name: tensor
            for name, tensor in tensors.items()}


def from_hf_tensors(hf_tensors: Dict[str, torch.Tensor], extras: Dict[str, torch.Tensor], shape: ModelShape,
                    architecture: str, where: str) -> Dict[str, torch.Tensor]:
    """Our logical fp32 model tensors from HF tensors (any float dtype) and the extras (possibly empty)."""
    gpt2 = architecture == GPT2
    hf_tensors = {name: tensor.float() for name, tensor in hf_tensors.items()}
    hf_tensors = _with_gpt2_prefix(hf_tensors) if gpt2 else hf_tensors
    source = _Source(hf_tensors, where, "config.json")
    model = {}
    hidden, ffn, vocab = shape.hidden_size, shape.ffn_hidden_size, shape.vocab_size
    heads_width = shape.num_attention_heads * shape.kv_channels
    groups_width = shape.num_query_groups * shape.kv_channels

    def norm(name, hf_name, width=hidden, to_ours=lambda tensor: tensor):
        weight = to_ours(source.take(hf_name, (width,)))
        if not shape.apply_layernorm_1p or name.endswith(".bias"):
            model[name] = weight
            return
        stored = weight - 1
        recorded = extras.get(name)
        if recorded is not None and recorded.shape == weight.shape:
            stored = torch.where(recorded + 1 == weight, recorded, stored)
        model[name] = stored

    def bias(name, hf_name, rows, to_ours=lambda tensor: tensor, kept=shape.add_bias_linear):
        tensor = source.take(hf_name, (rows,))
        if kept:
            model[name] = to_ours(tensor)
        elif torch.count_nonzero(tensor) and gpt2:
            raise ConversionError(f"{where}: '{hf_name}' is not zero, but the model was exported with "
                                  f"--disable-bias-linear (as {EXTRAS_FILE} records); delete that file to import "
                                  "it as a model with biases")
        elif torch.count_nonzero(tensor):
            raise ConversionError(f"{where}: '{hf_name}' is not zero, but config.json's attention_bias without "
                                  "mlp_bias reads as --disable-bias-linear --add-qkv-bias, whose attention output "
                                  "projection has no bias")

    def padded(name, hf_name):
        table = source.take(hf_name, (vocab, hidden))
        padding = extras.get(name + PADDING_SUFFIX)
        rows = shape.padded_vocab_size - vocab
        if padding is None or tuple(padding.shape) != (rows, hidden):
            padding = torch.zeros(rows, hidden)
        model[name] = torch.cat((table, padding))

    if gpt2:
        padded(WORD_EMBEDDING, "transformer.wte.weight")
        model[POSITION_EMBEDDING] = source.take("transformer.wpe.weight", (shape.max_position_embeddings, hidden))
    else:
        padded(WORD_EMBEDDING, "model.embed_tokens.weight")
    for index in range(shape.num_layers):
        ours = f"decoder.layers.{index}."
        if gpt2:
            theirs = f"transformer.h.{index}."
            for norm_name, hf_norm in (("input_layernorm", "ln_1"), ("pre_mlp_layernorm", "ln_2")):
                for kind in ("weight", "bias"):
                    norm(f"{ours}{norm_name}.{kind}", f"{theirs}{hf_norm}.{kind}")
            qkv = source.take(theirs + "attn.c_attn.weight", (hidden, 3 * hidden)).t()
            model[ours + "self_attention.linear_qkv.weight"] = fuse_qkv(*qkv.split(hidden), shape)
            bias(ours + "self_attention.linear_qkv.bias", theirs + "attn.c_attn.bias", 3 * hidden,
                 lambda qkv_bias: fuse_qkv(*qkv_bias.split(hidden), shape), kept=shape.qkv_bias)
            model[ours + "self_attention.linear_proj.weight"] = source.take(
                theirs + "attn.c_proj.weight", (hidden, hidden)).t()
            bias(ours + "self_attention.linear_proj.bias", theirs + "attn.c_proj.bias", hidden)
            model[ours + "mlp.linear_fc1.weight"] = source.take(theirs + "mlp.c_fc.weight", (hidden, ffn)).t()
            bias(ours + "mlp.linear_fc1.bias", theirs + "mlp.c_fc.bias", ffn)
            model[ours + "mlp.linear_fc2.weight"] = source.take(theirs + "mlp.c_proj.weight", (ffn, hidden)).t()
            bias(ours + "mlp.linear_fc2.bias", theirs + "mlp.c_proj.bias", hidden)
            for buffer in ("attn.bias", "attn.masked_bias"):  # causal-mask buffers older GPT-2 files carry
                source.tensors.pop(theirs + buffer, None)
            continue
        theirs = f"model.layers.{index}."
        norm(ours + "input_layernorm.weight", theirs + "input_layernorm.weight")
        norm(ours + "pre_mlp_layernorm.weight", theirs + "post_attention_layernorm.weight")
        if shape.qk_layernorm:
            for our_norm, hf_norm in (("q_layernorm", "q_norm"), ("k_layernorm", "k_norm")):
                norm(f"{ours}self_attention.{our_norm}.weight", f"{theirs}self_attn.{hf_norm}.weight",
                     shape.kv_channels, lambda weight: _query_key_rows(weight, shape, to_hf=False))
        for kind in ("weight", "bias") if shape.qkv_bias else ("weight",):
            columns = (hidden,) if kind == "weight" else ()
            query = source.take(f"{theirs}self_attn.q_proj.{kind}", (heads_width, *columns))
            key = source.take(f"{theirs}self_attn.k_proj.{kind}", (groups_width, *columns))
            value = source.take(f"{theirs}self_attn.v_proj.{kind}", (groups_width, *columns))
            model[f"{ours}self_attention.linear_qkv.{kind}"] = fuse_qkv(
                _query_key_rows(query, shape, to_hf=False), _query_key_rows(key, shape, to_hf=False), value, shape)
        if not shape.add_bias_linear and shape.add_qkv_bias and theirs + "self_attn.o_proj.bias" in source.tensors:
            # Llama's attention_bias gives o_proj a bias, which must be zero; Qwen2's o_proj has none
            bias(ours + "self_attention.linear_proj.bias", theirs + "self_attn.o_proj.bias", hidden)
        for kind in ("weight", "bias") if shape.add_bias_linear else ("weight",):
            columns = (hidden,) if kind == "weight" else ()
            model[f"{ours}self_attention.linear_proj.{kind}"] = source.take(
                f"{theirs}self_attn.o_proj.{kind}", (hidden, heads_width)[:len(columns) + 1])
            gate = source.take(f"{theirs}mlp.gate_proj.{kind}", (ffn, *columns))
            up = source.take(f"{theirs}mlp.up_proj.{kind}", (ffn, *columns))
            model[f"{ours}mlp.linear_fc1.{kind}"] = fuse_gate_up(gate, up)
            model[f"{ours}mlp.linear_fc2.{kind}"] = source.take(
                f"{theirs}mlp.down_proj.{kind}", (hidden, ffn)[:len(columns) + 1])
        source.tensors.pop(theirs + "self_attn.rotary_emb.inv_freq", None)  # a buffer older Llama files carry
    final_norm = "transformer.ln_f" if gpt2 else "model.norm"
    for kind in ("weight", "bias") if gpt2 else ("weight",):
        norm(f"decoder.final_layernorm.{kind}", f"{final_norm}.{kind}")
    if shape.untie_embeddings_and_output_weights:
        padded(OUTPUT_LAYER, "lm_head.weight")
    else:
        lm_head = source.tensors.pop("lm_head.weight", None)  # some writers save the tied copy as well
        if lm_head is not None and not torch.equal(lm_head, hf_tensors.get("transformer.wte.weight" if gpt2 else
                                                                            "model.embed_tokens.weight", lm_head)):
            raise ConversionError(f"{where}: 'lm_head.weight' differs from the word embedding, but config.json "
                                  "says tie_word_embeddings; set it to false to import an untied output layer")
    if source.tensors:
        raise ConversionError(f"{where}: tensors {sorted(source.tensors)[:4]} have no place in our GPT model as "
                              "config.json describes it")
    for name, tensor in extras.items():
        if name.endswith(FP8_BUFFER_SUFFIXES):
            model[name] = tensor
    return {name: tensor.contiguous() for name, tensor in model.items()}
