"""`TransformerConfig`: the shape and training switches of a transformer, validated once when it is built.

It extends `ModelParallelConfig` (parallel sizes, dtypes) with the model's own fields. The dataclass is frozen;
derived defaults (ffn size, head size, init methods, activation) are filled in `__post_init__`, and every bad
combination is rejected there with a message that names the command-line flag to change.

Derived fields keep their values once filled: `dataclasses.replace(config, hidden_size=...)` re-validates but
keeps the old ffn_hidden_size / kv_channels / init methods unless they are passed as None again.
"""

from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from megatron.core.model_parallel_config import ModelParallelConfig, allow_runtime_hook_assignment
from megatron.core.offloading.fine_grained import EXPERT_MODULES, OFFLOADABLE_MODULES
from megatron.core.transformer.init_methods import init_method_normal, scaled_init_method_normal
from megatron.core.ssm.mamba_config import MambaConfigMixin
from megatron.core.transformer.heterogeneous.heterogeneous_fields import HeterogeneousConfigMixin
from megatron.core.transformer.kernel_choice_config import KernelChoiceConfigMixin
from megatron.core.transformer.moe.moe_config import MoEConfigMixin
from megatron.core.transformer.mla_config import MLAConfigMixin
from megatron.core.transformer.mtp_config import MTPConfigMixin
from megatron.core.transformer.yarn_config import YarnConfigMixin
from megatron.core.transformer.pipeline_parallel_layer_layout import LAYOUT_FLAG, PipelineParallelLayerLayout
from megatron.core.transformer.pipeline_split import layers_per_pipeline_rank, split_of_config

NORMALIZATIONS = ("LayerNorm", "RMSNorm")
RECOMPUTE_GRANULARITIES = (None, "full", "selective")
RECOMPUTE_METHODS = (None, "uniform", "block")
RECOMPUTE_MODULES = ("core_attn", "moe_act", "layernorm", "mla_up_proj", "mlp", "moe", "shared_experts")


@dataclass(frozen=True, kw_only=True)
class TransformerConfig(KernelChoiceConfigMixin, MTPConfigMixin, MLAConfigMixin, YarnConfigMixin, MoEConfigMixin,
                        MambaConfigMixin, HeterogeneousConfigMixin, ModelParallelConfig):
    """Transformer shape, regularisation, initialisation and activation-recompute settings (upstream's kernel-choice
    fields: see `kernel_choice_config`)."""

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    ffn_hidden_size: Optional[int] = None
    """MLP width; None means 4 * hidden_size (also for swiglu, where it is the width of each of gate and up)."""
    kv_channels: Optional[int] = None
    """Width of one attention head; None means hidden_size // num_attention_heads."""
    num_query_groups: Optional[int] = None
    """Key/value heads (grouped-query attention, `--group-query-attention --num-query-groups`): each group of
    num_attention_heads // num_query_groups query heads shares one key and one value head. None means
    num_attention_heads (multi-head attention)."""
    qk_layernorm: bool = False
    """Normalise each query and key head (over its kv_channels) before attention (`--qk-layernorm`)."""

    hidden_dropout: float = 0.1
    attention_dropout: float = 0.1

    init_method_std: float = 0.02
    init_method: Optional[Callable] = None
    """Initialiser of input-side weights; None means normal(0, init_method_std)."""
    output_layer_init_method: Optional[Callable] = None
    """Initialiser of attention-out and fc2 weights; None means normal(0, init_method_std / sqrt(2 * num_layers))."""
    embedding_init_method_std: Optional[float] = None
    """Std of the embedding weights' normal init (`--embedding-init-method-std`): the word embedding, the learned
    position embedding and, with tied weights, the output layer's copy of the word embedding; an untied output
    layer keeps init_method. None means the embeddings initialise like the other weights."""
    embedding_init_method: Optional[Callable] = None
    """Initialiser of the embedding weights; None means normal(0, embedding_init_method_std) when that is set,
    else init_method."""
    init_seed: Optional[int] = None
    """Base seed of the initial weights (`--seed`). Each module draws from a seed derived from it and the module's
    identity (see `init_seeds`), so the weights do not depend on the pipeline split or on the construction order.
    None means the seed the default CPU generator was last seeded with when the model is built."""

    normalization: str = "LayerNorm"
    layernorm_epsilon: float = 1e-5
    layernorm_zero_centered_gamma: bool = False
    """Store each normalisation weight as (gamma - 1), initialised to zero, and scale by (1 + weight)
    (`--apply-layernorm-1p`): weight decay then pulls gamma towards 1 instead of 0."""

    gated_linear_unit: bool = False
    """Gated MLP: act(gate) * up. With the default activation this is swiglu (`--swiglu`)."""
    activation_func: Optional[Callable] = None
    """MLP activation; None means silu for a gated MLP (swiglu) and gelu otherwise."""
    activation_func_clamp_value: Optional[float] = None
    """Gated MLP only: clamp the gate to at most this value and the up projection to [-value, value] before the
    activation (`--activation-func-clamp-value`, gpt-oss). None: no clamping."""
    glu_linear_offset: float = 0.0
    """Gated MLP only: act(gate) * (up + offset) (`--glu-linear-offset`, gpt-oss uses 1)."""
    add_bias_linear: bool = True
    add_qkv_bias: bool = False
    """A bias on the QKV projection even when `add_bias_linear` is False (`--add-qkv-bias`, Qwen2-style); its
    checkpoint name is `self_attention.linear_qkv.bias`."""
    rotary_interleaved: bool = False
    """RoPE rotates the channel pairs (0, 1), (2, 3), ... instead of (i, i + rot_dim / 2) (`--rotary-interleaved`)."""
    rotary_seq_len_interpolation_factor: Optional[float] = None
    """RoPE positions are divided by this factor (`--rotary-seq-len-interpolation-factor`, linear position
    interpolation); None means 1."""
    apply_residual_connection_post_layernorm: bool = False
    """The residual of attention and MLP is their normalised input instead of the un-normalised one
    (`--apply-residual-connection-post-layernorm`, the original BERT ordering)."""
    fp32_residual_connection: bool = False
    """With bf16/fp16 parameters the residual stream (the sum through the layers) is kept in fp32; the norms and
    sublayers compute in the parameters' dtype (`--fp32-residual-connection`)."""

    # FP8 (see megatron.core.fp8_utils)
    transformer_impl: str = "local"
    """"local" (torch-native layers; FP8 through torch's float8 dtypes) or "transformer_engine" (TE's layers and
    autocast; needs transformer-engine and a GPU) (`--transformer-impl`)."""
    fp8: Optional[str] = None
    """FP8 format (`--fp8-format`): None (off), "e4m3", or "hybrid" (e4m3 forward, e5m2 gradients)."""
    fp8_recipe: str = "delayed"
    """"delayed" (scale from an amax history) or "tensorwise" (current per-tensor scaling); "mxfp8" and
    "blockwise" need Transformer Engine on a GPU (`--fp8-recipe`)."""
    fp8_margin: int = 0
    """The scale is divided by 2**fp8_margin (`--fp8-margin`)."""
    fp8_amax_history_len: int = 1
    """Amaxes kept per tensor under delayed scaling (`--fp8-amax-history-len`)."""
    fp8_amax_compute_algo: str = "most_recent"
    """"most_recent" or "max" of the amax history (`--fp8-amax-compute-algo`)."""
    fp8_param: bool = False
    """Keep the compute weights of the linear layers in FP8 (set by `--fp8-param-gather`)."""
    keep_fp8_transpose_cache: bool = False
    """Keep each FP8 weight's transposed bytes (for the backward GEMM under `torch._scaled_mm`) from the pass that
    quantizes it, cached with it for the optimizer step, instead of transposing in every backward: one more byte
    per weight element (`--keep-fp8-transpose-cache`)."""
    fp8_wgrad: bool = True
    """False (`--no-fp8-wgrad`): the FP8 linear layers compute their weight gradients in the activations'
    precision (from the unquantized input and output gradient); the forward and input-gradient GEMMs stay FP8."""
    tp_only_amax_red: bool = False
    """Reduce delayed-scaling amaxes over the tensor-parallel group only, not over the data-parallel replicas
    (`--tp-only-amax-red`)."""
    fp8_dot_product_attention: bool = False
    """FP8 inside the attention kernel (`--fp8-dot-product-attention`); fp8_multi_head_attention: FP8 between the
    attention's projections and its kernel (`--fp8-multi-head-attention`). Both need Transformer Engine's fused
    attention, which this code base does not build (attention runs in its own core attention), so both are
    refused when set."""
    fp8_multi_head_attention: bool = False
    first_last_layers_bf16: bool = False
    """Run the first `num_layers_at_start_in_bf16` and last `num_layers_at_end_in_bf16` layers outside FP8, in
    the parameters' precision (`--first-last-layers-bf16`)."""
    num_layers_at_start_in_bf16: int = 1
    num_layers_at_end_in_bf16: int = 1

    num_layers_in_first_pipeline_stage: Optional[int] = None
    """Transformer layers of the first pipeline rank (`--decoder-first-pipeline-num-layers`); the ranks without
    an explicit count share the rest evenly. None: an even share. See `pipeline_split`."""
    num_layers_in_last_pipeline_stage: Optional[int] = None
    """Transformer layers of the last pipeline rank (`--decoder-last-pipeline-num-layers`)."""
    account_for_embedding_in_pipeline_split: bool = False
    """The embedding counts as one layer of the first virtual stage (`--account-for-embedding-in-pipeline-split`)."""
    account_for_loss_in_pipeline_split: bool = False
    """The loss counts as one layer of the last virtual stage (`--account-for-loss-in-pipeline-split`)."""
    pipeline_model_parallel_layout: Optional[object] = None
    """Explicit placement (`--pipeline-model-parallel-layout`): a layout string, a list of stages or a
    `PipelineParallelLayerLayout` (stored as the latter). It also sets virtual_pipeline_model_parallel_size when
    that is None; when given, the two must agree."""

    recompute_granularity: Optional[str] = None
    """None, "full" (recompute whole layers, see recompute_method) or "selective" (the recompute_modules)."""
    recompute_modules: Optional[tuple] = ("core_attn",)
    """What selective recompute recomputes in backward (`--recompute-modules`, upstream's names, None means
    ("core_attn",)): core_attn (attention scores and softmax), mlp (dense MLP layers), moe (whole MoE layers),
    shared_experts (the MoE shared experts), and, dropping their outputs too, layernorm (both norms of a layer),
    moe_act (the routed experts' activation), mla_up_proj (multi-latent attention's up projections and RoPE)."""
    distribute_saved_activations: bool = False
    """Full recompute keeps only each tensor-parallel rank's 1/TP slice of a recomputed chunk's input
    (`--distribute-saved-activations`); the recompute all-gathers it."""
    recompute_method: Optional[str] = None
    """With "full": "uniform" checkpoints chunks of recompute_num_layers layers; "block" checkpoints the first
    recompute_num_layers layers of each pipeline stage."""
    recompute_num_layers: Optional[int] = None

    cpu_offloading: bool = False
    """Move the activations the first `cpu_offloading_num_layers` layers of each block save for backward to host
    memory during forward, and back for their backward (`--cpu-offloading`, see megatron/core/offloading/)."""
    cpu_offloading_num_layers: int = 0
    """How many transformer layers offload their activations (`--cpu-offloading-num-layers`, < num_layers)."""
    fine_grained_activation_offloading: bool = False
    """Move what the `offload_modules` pieces of every layer save for backward to host memory during forward, and
    back for their backward (`--fine-grained-activation-offloading`, see megatron/core/offloading/fine_grained.py)."""
    offload_modules: tuple = ()
    """The pieces of each layer that fine-grained offloading covers (`--offload-modules`): names of
    `OFFLOADABLE_MODULES` (attn_norm, qkv_linear, core_attn, attn_proj, mlp_norm, expert_fc1, moe_act)."""
    min_offloaded_tensor_size: int = 1024 * 1024
    """Saved tensors of fewer elements stay on the device under fine-grained offloading
    (`--min-offloaded-tensor-size`)."""

    cross_entropy_loss_fusion: bool = False
    """The last stage computes the loss with the fused vocab-parallel cross entropy (`--cross-entropy-loss-fusion`,
    megatron/core/tensor_parallel/fused_cross_entropy.py): same values, logits never copied to fp32 whole."""

    apply_query_key_layer_scaling: bool = False
    """With fp16 attention inputs, scores are computed divided by the layer number and multiplied back in fp32
    before the softmax (`--apply-query-key-layer-scaling`); a no-op for fp32 and bf16 inputs."""

    qk_clip: bool = False
    """QK-Clip (`--qk-clip`, megatron/core/optimizer/qk_clip.py): after each optimizer step, the query and key rows
    of every head whose largest attention logit exceeded `qk_clip_threshold` are scaled down."""
    qk_clip_alpha: float = 0.5
    """The share of QK-Clip's rescale put on the queries (`--qk-clip-alpha`): gamma^alpha, keys gamma^(1-alpha)."""
    qk_clip_threshold: float = 100.0
    """QK-Clip's bound on the pre-softmax attention logit (`--qk-clip-threshold`)."""
    log_max_attention_logit: bool = False
    """Track the largest attention logit of each head during training (`--log-max-attention-logit`)."""

    window_size: Optional[tuple] = None
    """Sliding-window attention `(left, right)` (`--window-size`): query i sees keys i - left .. i + right under
    the causal mask; -1 means no limit on that side. None: full causal attention."""
    window_attn_skip_freq: Optional[object] = None
    """Which layers skip the window (`--window-attn-skip-freq`): an int N makes every N-th layer (1-based) full
    attention; a 0/1 list (kept as a tuple) gives one entry per layer, 1 for the window. None: every layer."""
    softmax_type: str = "vanilla"
    """Attention sinks (`--softmax-type`): "vanilla", "off-by-one" (1 added to the softmax denominator) or
    "learnable" (exp of a learned per-head logit, the parameter `softmax_offset`, added)."""

    no_rope_freq: Optional[object] = None
    """NoPE layers (`--no-rope-freq`, Llama 4): an int N makes every N-th layer (1-based) skip the rotary embedding;
    a 0/1 list (kept as a tuple) gives one entry per layer, 1 for no rotary embedding. None: every layer rotates."""
    qk_l2_norm: bool = False
    """Divide each query and key head by its root mean square over kv_channels (eps `layernorm_epsilon`, no weight)
    after the rotary embedding (`--qk-l2-norm`, Llama 4)."""
    attention_output_gate: bool = False
    """The QKV projection also produces a gate per query channel and the attention output is multiplied by its
    sigmoid before the output projection (`--attention-output-gate`, Qwen3-Next)."""

    calculate_per_token_loss: bool = False
    """Loss is summed over tokens and divided once by the global token count (`--calculate-per-token-loss`),
    instead of averaging per microbatch; the pipeline schedules and gradient finalisation read it."""

    cp_comm_type: object = "p2p"
    """How attention communicates under context parallelism (`--cp-comm-type`): "p2p" (K/V ring), "allgather"
    (gather the whole K/V), "a2a" (Ulysses all-to-all over heads) or "a2a+p2p" (all-to-all inside the inner
    hierarchical groups, p2p ring across the outer ones). One str for every layer, or a list with one per layer
    (global layer order); stored as a str or a tuple."""
    hierarchical_context_parallel_sizes: Optional[tuple] = None
    """(inner all-to-all size, outer p2p size) of a2a+p2p (`--hierarchical-context-parallel-sizes`); the product
    is context_parallel_size."""

    def __post_init__(self):
        if self.fp32_residual_connection and self.pipeline_dtype is None:
            # The residual stream is what pipeline stages exchange.
            self._set("pipeline_dtype", torch.float32)
        parent_post_init = getattr(super(), "__post_init__", None)
        if parent_post_init is not None:
            parent_post_init()
        self._validate_shape()
        self._fill_derived_defaults()
        self._validate_multi_token_prediction()  # before the split: a layout's 'm' count is checked there
        self._validate_parallel_split()
        self._validate_hybrid_model()  # before MoE: a hybrid pattern's 'E' layers are its MoE layers
        self._validate_moe()
        self._validate_regularisation_and_norm()
        self._validate_recompute()
        self._validate_cpu_offloading()
        self._validate_fine_grained_offloading()
        self._validate_fp8()
        self._validate_context_parallel()
        self._validate_multi_latent_attention()
        self._validate_yarn()
        self._validate_qk_clip()
        self._validate_layer_variants()
        self._validate_attention_variants()
        self._validate_attention_head_transforms()
        self._validate_kernel_choices()
        self._validate_heterogeneous_layers()  # last: builds each layer shape's config from this validated one

    def _validate_attention_head_transforms(self):
        from megatron.core.transformer.attention_head_transforms import validated_head_transforms

        self._set("no_rope_freq", validated_head_transforms(self))

    def _validate_attention_variants(self):
        from megatron.core.transformer.attention_variants import validated_attention_variants

        window_size, skip_freq = validated_attention_variants(self)
        self._set("window_size", window_size)
        self._set("window_attn_skip_freq", skip_freq)

    def _validate_qk_clip(self):
        if not 0.0 <= self.qk_clip_alpha <= 1.0:
            raise ValueError(f"--qk-clip-alpha must be in [0, 1], got {self.qk_clip_alpha}")
        if not self.qk_clip_threshold > 0:
            raise ValueError(f"--qk-clip-threshold must be > 0, got {self.qk_clip_threshold}")
        # With --multi-latent-attention, --qk-layernorm normalises the latents, before the up projections QK-Clip
        # rescales: the clip holds.
        if self.qk_clip and self.qk_layernorm and not self.multi_latent_attention:
            raise ValueError("--qk-clip rescales the query and key weights, which --qk-layernorm's per-head norms "
                             "undo: use one of them")
        if self.qk_clip and self.qk_l2_norm:
            raise ValueError("--qk-clip rescales the query and key weights, which --qk-l2-norm's per-head norms "
                             "undo: use one of them")
        if self.qk_clip and self.attention_output_gate and not self.multi_latent_attention:
            raise ValueError("--qk-clip rescales the query and key rows of the fused QKV weight as laid out without "
                             "--attention-output-gate's gate rows: use one of them")

    def _set(self, name, value):
        object.__setattr__(self, name, value)

    def recomputes(self, module):
        """Whether selective recompute covers `module` (one of `RECOMPUTE_MODULES`)."""
        return self.recompute_granularity == "selective" and module in self.recompute_modules

    def _validate_shape(self):
        for flag, value in (
            ("--num-layers", self.num_layers),
            ("--hidden-size", self.hidden_size),
            ("--num-attention-heads", self.num_attention_heads),
        ):
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{flag} must be a positive integer, got {value!r}")
        if self.kv_channels is None and self.hidden_size % self.num_attention_heads != 0:
            raise ValueError(
                f"--hidden-size ({self.hidden_size}) must be divisible by --num-attention-heads "
                f"({self.num_attention_heads}); change one of them or set kv_channels explicitly"
            )
        if self.ffn_hidden_size is not None and self.ffn_hidden_size <= 0:
            raise ValueError(f"--ffn-hidden-size must be positive, got {self.ffn_hidden_size}")
        if self.kv_channels is not None and self.kv_channels <= 0:
            raise ValueError(f"--kv-channels (kv_channels) must be positive, got {self.kv_channels}")
        if self.init_method_std <= 0:
            raise ValueError(f"--init-method-std must be positive, got {self.init_method_std}")
        if self.embedding_init_method_std is not None and self.embedding_init_method_std <= 0:
            raise ValueError(f"--embedding-init-method-std must be positive, got {self.embedding_init_method_std}")
        if self.init_seed is not None and (not isinstance(self.init_seed, int) or self.init_seed < 0):
            raise ValueError(f"init_seed (--seed) must be a non-negative integer or None, got {self.init_seed!r}")

    def _fill_derived_defaults(self):
        if self.ffn_hidden_size is None:
            self._set("ffn_hidden_size", 4 * self.hidden_size)
        if self.kv_channels is None:
            self._set("kv_channels", self.hidden_size // self.num_attention_heads)
        if self.num_query_groups is None:
            self._set("num_query_groups", self.num_attention_heads)
        if self.init_method is None:
            self._set("init_method", init_method_normal(self.init_method_std))
        if self.output_layer_init_method is None:
            self._set("output_layer_init_method", scaled_init_method_normal(self.init_method_std, self.num_layers))
        if self.embedding_init_method is None:
            self._set("embedding_init_method", self.init_method if self.embedding_init_method_std is None
                      else init_method_normal(self.embedding_init_method_std))
        if self.activation_func is None:
            self._set("activation_func", F.silu if self.gated_linear_unit else F.gelu)

    def _validate_parallel_split(self):
        tp = self.tensor_model_parallel_size
        if self.hidden_size % tp != 0:
            raise ValueError(
                f"--hidden-size ({self.hidden_size}) must be divisible by --tensor-model-parallel-size ({tp})"
            )
        if self.num_attention_heads % tp != 0:
            raise ValueError(
                f"--num-attention-heads ({self.num_attention_heads}) must be divisible by "
                f"--tensor-model-parallel-size ({tp}): each tensor-parallel rank holds whole heads"
            )
        if self.ffn_hidden_size % tp != 0:
            raise ValueError(
                f"--ffn-hidden-size ({self.ffn_hidden_size}) must be divisible by --tensor-model-parallel-size ({tp})"
            )
        groups = self.num_query_groups
        if not isinstance(groups, int) or groups <= 0 or self.num_attention_heads % groups != 0:
            raise ValueError(
                f"--num-query-groups ({groups!r}) must be a positive divisor of --num-attention-heads "
                f"({self.num_attention_heads})"
            )
        if groups % tp != 0:
            raise ValueError(
                f"--num-query-groups ({groups}) must be divisible by --tensor-model-parallel-size ({tp}): each "
                "tensor-parallel rank holds whole query groups"
            )
        self._resolve_pipeline_layout()
        split_of_config(self)  # raises with the flags to change when the layers cannot be split this way

    def _resolve_pipeline_layout(self):
        layout = self.pipeline_model_parallel_layout
        if layout is None:
            return
        if not isinstance(layout, PipelineParallelLayerLayout):
            layout = PipelineParallelLayerLayout(layout, self.pipeline_model_parallel_size)
            self._set("pipeline_model_parallel_layout", layout)
        chunks = layout.virtual_pipeline_model_parallel_size
        if self.virtual_pipeline_model_parallel_size is None and chunks > 1:
            self._set("virtual_pipeline_model_parallel_size", chunks)
            self._validate_virtual_pipeline()
        elif (self.virtual_pipeline_model_parallel_size or 1) != chunks:
            raise ValueError(
                f"{LAYOUT_FLAG} {layout.text!r} gives {chunks} virtual stages per pipeline rank but "
                f"virtual_pipeline_model_parallel_size is {self.virtual_pipeline_model_parallel_size}; drop one "
                "or make them agree"
            )

    def _validate_regularisation_and_norm(self):
        for flag, value in (("--hidden-dropout", self.hidden_dropout), ("--attention-dropout", self.attention_dropout)):
            if not 0.0 <= value < 1.0:
                raise ValueError(f"{flag} must be in [0, 1), got {value}")
        if self.normalization not in NORMALIZATIONS:
            raise ValueError(f"--normalization must be one of {NORMALIZATIONS}, got {self.normalization!r}")
        if self.layernorm_epsilon <= 0:
            raise ValueError(f"layernorm_epsilon must be positive, got {self.layernorm_epsilon}")

    def _validate_layer_variants(self):
        if not self.gated_linear_unit:
            for flag, given in (("--activation-func-clamp-value", self.activation_func_clamp_value is not None),
                                ("--glu-linear-offset", self.glu_linear_offset != 0.0)):
                if given:
                    raise ValueError(f"{flag} shapes the gated MLP (act(gate) * up): it needs --swiglu or "
                                     f"--quick-geglu; add one or drop {flag}")
        clamp_value = self.activation_func_clamp_value
        if clamp_value is not None and not clamp_value > 0:
            raise ValueError(f"--activation-func-clamp-value must be positive, got {clamp_value}")
        if self.fp32_residual_connection:
            if not (self.fp16 or self.bf16):
                raise ValueError("--fp32-residual-connection keeps the residual in fp32 under --bf16 or --fp16; "
                                 "with fp32 parameters it is already fp32: drop the flag")
            if self.pipeline_dtype != torch.float32:
                raise ValueError(f"--fp32-residual-connection sends the fp32 residual between pipeline stages; "
                                 f"pipeline_dtype must be torch.float32 (or None), got {self.pipeline_dtype}")
        factor = self.rotary_seq_len_interpolation_factor
        if factor is not None and (isinstance(factor, bool) or not isinstance(factor, (int, float)) or factor <= 0):
            raise ValueError(f"--rotary-seq-len-interpolation-factor must be a positive number, got {factor!r}")
        if self.multi_latent_attention:
            for flag, value in (("--rotary-interleaved", self.rotary_interleaved),
                                ("--rotary-seq-len-interpolation-factor", factor is not None)):
                if value:
                    raise ValueError(f"{flag} applies to the rotary embedding of standard attention; "
                                     "--multi-latent-attention has its own (--rope-type, --rotary-scaling-factor): "
                                     f"drop {flag}")
            if self.add_qkv_bias:
                raise ValueError("--add-qkv-bias adds a bias to standard attention's QKV projection, which "
                                 "--multi-latent-attention does not have: drop --add-qkv-bias (without "
                                 "--disable-bias-linear every linear has a bias)")

    def _validate_cpu_offloading(self):
        if not self.cpu_offloading:
            if self.cpu_offloading_num_layers:
                raise ValueError("--cpu-offloading-num-layers needs --cpu-offloading; pass it or drop the count")
            return
        # Upstream's rules: at least one layer, never all (the last layer's backward follows at once), no
        # pipeline parallelism, no recomputation.
        if not 0 < self.cpu_offloading_num_layers < self.num_layers:
            raise ValueError(f"--cpu-offloading needs 0 < --cpu-offloading-num-layers < --num-layers "
                             f"({self.num_layers}), got {self.cpu_offloading_num_layers}")
        if self.pipeline_model_parallel_size > 1:
            raise ValueError("--cpu-offloading does not support --pipeline-model-parallel-size > 1")
        if self.recompute_granularity is not None:
            raise ValueError("--cpu-offloading does not work with --recompute-granularity; drop one of them")

    def _validate_fine_grained_offloading(self):
        modules = tuple(dict.fromkeys(self.offload_modules or ()))  # a tuple (frozen), each name once
        self._set("offload_modules", modules)
        if not self.fine_grained_activation_offloading:
            if modules:
                raise ValueError("--offload-modules needs --fine-grained-activation-offloading; pass it or drop "
                                 "--offload-modules")
            return
        if not modules:
            raise ValueError(f"--fine-grained-activation-offloading needs --offload-modules (one or more of "
                             f"{' '.join(OFFLOADABLE_MODULES)})")
        unknown = [name for name in modules if name not in OFFLOADABLE_MODULES]
        if unknown:
            raise ValueError(f"--offload-modules: unknown {' '.join(map(str, unknown))}; choose from "
                             f"{' '.join(OFFLOADABLE_MODULES)}")
        if self.min_offloaded_tensor_size < 0:
            raise ValueError(f"--min-offloaded-tensor-size must be >= 0, got {self.min_offloaded_tensor_size}")
        # The rules of --cpu-offloading: one of the two, no pipeline parallelism (the prefetch follows one
        # forward and its backward), no recomputation (checkpointing saves only a region's inputs).
        if self.cpu_offloading:
            raise ValueError("--fine-grained-activation-offloading and --cpu-offloading both offload activations; "
                             "use one of them")
        if self.pipeline_model_parallel_size > 1:
            raise ValueError("--fine-grained-activation-offloading does not support --pipeline-model-parallel-size > 1")
        if self.recompute_granularity is not None:
            raise ValueError("--fine-grained-activation-offloading does not work with --recompute-granularity; drop "
                             "one of them")
        experts = " ".join(name for name in modules if name in EXPERT_MODULES)
        if experts and self.num_moe_experts is None:
            raise ValueError(f"--offload-modules {experts} offloads the routed experts' activations: it needs "
                             f"--num-experts (or drop {experts})")
        if experts and self.moe_layer_recompute:
            raise ValueError(f"--offload-modules {experts} does not work with --moe-layer-recompute (the MoE layer "
                             f"then saves only its input); drop one of them")

    def _validate_recompute(self):
        if self.distribute_saved_activations and (self.recompute_granularity != "full" or self.sequence_parallel):
            raise ValueError("--distribute-saved-activations needs --recompute-granularity full and no "
                             "--sequence-parallel")
        if self.recompute_granularity not in RECOMPUTE_GRANULARITIES:
            raise ValueError(
                f"--recompute-granularity must be one of full, selective (or unset), got {self.recompute_granularity!r}"
            )
        if self.recompute_method not in RECOMPUTE_METHODS:
            raise ValueError("--recompute-method must be one of uniform, block (or unset), got "
                             f"{self.recompute_method!r}")
        if self.recompute_method is not None and self.recompute_granularity != "full":
            raise ValueError(
                f"--recompute-method {self.recompute_method} needs --recompute-granularity full "
                f"(got {self.recompute_granularity!r})"
            )
        if self.recompute_granularity == "full":
            if self.recompute_method is None:
                raise ValueError("--recompute-granularity full needs --recompute-method uniform or block")
            if self.recompute_num_layers is None or self.recompute_num_layers < 1:
                raise ValueError(
                    f"--recompute-granularity full needs --recompute-num-layers >= 1, got {self.recompute_num_layers}"
                )
            # Under an uneven split (--decoder-first/last-pipeline-num-layers, layouts) the largest stage bounds it.
            most_layers = max(layers_per_pipeline_rank(split_of_config(self), self.pipeline_model_parallel_size))
            if self.recompute_method == "block" and self.recompute_num_layers > most_layers:
                raise ValueError(
                    f"--recompute-num-layers ({self.recompute_num_layers}) with --recompute-method block cannot "
                    f"exceed the layers of one pipeline stage ({most_layers}, the most any stage holds)"
                )
        elif self.recompute_num_layers is not None:
            raise ValueError(
                "--recompute-num-layers only applies to --recompute-granularity full "
                f"(got granularity {self.recompute_granularity!r}); drop it"
            )
        if self.moe_layer_recompute and self.recompute_granularity == "full":
            raise ValueError("--moe-layer-recompute does not work with --recompute-granularity full (full recompute "
                             "already recomputes the whole layer, its MoE part included): drop one of them")
        self._validate_recompute_modules()

    def _validate_recompute_modules(self):
        modules = ("core_attn",) if self.recompute_modules is None else self.recompute_modules
        if isinstance(modules, str):
            modules = (modules,)
        modules = tuple(dict.fromkeys(modules))  # a tuple (frozen), each name once
        self._set("recompute_modules", modules)
        unknown = [name for name in modules if name not in RECOMPUTE_MODULES]
        if unknown:
            raise ValueError(f"--recompute-modules: unknown {' '.join(map(str, unknown))}; choose from "
                             f"{' '.join(RECOMPUTE_MODULES)}")
        beyond_default = " ".join(name for name in modules if name != "core_attn")
        if beyond_default and self.recompute_granularity != "selective":
            raise ValueError(f"--recompute-modules {beyond_default} only applies to --recompute-granularity selective "
                             f"(got {self.recompute_granularity!r}); pass --recompute-granularity selective or drop "
                             f"--recompute-modules")
        if self.recompute_granularity != "selective":
            return
        for name in ("moe", "moe_act", "shared_experts"):
            if name in modules and self.num_moe_experts is None:
                raise ValueError(f"--recompute-modules {name} recomputes part of the MoE layers: it needs "
                                 f"--num-experts (or drop {name})")
        if "shared_experts" in modules:
            if self.moe_shared_expert_intermediate_size is None:
                raise ValueError("--recompute-modules shared_experts needs shared experts "
                                 "(--moe-shared-expert-intermediate-size), or drop shared_experts")
            if self.moe_shared_expert_overlap:
                raise ValueError("--recompute-modules shared_experts does not work with --moe-shared-expert-overlap "
                                 "(the shared experts then run inside the token dispatch); drop one of them")
        if "mla_up_proj" in modules and not self.multi_latent_attention:
            raise ValueError("--recompute-modules mla_up_proj needs --multi-latent-attention (or drop mla_up_proj)")
        whole_moe = "--recompute-modules moe" if "moe" in modules else (
            "--moe-layer-recompute" if self.moe_layer_recompute else None)
        covered = " ".join(name for name in ("moe_act", "shared_experts") if name in modules)
        if whole_moe and covered:
            raise ValueError(f"{whole_moe} recomputes the whole MoE layer, which includes --recompute-modules "
                             f"{covered}: drop {covered}")

    def _validate_fp8(self):
        from megatron.core.fp8.formats import AMAX_COMPUTE_ALGOS, FP8_FORMATS, FP8_RECIPES, GPU_ONLY_RECIPES

        if self.transformer_impl not in ("local", "transformer_engine"):
            raise ValueError(f"--transformer-impl must be local or transformer_engine, got {self.transformer_impl!r}")
        for name in ("fp8_dot_product_attention", "fp8_multi_head_attention"):
            if getattr(self, name):
                raise ValueError(f"--{name.replace('_', '-')} is not supported: it needs Transformer Engine's fused "
                                 "attention, and attention here runs in megatron.core's own core attention (the "
                                 "linear layers around it still run in FP8 with --fp8-format); drop the flag")
        if self.fp8 is None:
            for name, flag in (("fp8_param", "--fp8-param-gather"),
                               ("first_last_layers_bf16", "--first-last-layers-bf16")):
                if getattr(self, name):
                    raise ValueError(f"{flag} needs FP8 training: add --fp8-format e4m3 or hybrid")
            return
        if self.fp8 not in FP8_FORMATS:
            raise ValueError(f"--fp8-format must be one of {FP8_FORMATS}, got {self.fp8!r}")
        if self.fp8_recipe not in FP8_RECIPES:
            raise ValueError(f"--fp8-recipe must be one of {FP8_RECIPES}, got {self.fp8_recipe!r}")
        if self.fp8_recipe in GPU_ONLY_RECIPES and self.transformer_impl != "transformer_engine":
            raise ValueError(
                f"--fp8-recipe {self.fp8_recipe} needs Transformer Engine on a GPU (--transformer-impl "
                "transformer_engine); the torch-native FP8 backend runs delayed and tensorwise"
            )
        if self.fp8_amax_history_len < 1:
            raise ValueError(f"--fp8-amax-history-len must be >= 1, got {self.fp8_amax_history_len}")
        if self.fp8_amax_compute_algo not in AMAX_COMPUTE_ALGOS:
            raise ValueError(
                f"--fp8-amax-compute-algo must be one of {AMAX_COMPUTE_ALGOS}, got {self.fp8_amax_compute_algo!r}"
            )
        if self.fp8_margin < 0:
            raise ValueError(f"--fp8-margin must be >= 0, got {self.fp8_margin}")
        if self.first_last_layers_bf16:
            for flag, value in (
                ("--num-layers-at-start-in-bf16", self.num_layers_at_start_in_bf16),
                ("--num-layers-at-end-in-bf16", self.num_layers_at_end_in_bf16),
            ):
                if not 0 <= value <= self.num_layers:
                    raise ValueError(f"{flag} must be in [0, --num-layers={self.num_layers}], got {value}")
        if (
            self.fp8_recipe == "delayed"
            and self.recompute_granularity == "full"
            and self.transformer_impl == "local"
        ):
            raise ValueError(
                "--fp8-recipe delayed with --recompute-granularity full: a recomputed layer would be quantized with "
                "an amax history that has moved on since its forward pass; use --fp8-recipe tensorwise (current "
                "scaling recomputes identically) or selective recompute"
            )
        if (self.fp8_recipe == "delayed" and self.recompute_granularity == "selective"
                and self.transformer_impl == "local"):
            # The rule of full recompute, for the modules whose recompute runs linears again (the norms and the
            # experts' activation are not quantized here, so their recompute is exact under any recipe).
            requantized = " ".join(name for name in self.recompute_modules
                                   if name in ("mla_up_proj", "mlp", "moe", "shared_experts"))
            if requantized:
                raise ValueError(f"--fp8-recipe delayed does not support --recompute-modules {requantized}: the "
                                 f"recomputed linears would be quantized with an amax history that has moved on since "
                                 f"the forward pass; use --fp8-recipe tensorwise or drop {requantized}")
        if self.fp8_recipe == "delayed" and self.transformer_impl == "local" and self.moe_layer_recompute:
            raise ValueError("--fp8-recipe delayed does not support --moe-layer-recompute: the recomputed expert "
                             "linears would be quantized with an amax history that has moved on since the forward "
                             "pass; use --fp8-recipe tensorwise or drop --moe-layer-recompute")

    def _validate_context_parallel(self):
        from megatron.core.transformer.context_parallel.a2a_attention import check_heads_divisible
        from megatron.core.transformer.context_parallel.comm_types import (
            comm_types_in_use,
            heads_split_size,
            normalize_cp_comm_types,
            validate_hierarchical_sizes,
        )

        self._set("cp_comm_type", normalize_cp_comm_types(self.cp_comm_type, self.num_layers))
        cp, tp = self.context_parallel_size, self.tensor_model_parallel_size
        sizes = validate_hierarchical_sizes(self.hierarchical_context_parallel_sizes, cp, self.cp_comm_type)
        self._set("hierarchical_context_parallel_sizes", sizes)
        for comm_type in sorted(comm_types_in_use(self.cp_comm_type)) if cp > 1 else ():
            split = heads_split_size(comm_type, cp, sizes)
            if split > 1:
                flag = "--context-parallel-size" if comm_type == "a2a" else "--hierarchical-context-parallel-sizes"
                check_heads_divisible(self.num_attention_heads // tp, self.num_query_groups // tp, split, flag)


allow_runtime_hook_assignment(TransformerConfig)  # `config.no_sync_func = ...`, as on ModelParallelConfig


@dataclass(frozen=True, kw_only=True)
class MLATransformerConfig(TransformerConfig):
    """A `TransformerConfig` for multi-latent attention with upstream Megatron-Core's defaults (DeepSeek-V2/V3
    shapes, RMSNorm, YaRN with a scaling factor of 40), for code that builds its config as upstream does. The
    fields are `TransformerConfig`'s own (see `mla_config.MLAConfigMixin`); only their defaults differ, and
    `multi_latent_attention` must stay True."""

    multi_latent_attention: bool = True
    q_lora_rank: Optional[int] = 512
    kv_lora_rank: int = 512
    qk_head_dim: int = 128
    qk_pos_emb_head_dim: int = 64
    v_head_dim: int = 128
    normalization: str = "RMSNorm"
    rope_type: str = "yarn"
    rotary_base: float = 10000.0
    rotary_percent: float = 1.0
    """Upstream's fraction of the rope channels that RoPE rotates; multi-latent attention rotates all of them."""
    rotary_scaling_factor: float = 40.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0
    cache_mla_latents: bool = False
    """Upstream's latent KV cache for its dynamic inference engine with Flash MLA; not available here."""

    def __post_init__(self):
        if not self.multi_latent_attention:
            raise ValueError("MLATransformerConfig is the multi-latent attention config: keep "
                             "multi_latent_attention=True, or build a TransformerConfig for standard attention")
        if self.rotary_percent != 1.0:
            raise ValueError(f"MLATransformerConfig: rotary_percent {self.rotary_percent}: multi-latent attention "
                             "rotates all qk_pos_emb_head_dim channels; set qk_pos_emb_head_dim to the channels to "
                             "rotate and keep rotary_percent=1.0")
        if self.cache_mla_latents:
            raise ValueError("MLATransformerConfig: cache_mla_latents (upstream's latent KV cache for Flash MLA) is "
                             "not available; keep cache_mla_latents=False (inference caches keys and values)")
        super().__post_init__()
