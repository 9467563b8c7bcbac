"""The Mixture-of-Experts fields of `TransformerConfig` and their rules.

`MoEConfigMixin` is a frozen dataclass that `TransformerConfig` inherits; `TransformerConfig.__post_init__`
calls `_validate_moe()` once its own derived defaults are filled. Field names, defaults and rules are
Megatron-Core's; every message names the command-line flag to change. With `num_moe_experts` None every MoE
field must keep its default (a MoE flag without `--num-experts` would otherwise be silently ignored).
"""

import ast
from dataclasses import dataclass
from typing import Optional, Tuple, Union

SCORE_FUNCTIONS = ("softmax", "sigmoid", "sqrtsoftplus")
LOAD_BALANCING_TYPES = ("aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "none")
AUX_LOSS_TYPES = ("aux_loss", "seq_aux_loss", "global_aux_loss")  # the types that are a loss with a coefficient
TOKEN_DROP_POLICIES = ("probs", "position")
# "flex" parses (upstream launch scripts use it) and is then refused: it needs DeepEP / HybridEP on CUDA GPUs.
TOKEN_DISPATCHER_TYPES = ("allgather", "alltoall", "flex")
ROUTER_DTYPES = (None, "fp32", "fp64")

# Upstream's newer name of --moe-router-padding-for-fp8 (messages name both: either may have been given).
FP8_PADDING_NEWER_NAME = "--moe-router-padding-for-quantization"
# Flags that only mean something with --num-experts, and their defaults.
_FIELDS_NEEDING_EXPERTS = {
    "moe_router_topk": ("--moe-router-topk", 2),
    "moe_ffn_hidden_size": ("--moe-ffn-hidden-size", None),
    "moe_layer_freq": ("--moe-layer-freq", 1),
    "moe_grouped_gemm": ("--moe-grouped-gemm", False),
    "moe_token_dispatcher_type": ("--moe-token-dispatcher-type", "allgather"),
    "moe_router_score_function": ("--moe-router-score-function", "softmax"),
    "moe_router_pre_softmax": ("--moe-router-pre-softmax", False),
    "moe_router_topk_scaling_factor": ("--moe-router-topk-scaling-factor", None),
    "moe_router_num_groups": ("--moe-router-num-groups", None),
    "moe_router_group_topk": ("--moe-router-group-topk", None),
    "moe_router_enable_expert_bias": ("--moe-router-enable-expert-bias", False),
    "moe_router_bias": ("--moe-router-bias", False),
    "moe_router_dtype": ("--moe-router-dtype", None),
    "moe_z_loss_coeff": ("--moe-z-loss-coeff", None),
    "moe_expert_capacity_factor": ("--moe-expert-capacity-factor", None),
    "moe_pad_expert_input_to_capacity": ("--moe-pad-expert-input-to-capacity", False),
    "moe_shared_expert_intermediate_size": ("--moe-shared-expert-intermediate-size", None),
    "moe_shared_expert_overlap": ("--moe-shared-expert-overlap", False),
    "moe_shared_expert_gate": ("--moe-shared-expert-gate", False),
    "moe_input_jitter_eps": ("--moe-input-jitter-eps", None),
    "moe_router_force_load_balancing": ("--moe-router-force-load-balancing", False),
    "moe_router_padding_for_fp8": (f"--moe-router-padding-for-fp8 ({FP8_PADDING_NEWER_NAME})", False),
    "moe_apply_probs_on_input": ("--moe-apply-probs-on-input", False),
    "moe_layer_recompute": ("--moe-layer-recompute", False),
    "moe_latent_size": ("--moe-latent-size", None),
    "moe_per_layer_logging": ("--moe-per-layer-logging", False),
}
# Tokens per expert are padded to a multiple of this with --moe-router-padding-for-fp8 (FP8 GEMM alignment) under
# the per-tensor recipes; `fp8_routing_pad_multiple` gives the multiple of the configured recipe (32 for mxfp8).
FP8_ROUTING_PAD_MULTIPLE = 16


def fp8_routing_pad_multiple(config) -> int:
    """The multiple `--moe-router-padding-for-fp8` pads each expert's token count to: the FP8 GEMM alignment of
    `config.fp8_recipe` (`get_fp8_align_size`, as upstream: 32 for mxfp8's 32-element scale blocks, 16 else)."""
    from megatron.core.fp8.formats import get_fp8_align_size

    return get_fp8_align_size(getattr(config, "fp8_recipe", None) or "delayed")


def normalize_load_balancing(load_balancing_type, aux_loss_coeff):
    """`--moe-router-load-balancing-type` and `--moe-aux-loss-coeff` as the config keeps them: one type with one
    coefficient as themselves (a str and a float, also when given as one-element lists), several types as a
    tuple paired element by element with a tuple of as many coefficients. Raises ValueError naming the flags."""
    if isinstance(load_balancing_type, str):
        types = [load_balancing_type]
    else:
        types = list(load_balancing_type) if isinstance(load_balancing_type, (list, tuple)) else []
    coeffs = list(aux_loss_coeff) if isinstance(aux_loss_coeff, (list, tuple)) else [aux_loss_coeff]
    if not types or any(kind not in LOAD_BALANCING_TYPES for kind in types):
        raise ValueError(f"--moe-router-load-balancing-type takes one or more of {LOAD_BALANCING_TYPES}, "
                         f"got {load_balancing_type!r}")
    if len(types) > 1:
        alone = [kind for kind in types if kind in ("sinkhorn", "none")]
        if alone:
            raise ValueError(f"--moe-router-load-balancing-type {alone[0]} cannot be combined with other types "
                             f"(got {' '.join(types)}): list only aux_loss, seq_aux_loss and global_aux_loss")
        if len(set(types)) != len(types):
            raise ValueError(f"--moe-router-load-balancing-type lists a type twice: {' '.join(types)}")
    if len(coeffs) != len(types):
        raise ValueError(f"--moe-aux-loss-coeff needs one coefficient per --moe-router-load-balancing-type, in the "
                         f"same order: got {len(coeffs)} ({' '.join(map(str, coeffs))}) for {len(types)} "
                         f"({' '.join(types)})")
    for coeff in coeffs:
        if isinstance(coeff, bool) or not isinstance(coeff, (int, float)) or coeff < 0:
            raise ValueError(f"--moe-aux-loss-coeff must be >= 0, got {aux_loss_coeff!r}")
    if len(types) == 1:
        return types[0], float(coeffs[0])
    return tuple(types), tuple(float(coeff) for coeff in coeffs)


def aux_loss_terms(load_balancing_type, aux_loss_coeff):
    """[(type, coefficient)] of the auxiliary load-balancing losses these settings add (coefficient > 0; sinkhorn
    and none add none), in the order listed."""
    types, coeffs = normalize_load_balancing(load_balancing_type, aux_loss_coeff)
    if isinstance(types, str):
        types, coeffs = (types,), (coeffs,)
    return [(kind, coeff) for kind, coeff in zip(types, coeffs) if kind in AUX_LOSS_TYPES and coeff > 0]


def parse_moe_layer_freq(value):
    """`--moe-layer-freq` as given on the command line: an int N, or a Python list expression such as
    `([0]*3+[1]*5)` (evaluated with list arithmetic only). Returns an int or a list of ints."""
    if isinstance(value, (int, list, tuple)) and not isinstance(value, bool):
        return list(value) if isinstance(value, tuple) else value
    text = str(value).strip()
    if "[" not in text:
        try:
            return int(text)
        except ValueError:
            raise ValueError(f"--moe-layer-freq must be an integer or a list expression such as ([0]*3+[1]*5), "
                             f"got {value!r}") from None
    try:
        parsed = _evaluate_list_expression(ast.parse(text, mode="eval").body)
    except (SyntaxError, ValueError, TypeError) as error:
        raise ValueError(f"--moe-layer-freq {value!r} is not a list expression of 0s and 1s such as "
                         f"([0]*3+[1]*5): {error}") from None
    if not isinstance(parsed, list):
        raise ValueError(f"--moe-layer-freq {value!r} must evaluate to a list, got {type(parsed).__name__}")
    return parsed


def _evaluate_list_expression(node):
    """Literals, lists, `+` and `*` only: enough for layer patterns, nothing executable."""
    if isinstance(node, ast.Constant) and isinstance(node.value, int) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.List):
        return [_evaluate_list_expression(element) for element in node.elts]
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
        left, right = _evaluate_list_expression(node.left), _evaluate_list_expression(node.right)
        return left + right if isinstance(node.op, ast.Add) else left * right
    raise ValueError(f"unsupported element {ast.dump(node)}")


def moe_layer_pattern(config):
    """One bool per global layer (0-based): True where the layer's MLP is a `MoELayer`."""
    if config.num_moe_experts is None:
        return [False] * config.num_layers
    return layer_pattern_from_freq(config.moe_layer_freq, config.num_layers)


def layer_pattern_from_freq(freq, num_layers):
    """`--moe-layer-freq` (int or 0/1 list) as one bool per layer."""
    freq = parse_moe_layer_freq(freq)
    if isinstance(freq, int):
        return [index % freq == 0 for index in range(num_layers)]
    return [bool(flag) for flag in freq]


@dataclass(frozen=True, kw_only=True)
class MoEConfigMixin:
    """Mixture-of-Experts settings (`--num-experts` and the `--moe-*` flags)."""

    num_moe_experts: Optional[int] = None
    """Experts per MoE layer (`--num-experts`); None means no MoE layer."""
    moe_ffn_hidden_size: Optional[int] = None
    """Width of each expert's MLP (`--moe-ffn-hidden-size`); None means ffn_hidden_size."""
    moe_layer_freq: Union[int, list, tuple] = 1
    """An int N: layers 0, N, 2N, ... are MoE; a list of 0/1 per layer (`--moe-layer-freq`), kept as a tuple."""
    moe_router_topk: int = 2
    moe_router_score_function: str = "softmax"
    moe_router_pre_softmax: bool = False
    """Softmax over all experts before the top-k (no renormalisation over the chosen k); needed with top-1
    softmax routing. No effect with sigmoid / sqrtsoftplus scores (always computed before the top-k)."""
    moe_router_topk_scaling_factor: Optional[float] = None
    moe_router_num_groups: Optional[int] = None
    moe_router_group_topk: Optional[int] = None
    moe_router_enable_expert_bias: bool = False
    """Aux-loss-free balancing: a per-expert bias added to the scores for the choice of experts only."""
    moe_router_bias_update_rate: float = 1e-3
    moe_router_bias: bool = False
    """The router's logits are x W^T + b with a learned bias b `[num_experts]` (`router.bias`, zeros at
    initialisation; gpt-oss) (`--moe-router-bias`). Upstream adds it to every router with `add_bias_linear`; here it
    is asked for, so that bias-linear MoE models and their checkpoints keep their routers. Needs add_bias_linear."""
    moe_router_dtype: Optional[str] = None
    """None (the input's dtype), "fp32" or "fp64": the router's logits, probabilities and the combine."""
    moe_router_load_balancing_type: Union[str, Tuple[str, ...]] = "aux_loss"
    """One type, or several (a tuple) each added with its own coefficient of `moe_aux_loss_coeff`."""
    moe_aux_loss_coeff: Union[float, Tuple[float, ...]] = 0.0
    """One coefficient, or a tuple pairing element by element with a tuple of load-balancing types."""
    moe_z_loss_coeff: Optional[float] = None
    moe_expert_capacity_factor: Optional[float] = None
    """None: dropless. Else each expert takes at most ceil(tokens * topk / experts * factor) tokens per rank."""
    moe_pad_expert_input_to_capacity: bool = False
    moe_token_drop_policy: str = "probs"
    moe_token_dispatcher_type: str = "allgather"
    moe_grouped_gemm: bool = False
    moe_shared_expert_intermediate_size: Optional[int] = None
    moe_shared_expert_overlap: bool = False
    moe_shared_expert_gate: bool = False
    """Multiply the shared experts' output by sigmoid(x . w), w a [1, hidden] weight of the shared experts."""
    expert_tensor_parallel_size: Optional[int] = None
    """Tensor-parallel size of the experts (their linears split over that many ranks of the expert grid); None
    means tensor_model_parallel_size."""
    moe_input_jitter_eps: Optional[float] = None
    """In training, the router's input is multiplied by noise drawn uniformly from [1 - eps, 1 + eps] (the experts
    get the input unchanged) (`--moe-input-jitter-eps`)."""
    moe_router_force_load_balancing: bool = False
    """Benchmarking: route by random normal logits instead of the router's (the gradient passes to the router's
    logits unchanged), so the load is balanced whatever the weights (`--moe-router-force-load-balancing`)."""
    moe_router_padding_for_fp8: bool = False
    """Each expert's token count on a rank is padded with probability-0 tokens to a multiple of
    `fp8_routing_pad_multiple` (the FP8 recipe's GEMM alignment: 32 under mxfp8, 16 otherwise; the output is
    unchanged up to the FP8 scales, whose amaxes see the padded tokens) (`--moe-router-padding-for-fp8`)."""
    moe_apply_probs_on_input: bool = False
    """Scale each token by its routing probability before the expert instead of scaling the expert's output (top-1
    routing only) (`--moe-apply-probs-on-input`)."""
    moe_layer_recompute: bool = False
    """Recompute the whole MoE layer (router, dispatch, experts) in backward (`--moe-layer-recompute`)."""
    moe_latent_size: Optional[int] = None
    """Latent MoE (`--moe-latent-size`; Nemotron-3): the routed tokens are projected from the hidden width down to
    this width before dispatch and the experts work in it (fc1 latent -> moe_ffn_hidden_size, fc2 back); the
    combined output is projected back up. The router and the shared experts read the full hidden state. None: the
    experts work at the hidden width."""
    moe_per_layer_logging: bool = False
    """Log each MoE layer's auxiliary losses too, besides their average (`--moe-per-layer-logging`)."""
    moe_router_padding_for_quantization: bool = False
    """Upstream's newer name of `moe_router_padding_for_fp8`; either sets both."""
    moe_permute_fusion: bool = False
    """Upstream's fused permutation kernels (`--moe-permute-fusion`); the torch ops here give the same values."""
    moe_router_fusion: bool = False
    """Upstream's fused router kernels (`--moe-router-fusion`); the torch ops here give the same values."""
    moe_use_legacy_grouped_gemm: bool = False
    """Upstream's choice of grouped-GEMM implementation (`--moe-use-legacy-grouped-gemm`); no effect here."""
    moe_enable_deepep: bool = False
    """DeepEP dispatch (`--moe-enable-deepep`): refused, it needs DeepEP on CUDA GPUs."""
    moe_deepep_num_sms: int = 20
    """Streaming multiprocessors DeepEP uses (`--moe-deepep-num-sms`); read by DeepEP only."""
    moe_router_topk_limited_devices: Optional[int] = None
    """Upstream's removed device-limited routing (`--moe-router-topk-limited-devices`): refused, naming its
    replacement (group-limited routing, one group per expert-parallel rank)."""

    @property
    def num_local_experts(self):
        return self.num_moe_experts // self.expert_model_parallel_size

    def _validate_moe(self):
        self._refuse_topk_limited_devices()
        if self.num_moe_experts is None:
            self._validate_no_moe_flags()
            return
        experts = self.num_moe_experts
        if isinstance(experts, bool) or not isinstance(experts, int) or experts <= 0:
            raise ValueError(f"--num-experts must be a positive integer, got {experts!r}")
        if self.moe_ffn_hidden_size is None:
            object.__setattr__(self, "moe_ffn_hidden_size", self.ffn_hidden_size)
        self._validate_dispatcher()
        self._validate_moe_parallel(experts)
        self._validate_moe_layer_freq()
        self._validate_router(experts)
        self._validate_load_balancing()
        self._validate_capacity()
        self._validate_shared_experts()
        self._validate_moe_switches()
        self._validate_latent_size()
        if self.fp8 is not None and self.transformer_impl == "transformer_engine":
            raise ValueError("--fp8-format with --num-experts needs --transformer-impl local: the experts run the "
                             "torch-native FP8 linears, which Transformer Engine's FP8 autocast does not reach")

    def _refuse_topk_limited_devices(self):
        devices, ep = self.moe_router_topk_limited_devices, self.expert_model_parallel_size
        if devices is None:
            return
        replacement = (f"set moe_router_num_groups={ep} (--moe-router-num-groups) and moe_router_group_topk="
                       f"{devices} (--moe-router-group-topk) instead" if devices < ep
                       else f"at expert_model_parallel_size {ep} it limits nothing: drop it")
        raise ValueError("moe_router_topk_limited_devices (--moe-router-topk-limited-devices) was replaced upstream "
                         f"by group-limited routing (one group of experts per expert-parallel rank): {replacement}")

    def _validate_no_moe_flags(self):
        for name, (flag, default) in _FIELDS_NEEDING_EXPERTS.items():
            if getattr(self, name) != default:
                raise ValueError(f"{flag} needs --num-experts; set the number of experts or drop {flag}")
        if self.expert_model_parallel_size > 1:
            raise ValueError("--expert-model-parallel-size > 1 needs --num-experts")
        if self.moe_router_padding_for_quantization:
            raise ValueError(f"{FP8_PADDING_NEWER_NAME} needs --num-experts; set the number of experts or drop it")
        if self.moe_enable_deepep:
            raise ValueError("--moe-enable-deepep needs --num-experts (and DeepEP on CUDA GPUs): drop it")

    def _validate_dispatcher(self):
        kind = self.moe_token_dispatcher_type
        if kind not in TOKEN_DISPATCHER_TYPES:
            raise ValueError(f"--moe-token-dispatcher-type must be one of {TOKEN_DISPATCHER_TYPES}, got {kind!r}")
        if kind == "flex":
            raise ValueError("--moe-token-dispatcher-type flex needs DeepEP or HybridEP on CUDA GPUs, which this "
                             "build does not provide: use --moe-token-dispatcher-type alltoall (or allgather)")

    def _validate_moe_parallel(self, experts):
        ep, tp = self.expert_model_parallel_size, self.tensor_model_parallel_size
        if experts % ep != 0:
            raise ValueError(f"--num-experts ({experts}) must be divisible by --expert-model-parallel-size ({ep}): "
                             "each expert-parallel rank holds the same number of experts")
        if self.expert_tensor_parallel_size is None:
            object.__setattr__(self, "expert_tensor_parallel_size", tp)
        etp = self.expert_tensor_parallel_size
        if isinstance(etp, bool) or not isinstance(etp, int) or etp < 1:
            raise ValueError(f"--expert-tensor-parallel-size must be a positive integer, got {etp!r}")
        # TP > 1 without --sequence-parallel is refused for training only (MoELayer.forward in training mode, and
        # the training flags' validation): generation runs it, every tensor-parallel rank routing all the tokens.
        if etp != tp and self.fp8 is not None:
            raise ValueError(f"--fp8-format with --expert-tensor-parallel-size ({etp}) other than "
                             f"--tensor-model-parallel-size ({tp}) is not supported: the experts' FP8 scaling "
                             "reduces amaxes over the tensor-parallel group; drop --expert-tensor-parallel-size "
                             "or --fp8-format")
        size = self.moe_ffn_hidden_size
        if not isinstance(size, int) or size <= 0 or size % etp != 0:
            raise ValueError(f"--moe-ffn-hidden-size ({size!r}) must be a positive integer divisible by "
                             f"--expert-tensor-parallel-size ({etp})")

    def _validate_moe_layer_freq(self):
        freq = parse_moe_layer_freq(self.moe_layer_freq)
        object.__setattr__(self, "moe_layer_freq", freq)
        if isinstance(freq, int):
            if freq < 1:
                raise ValueError(f"--moe-layer-freq must be >= 1, got {freq}")
            return
        if len(freq) != self.num_layers or any(flag not in (0, 1) for flag in freq):
            raise ValueError(f"--moe-layer-freq list {freq} must hold one 0 or 1 per layer (--num-layers "
                             f"{self.num_layers})")
        object.__setattr__(self, "moe_layer_freq", tuple(freq))  # immutable, like the rest of the config

    def _validate_router(self, experts):
        topk = self.moe_router_topk
        if isinstance(topk, bool) or not isinstance(topk, int) or not 1 <= topk <= experts:
            raise ValueError(f"--moe-router-topk ({topk!r}) must be between 1 and --num-experts ({experts})")
        if self.moe_router_score_function not in SCORE_FUNCTIONS:
            raise ValueError(f"--moe-router-score-function must be one of {SCORE_FUNCTIONS}, "
                             f"got {self.moe_router_score_function!r}")
        # --moe-router-pre-softmax with sigmoid / sqrtsoftplus is accepted and changes nothing, as upstream (its
        # DeepSeek-V3 recipes pass it): those scores are always computed before the top-k.
        if self.moe_router_dtype not in ROUTER_DTYPES:
            raise ValueError(f"--moe-router-dtype must be fp32 or fp64 (or unset), got {self.moe_router_dtype!r}")
        factor = self.moe_router_topk_scaling_factor
        if factor is not None and factor <= 0:
            raise ValueError(f"--moe-router-topk-scaling-factor must be positive, got {factor}")
        groups, group_topk = self.moe_router_num_groups, self.moe_router_group_topk
        if groups is not None and group_topk is None:
            # Megatron-LM ignores the group count alone and routes over all experts; refused here instead.
            raise ValueError(f"--moe-router-num-groups ({groups}) without --moe-router-group-topk: group-limited "
                             "routing needs both; add --moe-router-group-topk g (the 1 <= g <= "
                             f"{groups} groups each token may use), or drop --moe-router-num-groups to route over "
                             "all experts")
        if group_topk is not None and groups is None:
            raise ValueError(f"--moe-router-group-topk ({group_topk}) without --moe-router-num-groups: group-limited "
                             "routing needs both; add --moe-router-num-groups G (a divisor of --num-experts "
                             f"({experts}) that splits the experts into G groups), or drop --moe-router-group-topk")
        if groups is not None:
            if groups <= 0 or experts % groups != 0:
                raise ValueError(f"--moe-router-num-groups ({groups}) must be a positive divisor of --num-experts "
                                 f"({experts})")
            if not 1 <= group_topk <= groups:
                raise ValueError(f"--moe-router-group-topk ({group_topk}) must be between 1 and "
                                 f"--moe-router-num-groups ({groups})")
            if topk % group_topk != 0 or topk // group_topk > experts // groups:
                raise ValueError(f"--moe-router-topk ({topk}) must be a multiple of --moe-router-group-topk "
                                 f"({group_topk}), taking at most {experts // groups} experts (--num-experts / "
                                 "--moe-router-num-groups) from each chosen group")
        if self.moe_router_enable_expert_bias and self.moe_router_score_function not in ("sigmoid", "sqrtsoftplus"):
            raise ValueError("--moe-router-enable-expert-bias needs --moe-router-score-function sigmoid or "
                             "sqrtsoftplus")
        if self.moe_router_bias and not self.add_bias_linear:
            raise ValueError("--moe-router-bias gives the router a bias, which upstream has only with bias linear "
                             "layers: drop --disable-bias-linear or drop --moe-router-bias")
        if self.moe_router_bias_update_rate < 0:
            raise ValueError(f"--moe-router-bias-update-rate must be >= 0, got {self.moe_router_bias_update_rate}")

    def _validate_load_balancing(self):
        kind, coeff = normalize_load_balancing(self.moe_router_load_balancing_type, self.moe_aux_loss_coeff)
        object.__setattr__(self, "moe_router_load_balancing_type", kind)
        object.__setattr__(self, "moe_aux_loss_coeff", coeff)
        if kind == "sinkhorn" and coeff > 0:
            raise ValueError("--moe-router-load-balancing-type sinkhorn takes no auxiliary loss: drop "
                             "--moe-aux-loss-coeff")
        if kind == "sinkhorn":
            self._refuse_settings_sinkhorn_ignores()
        if (self.moe_router_topk == 1 and self.moe_router_score_function == "softmax"
                and not self.moe_router_pre_softmax and kind != "sinkhorn"):
            raise ValueError("--moe-router-topk 1 with --moe-router-score-function softmax needs "
                             "--moe-router-pre-softmax: a softmax over the one chosen logit is always 1, so the "
                             "router would get no gradient from the language-model loss")
        if self.moe_z_loss_coeff is not None and self.moe_z_loss_coeff < 0:
            raise ValueError(f"--moe-z-loss-coeff must be >= 0, got {self.moe_z_loss_coeff}")

    def _refuse_settings_sinkhorn_ignores(self):
        """Sinkhorn routing chooses the top-k of its balanced scores and weighs them by the sigmoid (top-1) or the
        softmax of the logits: the router settings below would be silently ignored (as upstream does)."""
        ignored = [flag for flag, is_set in (
            ("--moe-router-enable-expert-bias", self.moe_router_enable_expert_bias),
            (f"--moe-router-score-function {self.moe_router_score_function}",
             self.moe_router_score_function != "softmax"),
            ("--moe-router-num-groups / --moe-router-group-topk", self.moe_router_num_groups is not None),
            ("--moe-router-topk-scaling-factor", self.moe_router_topk_scaling_factor is not None),
        ) if is_set]
        if ignored:
            raise ValueError(f"--moe-router-load-balancing-type sinkhorn ignores {', '.join(ignored)} (it chooses by "
                             "Sinkhorn-balanced scores, weighted by the sigmoid for --moe-router-topk 1 or the "
                             "softmax of the logits): drop them, or pick another --moe-router-load-balancing-type")

    def _validate_capacity(self):
        factor = self.moe_expert_capacity_factor
        if factor is not None and factor < 0:
            # Upstream: a negative capacity factor means dropless.
            object.__setattr__(self, "moe_expert_capacity_factor", None)
            factor = None
        if self.moe_token_drop_policy not in TOKEN_DROP_POLICIES:
            raise ValueError(f"--moe-token-drop-policy must be one of {TOKEN_DROP_POLICIES}, "
                             f"got {self.moe_token_drop_policy!r}")
        if self.moe_pad_expert_input_to_capacity and factor is None:
            raise ValueError("--moe-pad-expert-input-to-capacity needs --moe-expert-capacity-factor")
        if factor is None:
            return
        if factor == 0:
            raise ValueError("--moe-expert-capacity-factor must be positive (or negative / unset for dropless)")
        if self.moe_router_load_balancing_type == "sinkhorn":
            raise ValueError("--moe-expert-capacity-factor works with --moe-router-load-balancing-type aux_loss, "
                             "seq_aux_loss, global_aux_loss or none, not sinkhorn")

    def _validate_moe_switches(self):
        if self.moe_router_padding_for_fp8 or self.moe_router_padding_for_quantization:
            object.__setattr__(self, "moe_router_padding_for_fp8", True)
            object.__setattr__(self, "moe_router_padding_for_quantization", True)
        if self.moe_enable_deepep:
            raise ValueError("--moe-enable-deepep (moe_enable_deepep) needs DeepEP on CUDA GPUs, which this build "
                             "does not provide: drop it and use --moe-token-dispatcher-type alltoall (or allgather)")
        eps = self.moe_input_jitter_eps
        if eps is not None and (isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 < eps < 1):
            raise ValueError(f"--moe-input-jitter-eps must be in (0, 1), got {eps!r}")
        if self.moe_apply_probs_on_input and self.moe_router_topk != 1:
            raise ValueError(f"--moe-apply-probs-on-input needs --moe-router-topk 1 (each token goes to one expert, "
                             f"which receives it scaled), got {self.moe_router_topk}")
        if self.moe_router_padding_for_fp8 and self.fp8 is None:
            raise ValueError("--moe-router-padding-for-fp8 pads the experts' token counts for FP8 GEMMs: it needs "
                             f"--fp8-format; add it or drop the flag (or its newer name {FP8_PADDING_NEWER_NAME})")

    def _validate_latent_size(self):
        size, tp = self.moe_latent_size, self.tensor_model_parallel_size
        if size is None:
            return
        if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
            raise ValueError(f"--moe-latent-size must be a positive integer, got {size!r}")
        if size % tp != 0:
            # The experts are built from this config with hidden_size = the latent width, which the tensor-parallel
            # split rules then check; every practical latent width is a multiple of the tensor-parallel size.
            raise ValueError(f"--moe-latent-size ({size}) must be divisible by --tensor-model-parallel-size ({tp}); "
                             "pick a latent width that is a multiple of it")

    def _validate_shared_experts(self):
        size = self.moe_shared_expert_intermediate_size
        tp = self.tensor_model_parallel_size
        if size is not None and (size <= 0 or size % tp != 0):
            raise ValueError(f"--moe-shared-expert-intermediate-size ({size}) must be positive and divisible by "
                             f"--tensor-model-parallel-size ({tp})")
        if self.moe_shared_expert_gate and size is None:
            raise ValueError("--moe-shared-expert-gate needs --moe-shared-expert-intermediate-size (it gates the "
                             "shared experts' output; without shared experts there is nothing to gate)")
        if self.moe_shared_expert_overlap:
            if size is None:
                raise ValueError("--moe-shared-expert-overlap needs --moe-shared-expert-intermediate-size")
            if self.moe_token_dispatcher_type != "alltoall":
                raise ValueError("--moe-shared-expert-overlap works with --moe-token-dispatcher-type alltoall only")
