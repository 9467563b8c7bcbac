"""Per-layer shapes of a heterogeneous transformer, read from a Hugging Face `block_configs` list.

NVIDIA's Llama-Nemotron models (architecture search, `DeciLMForCausalLM`, model type `nemotron-nas`) keep the
Llama layer but give each layer its own attention and MLP. Their `config.json` holds one entry per layer:

    {"attention": {"n_heads_in_group": 8, "no_op": false, "replace_with_linear": false, ...},
     "ffn": {"ffn_mult": 2.625, "no_op": false, "replace_with_linear": false, ...}}

- attention: `n_heads_in_group` query heads share each key/value head, so the layer has
  num_attention_heads / n_heads_in_group query groups; `no_op` drops the attention with its norm (the residual
  passes through); `replace_with_linear` puts one hidden x hidden linear (after the norm) in its place.
- ffn: the gated MLP's width is `ffn_mult_to_intermediate_size(ffn_mult, hidden_size)`; `no_op` and
  `replace_with_linear` as for the attention.

The other keys the architecture search writes (`window_length`, `num_sink_tokens`, `sparsify`, ...) describe
variants this build does not have: they are accepted at their neutral value (null / false) and refused otherwise,
by layer and key.
"""

import json
from dataclasses import dataclass
from typing import Optional, Tuple

BLOCK_CONFIGS_KEY = "block_configs"

# Keys of an entry that select a variant not built here, with the value that means "off".
_NEUTRAL_ATTENTION_KEYS = {"window_length": None, "num_sink_tokens": None, "sparsify": None,
                           "unshifted_sink": False, "use_prefill_window_in_sink_attention": False, "llama4": None}
_NEUTRAL_FFN_KEYS = {"sparsify": None, "moe": None}
_ATTENTION_KEYS = ("n_heads_in_group", "no_op", "replace_with_linear")
_FFN_KEYS = ("ffn_mult", "no_op", "replace_with_linear")


@dataclass(frozen=True)
class AttentionBlockConfig:
    """One layer's attention: dropped (`no_op`), one linear (`replace_with_linear`), or grouped-query attention
    with `num_query_groups` key/value heads."""

    no_op: bool = False
    replace_with_linear: bool = False
    num_query_groups: Optional[int] = None

    @property
    def is_attention(self) -> bool:
        return not (self.no_op or self.replace_with_linear)


@dataclass(frozen=True)
class MLPBlockConfig:
    """One layer's MLP: dropped (`no_op`), one linear (`replace_with_linear`), or an MLP of width
    `ffn_hidden_size`."""

    no_op: bool = False
    replace_with_linear: bool = False
    ffn_hidden_size: Optional[int] = None

    @property
    def is_mlp(self) -> bool:
        return not (self.no_op or self.replace_with_linear)


@dataclass(frozen=True)
class LayerBlockConfig:
    attention: AttentionBlockConfig
    mlp: MLPBlockConfig


def ffn_mult_to_intermediate_size(ffn_mult: float, hidden_size: int) -> int:
    """The gated MLP width of `ffn_mult`: 2/3 of ffn_mult x hidden (truncated), rounded up to a multiple of 256
    (the rule of the Llama-Nemotron configs: ffn_mult 5.25 at hidden 8192 is 28672)."""
    width = int(2 * ffn_mult * hidden_size / 3)
    return -(-width // 256) * 256


def _flags_of(where, entry, keys, neutral):
    if not isinstance(entry, dict):
        raise ValueError(f"{where} must be an object with {', '.join(keys)}, got {entry!r}")
    unknown = sorted(set(entry) - set(keys) - set(neutral))
    if unknown:
        raise ValueError(f"{where} has keys this build does not know: {', '.join(unknown)} (known: "
                         f"{', '.join(keys + tuple(neutral))})")
    for key, off in neutral.items():
        if entry.get(key) not in (None, off):
            raise ValueError(f"{where}.{key} = {entry[key]!r}: that variant is not built here; only layers with "
                             f"{key} {json.dumps(off)} load")
    for key in ("no_op", "replace_with_linear"):
        if not isinstance(entry.get(key, False), bool):
            raise ValueError(f"{where}.{key} must be true or false, got {entry[key]!r}")
    if entry.get("no_op", False) and entry.get("replace_with_linear", False):
        raise ValueError(f"{where} sets both no_op and replace_with_linear: give one")
    return entry.get("no_op", False), entry.get("replace_with_linear", False)


def _attention_block(where, entry, num_attention_heads) -> AttentionBlockConfig:
    no_op, linear = _flags_of(where, entry, _ATTENTION_KEYS, _NEUTRAL_ATTENTION_KEYS)
    if no_op or linear:
        return AttentionBlockConfig(no_op=no_op, replace_with_linear=linear)
    heads_in_group = entry.get("n_heads_in_group")
    if isinstance(heads_in_group, bool) or not isinstance(heads_in_group, int) or heads_in_group < 1 \
            or num_attention_heads % heads_in_group:
        raise ValueError(f"{where}.n_heads_in_group must be a positive divisor of --num-attention-heads "
                         f"({num_attention_heads}), got {heads_in_group!r}")
    return AttentionBlockConfig(num_query_groups=num_attention_heads // heads_in_group)


def _mlp_block(where, entry, hidden_size) -> MLPBlockConfig:
    no_op, linear = _flags_of(where, entry, _FFN_KEYS, _NEUTRAL_FFN_KEYS)
    if no_op or linear:
        return MLPBlockConfig(no_op=no_op, replace_with_linear=linear)
    ffn_mult = entry.get("ffn_mult")
    if isinstance(ffn_mult, bool) or not isinstance(ffn_mult, (int, float)) or not ffn_mult > 0:
        raise ValueError(f"{where}.ffn_mult must be a positive number, got {ffn_mult!r}")
    return MLPBlockConfig(ffn_hidden_size=ffn_mult_to_intermediate_size(ffn_mult, hidden_size))


def parse_block_configs(block_configs, *, hidden_size: int, num_attention_heads: int,
                        source: str) -> Tuple[LayerBlockConfig, ...]:
    """The layers of a `block_configs` list (`source` names where it came from, for the errors)."""
    if not isinstance(block_configs, list) or not block_configs:
        raise ValueError(f"{source}: {BLOCK_CONFIGS_KEY} must be a non-empty list with one entry per layer")
    layers = []
    for index, entry in enumerate(block_configs):
        where = f"{source}: {BLOCK_CONFIGS_KEY}[{index}]"
        if not isinstance(entry, dict) or set(entry) - {"attention", "ffn"} or "attention" not in entry \
                or "ffn" not in entry:
            raise ValueError(f"{where} must be an object with exactly the keys attention and ffn, got {entry!r}")
        layers.append(LayerBlockConfig(
            attention=_attention_block(f"{where}.attention", entry["attention"], num_attention_heads),
            mlp=_mlp_block(f"{where}.ffn", entry["ffn"], hidden_size)))
    return tuple(layers)

