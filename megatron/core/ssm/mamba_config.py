"""The hybrid-model fields of `TransformerConfig`: which layers are Mamba-2, attention or MLP layers, and the
Mamba mixer's shape (upstream's `--mamba-state-dim`, `--mamba-head-dim`, `--mamba-num-groups`,
`--mamba-num-heads`).

`hybrid_layer_pattern` holds one symbol per layer (upstream's `--hybrid-override-pattern` alphabet): `M` a Mamba
layer (norm, mixer, residual), `*` an attention layer (norm, self-attention, residual), `-` an MLP layer (norm, MLP,
residual), `E` a Mixture-of-Experts layer (norm, `MoELayer`, residual; the `--num-experts` / `--moe-*` settings).
None: every layer is a transformer layer (attention then MLP), the GPT model.
"""

import math
from dataclasses import dataclass
from typing import Optional, Tuple

MAMBA, ATTENTION, MLP, MOE = "M", "*", "-", "E"
HYBRID_SYMBOLS = (MAMBA, ATTENTION, MLP, MOE)
PATTERN_FLAG = "--hybrid-override-pattern"


@dataclass(frozen=True, kw_only=True)
class MambaConfigMixin:
    """Hybrid-model settings; validated by `_validate_hybrid_model` (from `__post_init__`)."""

    hybrid_layer_pattern: Optional[str] = None
    """One of `M`, `*`, `-`, `E` per layer (see the module docstring); None: the GPT model's transformer layers."""
    mamba_state_dim: int = 128
    """State size N of each Mamba head (`--mamba-state-dim`)."""
    mamba_head_dim: int = 64
    """Channels P of each Mamba head (`--mamba-head-dim`)."""
    mamba_num_groups: int = 8
    """Groups of heads sharing their B and C projections (`--mamba-num-groups`); a multiple of the
    tensor-parallel size, which splits the mixer by groups."""
    mamba_num_heads: Optional[int] = None
    """Mamba heads (`--mamba-num-heads`); None: 2 x hidden_size / mamba_head_dim (the inner width is twice the
    hidden size)."""
    mamba_conv_kernel: int = 4
    """Width of the mixer's causal depthwise convolution."""
    mamba_chunk_size: int = 128
    """Tokens per chunk of the scan (`ssd_chunked_scan`); changes rounding only."""
    mamba_dt_limit: Tuple[float, float] = (0.0, math.inf)
    """Each step softplus(dt + dt_bias) is clamped to [low, high] (`--mamba-dt-limit`): transformers' Nemotron-H
    clamps from below at its `time_step_min`, Mamba2 to `time_step_limit`; the default clamps nothing."""

    @property
    def mamba_heads(self) -> int:
        return mamba_heads(self.hidden_size, self.mamba_head_dim, self.mamba_num_heads)

    @property
    def mamba_inner_size(self) -> int:
        return self.mamba_heads * self.mamba_head_dim

    def layer_symbol(self, layer_number: int) -> Optional[str]:
        """The pattern's symbol of global layer `layer_number` (1-based); None for a GPT model."""
        return None if self.hybrid_layer_pattern is None else self.hybrid_layer_pattern[layer_number - 1]

    def _validate_hybrid_model(self):
        pattern = self.hybrid_layer_pattern
        if pattern is None:
            return
        if not isinstance(pattern, str) or len(pattern) != self.num_layers or set(pattern) - set(HYBRID_SYMBOLS):
            raise ValueError(f"the hybrid layer pattern {pattern!r} must give one of {', '.join(HYBRID_SYMBOLS)} "
                             f"(Mamba, attention, MLP, MoE) for each of the --num-layers {self.num_layers} layers "
                             f"({PATTERN_FLAG})")
        for name in ("mamba_state_dim", "mamba_head_dim", "mamba_num_groups", "mamba_conv_kernel", "mamba_chunk_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        self._set("moe_layer_freq", hybrid_moe_layer_freq(pattern, self.num_moe_experts, self.moe_layer_freq))
        low, high = (float(bound) for bound in self.mamba_dt_limit)
        if not 0.0 <= low < high:
            raise ValueError(f"--mamba-dt-limit {low} {high}: give 0 <= LOW < HIGH (HIGH may be inf)")
        self._set("mamba_dt_limit", (low, high))
        if self.mtp_num_layers:
            raise ValueError(f"--mtp-num-layers is not supported by hybrid models ({PATTERN_FLAG}): their "
                             "prediction depths would take the last layer's kind; drop it")
        if MAMBA not in pattern:
            return
        check_mamba_shape(self.hidden_size, self.mamba_head_dim, self.mamba_num_heads, self.mamba_num_groups,
                          self.tensor_model_parallel_size, self.context_parallel_size)
        if self.transformer_impl == "transformer_engine":
            raise ValueError(f"Mamba layers ('{MAMBA}' in {PATTERN_FLAG}) do not support --transformer-impl "
                             "transformer_engine: drop it, or use attention and MLP layers only")


def mamba_heads(hidden_size, head_dim, num_heads=None) -> int:
    """Heads of a Mamba mixer: `--mamba-num-heads`, else 2 x hidden size / head dim (an inner width of twice the
    hidden size)."""
    return num_heads or 2 * hidden_size // head_dim


def check_mamba_shape(hidden_size, head_dim, num_heads, num_groups, tensor_parallel_size, context_parallel_size=1):
    """Raise naming the flags when the Mamba mixer's heads, groups and tensor- / context-parallel splits do not
    fit (context parallelism gives each rank a share of a tensor-parallel rank's groups for the whole sequence)."""
    if num_heads is None and (2 * hidden_size) % head_dim:
        raise ValueError(f"the Mamba inner width 2 x --hidden-size ({2 * hidden_size}) must be a multiple of "
                         f"--mamba-head-dim {head_dim}; or give --mamba-num-heads")
    heads = mamba_heads(hidden_size, head_dim, num_heads)
    if heads % num_groups:
        raise ValueError(f"the {heads} Mamba heads must divide into --mamba-num-groups {num_groups}")
    if num_groups % (tensor_parallel_size * context_parallel_size):
        raise ValueError(f"--mamba-num-groups {num_groups} must be a multiple of --tensor-model-parallel-size "
                         f"{tensor_parallel_size} x --context-parallel-size {context_parallel_size}: tensor and "
                         "context parallelism split the Mamba mixer by groups")


def hybrid_moe_layer_freq(pattern, num_experts, moe_layer_freq):
    """The `--moe-layer-freq` of a hybrid model: 1 for its `E` layers, 0 for the others (a list). `E` layers need
    `--num-experts`, `--num-experts` needs `E` layers, and a `--moe-layer-freq` given must say the same."""
    derived = [int(symbol == MOE) for symbol in pattern]
    if not any(derived):
        if num_experts is not None:
            raise ValueError(f"--num-experts sets up the Mixture-of-Experts layers of a hybrid model, which are the "
                             f"'{MOE}' layers of {PATTERN_FLAG}; the pattern {pattern!r} has none: add them or drop "
                             "--num-experts")
        return moe_layer_freq
    if num_experts is None:
        raise ValueError(f"the '{MOE}' layers of {PATTERN_FLAG} {pattern!r} are Mixture-of-Experts layers: give "
                         "--num-experts (and the --moe-* settings)")
    given = moe_layer_freq if isinstance(moe_layer_freq, int) else list(moe_layer_freq)
    if given not in (1, derived):
        raise ValueError(f"--moe-layer-freq {moe_layer_freq} disagrees with the '{MOE}' layers of {PATTERN_FLAG} "
                         f"{pattern!r}: the pattern places a hybrid model's MoE layers; drop --moe-layer-freq")
    return tuple(derived)
