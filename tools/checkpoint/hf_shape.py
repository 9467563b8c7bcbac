"""ModelShape: the model flags a Hugging Face conversion needs, read from a checkpoint's training arguments and
written back as arguments and as pretrain_gpt.py's command line."""

import argparse
import dataclasses
from typing import Optional, Tuple, Union

from megatron.core.ssm.mamba_config import mamba_heads
from megatron.core.transformer.moe.moe_config import layer_pattern_from_freq

from hf_errors import ConversionError
from hf_rope import yarn_training_flags

TRAINING_DEFAULT_DROPOUT = 0.1  # pretrain_gpt.py's --hidden-dropout and --attention-dropout


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
    num_experts: Optional[int] = None
    """Experts per MoE layer; None: a dense model (the fields below then keep their defaults)."""
    moe_ffn_hidden_size: Optional[int] = None
    moe_router_topk: int = 2
    moe_layer_freq: Union[int, Tuple[int, ...], list] = 1
    moe_router_pre_softmax: bool = False
    moe_shared_expert_intermediate_size: Optional[int] = None
    moe_shared_expert_gate: bool = False
    moe_latent_size: Optional[int] = None
    """--moe-latent-size: the experts' token width (None: the hidden width); Nemotron-H's moe_latent_size."""
    # gpt-oss (hf_gpt_oss.py): its gated MLP, attention sinks, sliding-window layers and router bias
    quick_geglu: bool = False
    activation_func_clamp_value: Optional[float] = None
    glu_linear_offset: float = 0.0
    softmax_type: str = "vanilla"
    window_size: Optional[Tuple[int, int]] = None
    window_attn_skip_freq: Union[None, int, Tuple[int, ...], list] = None
    moe_router_bias: bool = False
    # DeepSeek-V3 (hf_deepseek.py): the router's scores, bias, groups and scale; latent attention; MTP depths
    moe_router_score_function: str = "softmax"
    moe_router_enable_expert_bias: bool = False
    moe_router_num_groups: Optional[int] = None
    moe_router_group_topk: Optional[int] = None
    moe_router_topk_scaling_factor: Optional[float] = None
    multi_latent_attention: bool = False
    q_lora_rank: Optional[int] = None
    kv_lora_rank: int = 32  # the latent shape: the command line's defaults, which a model without it keeps
    qk_head_dim: int = 128
    qk_pos_emb_head_dim: int = 64
    v_head_dim: int = 128
    rope_type: Optional[str] = None
    rotary_scaling_factor: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0
    original_max_position_embeddings: Optional[int] = None
    mtp_num_layers: Optional[int] = None
    # YaRN of standard attention (--position-embedding-type yarn; gpt-oss), hf_rope.py
    yarn_rotary_scaling_factor: float = 1.0
    yarn_original_max_position_embeddings: int = 4096
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    yarn_mscale: float = 1.0
    yarn_mscale_all_dim: float = 0.0
    yarn_correction_range_round_to_int: bool = True
    # Hybrid models (hf_hybrid.py): one of M (Mamba), * (attention), - (MLP) per layer, and the Mamba mixer
    hybrid_layer_pattern: Optional[str] = None
    """--hybrid-override-pattern; None: every layer is a transformer layer (attention then MLP)."""
    mamba_state_dim: int = 128
    mamba_head_dim: int = 64
    mamba_num_groups: int = 8
    mamba_num_heads: Optional[int] = None
    """None: 2 x hidden_size / mamba_head_dim, as training derives it."""
    mamba_dt_limit: Optional[tuple] = None
    """--mamba-dt-limit (low, high) of each Mamba step; None: no clamp."""
    # Heterogeneous layers (hf_nemotron_nas.py): each layer's shape from a Llama-Nemotron block_configs JSON
    heterogeneous_layers_config_encoded_json: Optional[str] = None
    """--heterogeneous-layers-config-encoded-json (the JSON text); None: uniform layers."""
    YARN_FIELDS = ("yarn_rotary_scaling_factor", "yarn_original_max_position_embeddings", "yarn_beta_fast",
                   "yarn_beta_slow", "yarn_mscale", "yarn_mscale_all_dim", "yarn_correction_range_round_to_int")

    MOE_FIELDS = ("num_experts", "moe_ffn_hidden_size", "moe_router_topk", "moe_layer_freq", "moe_router_pre_softmax",
                  "moe_shared_expert_intermediate_size", "moe_shared_expert_gate", "moe_latent_size")
    DEEPSEEK_ROUTER_FIELDS = ("moe_router_score_function", "moe_router_enable_expert_bias", "moe_router_num_groups",
                              "moe_router_group_topk", "moe_router_topk_scaling_factor")
    DEEPSEEK_FIELDS = (*DEEPSEEK_ROUTER_FIELDS, "multi_latent_attention", "q_lora_rank", "kv_lora_rank", "qk_head_dim",
                       "qk_pos_emb_head_dim", "v_head_dim", "rope_type", "rotary_scaling_factor", "mscale",
                       "mscale_all_dim", "original_max_position_embeddings", "mtp_num_layers")
    HYBRID_FIELDS = ("hybrid_layer_pattern", "mamba_state_dim", "mamba_head_dim", "mamba_num_groups",
                     "mamba_num_heads", "mamba_dt_limit")
    # Flags newer than some checkpoints: arguments saved without them had their default.
    ADDED_LATER = ("use_rope_scaling", "rope_scaling_factor", "rotary_interleaved",
                   "rotary_seq_len_interpolation_factor", "openai_gelu", "add_qkv_bias",
                   "apply_residual_connection_post_layernorm", *MOE_FIELDS, "quick_geglu",
                   "activation_func_clamp_value", "glu_linear_offset", "softmax_type", "window_size",
                   "window_attn_skip_freq", *DEEPSEEK_FIELDS, *YARN_FIELDS, "moe_router_bias", *HYBRID_FIELDS,
                   "heterogeneous_layers_config_encoded_json")

    def __post_init__(self):
        if not 0 < self.vocab_size <= self.padded_vocab_size:
            raise ConversionError(f"vocabulary size {self.vocab_size} (--vocab-size) must be between 1 and the "
                                  f"{self.padded_vocab_size} rows of the word embedding")

    @classmethod
    def from_args(cls, args, vocab_size: int, padded_vocab_size: int) -> "ModelShape":
        """The shape of a checkpoint from the training arguments it recorded."""
        values = {"vocab_size": vocab_size, "padded_vocab_size": padded_vocab_size}
        if not hasattr(args, "hybrid_layer_pattern"):  # validation resolves it; arguments from elsewhere may not
            values["hybrid_layer_pattern"] = getattr(args, "hybrid_override_pattern", None)
        for field in dataclasses.fields(cls):
            if field.name not in values:
                if not hasattr(args, field.name) and field.name in cls.ADDED_LATER:
                    continue
                if not hasattr(args, field.name):
                    raise ConversionError(f"the checkpoint's arguments lack '{field.name}' (written by an older "
                                          "version?); cannot tell the model's shape")
                values[field.name] = getattr(args, field.name)
        if not values.get("num_experts"):  # --num-experts 0 is no MoE, as in training
            values.update({field.name: field.default for field in dataclasses.fields(cls)
                           if field.name in cls.MOE_FIELDS + cls.DEEPSEEK_ROUTER_FIELDS})
        elif values.get("moe_ffn_hidden_size") is None:  # the experts' width defaults to --ffn-hidden-size
            values["moe_ffn_hidden_size"] = values["ffn_hidden_size"]
        return cls(**values)

    def to_args(self) -> argparse.Namespace:
        """Arguments to record in a converted checkpoint, so that it converts again and training checks (or, with
        --use-checkpoint-args, takes) its model flags. No tokenizer: HF's is not one of ours, so the run's own
        --tokenizer-type and --vocab-size stay (the checkpoint's vocabulary size is recorded beside the args)."""
        model_flags = {name: value for name, value in dataclasses.asdict(self).items()
                       if name not in ("vocab_size", "padded_vocab_size")}
        if self.hybrid_layer_pattern is not None:  # the flags that build it again
            model_flags.update(is_hybrid_model=True, hybrid_override_pattern=self.hybrid_layer_pattern)
        return argparse.Namespace(**model_flags,
                                  group_query_attention=self.num_query_groups != self.num_attention_heads)

    def training_flags(self, heterogeneous_config_path: Optional[str] = None) -> str:
        """pretrain_gpt.py's model flags that build this model (what --use-checkpoint-args takes from it);
        `heterogeneous_config_path`: a config.json holding the heterogeneous layers' JSON, named in its place."""
        flags = [f"--num-layers {self.num_layers}", f"--hidden-size {self.hidden_size}",
                 f"--ffn-hidden-size {self.ffn_hidden_size}", f"--num-attention-heads {self.num_attention_heads}"]
        if self.num_query_groups != self.num_attention_heads:
            flags.append(f"--group-query-attention --num-query-groups {self.num_query_groups}")
        if self.kv_channels * self.num_attention_heads != self.hidden_size:
            flags.append(f"--kv-channels {self.kv_channels}")
        flags += [f"--max-position-embeddings {self.max_position_embeddings}",
                  f"--position-embedding-type {self.position_embedding_type}"]
        if self.position_embedding_type in ("rope", "yarn"):
            base = float(self.rotary_base)  # an int flag: HF's rope_theta is a float, 1e6 say
            flags.append(f"--rotary-base {int(base) if base.is_integer() else base!r}")
            if self.rotary_percent != 1.0:
                flags.append(f"--rotary-percent {self.rotary_percent:g}")
            if self.use_rope_scaling:
                flags.append(f"--use-rope-scaling --rope-scaling-factor {self.rope_scaling_factor:g}")
            if self.rotary_seq_len_interpolation_factor is not None:
                flags.append(f"--rotary-seq-len-interpolation-factor {self.rotary_seq_len_interpolation_factor:g}")
            flags += yarn_training_flags(self)
        flags += [f"--normalization {self.normalization}", f"--norm-epsilon {self.norm_epsilon:g}"]
        switches = ("rotary_interleaved", "apply_layernorm_1p", "swiglu", "squared_relu", "openai_gelu",
                    "add_qkv_bias", "apply_residual_connection_post_layernorm", "qk_layernorm",
                    "untie_embeddings_and_output_weights")
        flags += ["--" + name.replace("_", "-") for name in switches if getattr(self, name)]
        if not self.add_bias_linear:
            flags.append("--disable-bias-linear")
        if self.num_experts:
            flags.append(f"--num-experts {self.num_experts} --moe-ffn-hidden-size {self.moe_ffn_hidden_size} "
                         f"--moe-router-topk {self.moe_router_topk}")
            if not all(self.moe_layers):
                flags.append("--moe-layer-freq [" + ",".join(str(int(moe)) for moe in self.moe_layers) + "]")
            if self.moe_router_pre_softmax:
                flags.append("--moe-router-pre-softmax")
            if self.moe_shared_expert_intermediate_size:
                flags.append(f"--moe-shared-expert-intermediate-size {self.moe_shared_expert_intermediate_size}")
            if self.moe_shared_expert_gate:
                flags.append("--moe-shared-expert-gate")
            if self.moe_latent_size:
                flags.append(f"--moe-latent-size {self.moe_latent_size}")
        if self.hybrid_layer_pattern is not None:  # a pattern starting with '-' would read as a flag without '='
            flags.append(f"--hybrid-override-pattern={self.hybrid_layer_pattern}"
                         if self.hybrid_layer_pattern.startswith("-") else
                         f"--hybrid-override-pattern {self.hybrid_layer_pattern}")
            flags.append(f"--mamba-state-dim {self.mamba_state_dim} --mamba-head-dim {self.mamba_head_dim} "
                         f"--mamba-num-groups {self.mamba_num_groups}")
            if self.mamba_num_heads is not None:
                flags.append(f"--mamba-num-heads {self.mamba_num_heads}")
            if self.mamba_dt_limit is not None:
                flags.append(f"--mamba-dt-limit {self.mamba_dt_limit[0]:g} {self.mamba_dt_limit[1]:g}")
        # --use-checkpoint-args takes the recorded dropout too; given here where it is not training's default
        for name, rate in (("hidden-dropout", self.hidden_dropout), ("attention-dropout", self.attention_dropout)):
            if rate != TRAINING_DEFAULT_DROPOUT:
                flags.append(f"--{name} {rate:g}")
        from hf_deepseek import training_flags as deepseek_training_flags
        from hf_gpt_oss import gpt_oss_training_flags
        from hf_nemotron_nas import training_flags as heterogeneous_training_flags

        return " ".join(flags + gpt_oss_training_flags(self) + deepseek_training_flags(self)
                        + heterogeneous_training_flags(self, heterogeneous_config_path))

    @property
    def moe_layers(self) -> list:
        """One bool per layer: whether its MLP is a Mixture-of-Experts layer (--moe-layer-freq)."""
        if not self.num_experts:
            return [False] * self.num_layers
        return layer_pattern_from_freq(self.moe_layer_freq, self.num_layers)

    @property
    def mamba_heads(self) -> int:
        """Heads of each Mamba mixer (--mamba-num-heads, else 2 x hidden / head dim)."""
        return mamba_heads(self.hidden_size, self.mamba_head_dim, self.mamba_num_heads)

    @property
    def mamba_inner_size(self) -> int:
        return self.mamba_heads * self.mamba_head_dim

    def layers_marked(self, symbol: str) -> list:
        """The indices of the layers the hybrid pattern marks `symbol` (none for a model without one)."""
        return [index for index, mark in enumerate(self.hybrid_layer_pattern or "") if mark == symbol]

    @property
    def heads_per_group(self) -> int:
        return self.num_attention_heads // self.num_query_groups

    @property
    def qkv_bias(self) -> bool:
        """Whether linear_qkv has a bias (every linear layer's, or --add-qkv-bias alone)."""
        return self.add_bias_linear or self.add_qkv_bias
