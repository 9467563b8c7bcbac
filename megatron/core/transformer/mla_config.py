"""The multi-latent attention fields of `TransformerConfig` (`--multi-latent-attention` and its shape flags).

Multi-latent attention (DeepSeek-V2/V3) projects each token's keys and values through a shared low-rank latent
of `kv_lora_rank` channels (and, with `q_lora_rank`, its queries through another); each head's query and key
are `[nope (qk_head_dim) | rope (qk_pos_emb_head_dim)]`, where the key's rope part is one vector shared by all
heads. RoPE is YaRN (`rope_type` "yarn", the default) or plain RoPE ("rope"); YaRN with
`rotary_scaling_factor` 1 is plain RoPE.

The shape fields have no defaults here: with `multi_latent_attention` each must be given (the command line gives
upstream's defaults), and without it none may be.
"""

from dataclasses import dataclass, fields
from typing import Optional

ROPE_TYPES = ("rope", "yarn")

# (field, flag) of the shape fields that multi-latent attention needs.
_REQUIRED_SHAPE_FIELDS = (
    ("kv_lora_rank", "--kv-lora-rank"),
    ("qk_head_dim", "--qk-head-dim"),
    ("qk_pos_emb_head_dim", "--qk-pos-emb-head-dim"),
    ("v_head_dim", "--v-head-dim"),
)


def _field_default(config, name):
    """The default of dataclass field `name` in `config`'s own class."""
    return next(field.default for field in fields(config) if field.name == name)


@dataclass(frozen=True, kw_only=True)
class MLAConfigMixin:
    """Multi-latent attention settings; validated by `_validate_multi_latent_attention` (from `__post_init__`)."""

    multi_latent_attention: bool = False
    """Use multi-latent attention instead of (grouped-query) self-attention (`--multi-latent-attention`)."""
    q_lora_rank: Optional[int] = None
    """Rank of the query latent (`--q-lora-rank`); None projects queries straight from the hidden state."""
    kv_lora_rank: Optional[int] = None
    """Rank of the key/value latent (`--kv-lora-rank`)."""
    qk_head_dim: Optional[int] = None
    """Per-head query/key channels without position embedding (`--qk-head-dim`)."""
    qk_pos_emb_head_dim: Optional[int] = None
    """Per-head query/key channels that RoPE rotates (`--qk-pos-emb-head-dim`, even)."""
    v_head_dim: Optional[int] = None
    """Per-head value channels (`--v-head-dim`)."""
    rope_type: Optional[str] = None
    """"rope" or "yarn" (`--rope-type`); None means yarn with multi-latent attention."""
    rotary_base: float = 10000.0
    """RoPE base of the multi-latent attention's rotary embedding (`--rotary-base`)."""
    rotary_scaling_factor: float = 1.0
    """YaRN's context scaling factor s (`--rotary-scaling-factor`)."""
    mscale: float = 1.0
    """YaRN's mscale (`--mscale`)."""
    mscale_all_dim: float = 0.0
    """YaRN's mscale_all_dim (`--mscale-all-dim`)."""
    original_max_position_embeddings: int = 4096
    """The context length the unscaled RoPE was trained for (`--original-max-position-embeddings`)."""
    beta_fast: float = 32.0
    """YaRN: frequencies turning more often than this over the original context keep their value."""
    beta_slow: float = 1.0
    """YaRN: frequencies turning less often than this over the original context are interpolated."""

    @property
    def effective_rope_type(self) -> str:
        """The rope type multi-latent attention uses ("yarn" when unset)."""
        return self.rope_type or "yarn"

    def _validate_multi_latent_attention(self):
        if self.rope_type is not None and self.rope_type not in ROPE_TYPES:
            raise ValueError(f"--rope-type must be one of {ROPE_TYPES}, got {self.rope_type!r}")
        if not self.multi_latent_attention:
            self._reject_latent_fields_without_mla()
            return
        for name, flag in _REQUIRED_SHAPE_FIELDS:
            value = getattr(self, name)
            if value is None:
                raise ValueError(f"--multi-latent-attention needs {flag} (a positive integer); it is not set")
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{flag} must be a positive integer, got {value!r}")
        if self.q_lora_rank is not None and (not isinstance(self.q_lora_rank, int) or self.q_lora_rank <= 0):
            raise ValueError(f"--q-lora-rank must be a positive integer or unset (no query latent), got "
                             f"{self.q_lora_rank!r}")
        if self.qk_pos_emb_head_dim % 2 != 0:
            raise ValueError(f"--qk-pos-emb-head-dim must be even (RoPE rotates channel pairs), got "
                             f"{self.qk_pos_emb_head_dim}")
        if self.num_query_groups != self.num_attention_heads:
            raise ValueError("--multi-latent-attention has no grouped-query attention: every head has its own key "
                             "and value from the shared latent; drop --group-query-attention / --num-query-groups")
        if self.transformer_impl != "local":
            raise ValueError("--multi-latent-attention is built from the local layers: use --transformer-impl local")
        for flag, value in (("--rotary-scaling-factor", self.rotary_scaling_factor),
                            ("--original-max-position-embeddings", self.original_max_position_embeddings),
                            ("--rotary-base", self.rotary_base), ("beta_fast", self.beta_fast),
                            ("beta_slow", self.beta_slow)):
            if value <= 0:
                raise ValueError(f"{flag} must be positive, got {value}")
        # With plain RoPE the factor is unused: 1 or the class's default (MLATransformerConfig's YaRN default of 40,
        # which upstream accepts with rope_type="rope") is fine, any other value was set for nothing.
        unused_factors = (1.0, _field_default(self, "rotary_scaling_factor"))
        if self.effective_rope_type == "rope" and self.rotary_scaling_factor not in unused_factors:
            raise ValueError(f"--rotary-scaling-factor {self.rotary_scaling_factor} scales YaRN rotary embeddings: "
                             "use --rope-type yarn (the default with --multi-latent-attention) or drop the factor")

    def _reject_latent_fields_without_mla(self):
        if self.rope_type == "yarn":
            raise ValueError("--rope-type yarn is implemented for --multi-latent-attention only: add "
                             "--multi-latent-attention or use --rope-type rope")
        for name, flag in (("q_lora_rank", "--q-lora-rank"), *_REQUIRED_SHAPE_FIELDS):
            if getattr(self, name) is not None:
                raise ValueError(f"{flag} shapes multi-latent attention: add --multi-latent-attention or drop it")
        if self.rotary_scaling_factor != 1.0:
            raise ValueError("--rotary-scaling-factor scales the YaRN rotary embedding of --multi-latent-attention: "
                             "add --multi-latent-attention or drop it")
