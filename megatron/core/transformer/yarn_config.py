"""The YaRN fields of `TransformerConfig`: YaRN rotary embeddings for standard attention
(`--position-embedding-type yarn` and the `--yarn-*` flags, gpt-oss).

The model (`GPTModel`) builds the rotation angles from these fields (`YarnRotaryEmbedding`); the attention layers
multiply cos and sin by `yarn_cos_sin_scale`, which is 1 with the defaults (a scaling factor of 1 is plain RoPE).
Multi-latent attention has YaRN of its own (`--rope-type yarn` with `--rotary-scaling-factor`, `--mscale`, ...),
computed by the same code; these fields then keep their defaults.
"""

from dataclasses import dataclass

# field -> (flag, default)
YARN_FIELDS = {
    "yarn_rotary_scaling_factor": ("--yarn-rotary-scaling-factor", 1.0),
    "yarn_original_max_position_embeddings": ("--yarn-original-max-position-embeddings", 4096),
    "yarn_beta_fast": ("--yarn-beta-fast", 32.0),
    "yarn_beta_slow": ("--yarn-beta-slow", 1.0),
    "yarn_mscale": ("--yarn-mscale", 1.0),
    "yarn_mscale_all_dim": ("--yarn-mscale-all-dim", 0.0),
    "yarn_correction_range_round_to_int": ("--yarn-correction-range-round-to-int", True),
}


@dataclass(frozen=True, kw_only=True)
class YarnConfigMixin:
    """YaRN settings of standard attention's rotary embedding; validated by `_validate_yarn`."""

    yarn_rotary_scaling_factor: float = 1.0
    """s: the context the RoPE was trained for is stretched s times (`--yarn-rotary-scaling-factor`)."""
    yarn_original_max_position_embeddings: int = 4096
    """The context length the unscaled RoPE was trained for (`--yarn-original-max-position-embeddings`)."""
    yarn_beta_fast: float = 32.0
    """Frequencies turning more often than this over the original context keep their value (`--yarn-beta-fast`)."""
    yarn_beta_slow: float = 1.0
    """Frequencies turning less often than this over the original context are divided by s (`--yarn-beta-slow`)."""
    yarn_mscale: float = 1.0
    """cos and sin are multiplied by ms(s, yarn_mscale) / ms(s, yarn_mscale_all_dim) (`--yarn-mscale`)."""
    yarn_mscale_all_dim: float = 0.0
    """See `yarn_mscale` (`--yarn-mscale-all-dim`)."""
    yarn_correction_range_round_to_int: bool = True
    """Round the channel range of the frequency blend outwards to whole channel pairs (the YaRN paper's and
    DeepSeek's rule); False keeps the fractional bounds (gpt-oss, HF's `truncate: false`)
    (`--[no-]yarn-correction-range-round-to-int`)."""

    @property
    def yarn_cos_sin_scale(self) -> float:
        """The factor on standard attention's cos and sin: ms(s, mscale) / ms(s, mscale_all_dim), 1 when s <= 1."""
        # Imported here: the embeddings package imports the transformer config.
        from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import yarn_cos_sin_scale

        return yarn_cos_sin_scale(self.yarn_rotary_scaling_factor, self.yarn_mscale, self.yarn_mscale_all_dim)

    def _validate_yarn(self):
        for name in ("yarn_rotary_scaling_factor", "yarn_original_max_position_embeddings", "yarn_beta_fast",
                     "yarn_beta_slow"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"{YARN_FIELDS[name][0]} must be a positive number, got {value!r}")
        if self.multi_latent_attention:
            changed = [flag for name, (flag, default) in YARN_FIELDS.items() if getattr(self, name) != default]
            if changed:
                raise ValueError(f"{', '.join(changed)} shape the YaRN rotary embedding of standard attention; "
                                 "--multi-latent-attention has its own (--rope-type yarn, --rotary-scaling-factor, "
                                 "--mscale, --mscale-all-dim, --original-max-position-embeddings): use those")
