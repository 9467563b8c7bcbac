"""The fields of heterogeneous layers (a mixin of `TransformerConfig`): each transformer layer with its own
attention and MLP (see `block_configs`).

`--heterogeneous-layers-config-path` names a Hugging Face `config.json` with `block_configs` (one entry per
layer), `--heterogeneous-layers-config-encoded-json` gives the same JSON as text; the config keeps the text, so a
checkpoint's saved arguments carry the layers. Everything else (hidden size, heads, norms, rotary embedding,
activation) comes from the flags as for any GPT model, and where the JSON also states hidden_size,
num_attention_heads or num_hidden_layers they must agree with the flags.

`get_config_for_layer(n)` (upstream's name) is the config layer n's attention and MLP are built from: this one
with that layer's query groups and MLP width. Heterogeneous layers are dense, standard-attention layers: MoE,
multi-latent attention, hybrid patterns and multi-token prediction are refused.
"""

import dataclasses
from dataclasses import dataclass
import json
import os
from typing import Optional, Tuple

from megatron.core.transformer.heterogeneous.block_configs import (
    BLOCK_CONFIGS_KEY,
    LayerBlockConfig,
    parse_block_configs,
)

PATH_FLAG = "--heterogeneous-layers-config-path"
JSON_FLAG = "--heterogeneous-layers-config-encoded-json"

# Keys of a Hugging Face config that must agree with the flags.
_SHAPE_KEYS = (("num_hidden_layers", "num_layers", "--num-layers"), ("hidden_size", "hidden_size", "--hidden-size"),
               ("num_attention_heads", "num_attention_heads", "--num-attention-heads"))


@dataclass(frozen=True, kw_only=True)
class HeterogeneousConfigMixin:
    """Fields of the heterogeneous layers; validated by `_validate_heterogeneous_layers` (from `__post_init__`)."""

    heterogeneous_layers_config_path: Optional[str] = None
    """A Hugging Face `config.json` with `block_configs` (`--heterogeneous-layers-config-path`)."""
    heterogeneous_layers_config_encoded_json: Optional[str] = None
    """The same JSON as text (`--heterogeneous-layers-config-encoded-json`); filled from the file when only the
    path is given."""
    heterogeneous_block_configs: Optional[Tuple[LayerBlockConfig, ...]] = None
    """The layers' shapes, one per layer (derived from the JSON)."""

    @property
    def is_heterogeneous(self) -> bool:
        return self.heterogeneous_block_configs is not None

    def heterogeneous_block(self, layer_number: int) -> Optional[LayerBlockConfig]:
        """The shape of global layer `layer_number` (1-based); None for a homogeneous model."""
        if self.heterogeneous_block_configs is None:
            return None
        return self.heterogeneous_block_configs[layer_number - 1]

    def get_config_for_layer(self, layer_number: int):
        """The config layer `layer_number`'s attention and MLP are built from (this config itself for a
        homogeneous model)."""
        block = self.heterogeneous_block(layer_number)
        if block is None:
            return self
        return self._heterogeneous_layer_configs[_layer_shape(self, block)]

    def _validate_heterogeneous_layers(self):
        text = self.heterogeneous_layers_config_encoded_json
        path = self.heterogeneous_layers_config_path
        if path is None and text is None:
            if self.heterogeneous_block_configs is not None:
                raise ValueError("heterogeneous_block_configs is derived: give the JSON with "
                                 f"{PATH_FLAG} or {JSON_FLAG}")
            return
        if text is None:
            text = read_config_file(path)
            self._set("heterogeneous_layers_config_encoded_json", text)
        source = JSON_FLAG if path is None else f"{PATH_FLAG} {path}"
        document = _config_document(text, source)
        _check_shape_matches_flags(document, source, self)
        layers = parse_block_configs(document[BLOCK_CONFIGS_KEY], hidden_size=self.hidden_size,
                                     num_attention_heads=self.num_attention_heads, source=source)
        if len(layers) != self.num_layers:
            raise ValueError(f"{source}: {len(layers)} block_configs for --num-layers {self.num_layers}: give one "
                             "entry per layer")
        self._refuse_other_layer_kinds()
        self._set("heterogeneous_block_configs", layers)
        configs = {}
        for index, layer in enumerate(layers):
            shape = _layer_shape(self, layer)
            if shape not in configs:
                configs[shape] = self._layer_config(shape, f"{source}: {BLOCK_CONFIGS_KEY}[{index}]")
        object.__setattr__(self, "_heterogeneous_layer_configs", configs)

    def _layer_config(self, shape, where):
        groups, ffn_hidden_size = shape
        tp = self.tensor_model_parallel_size
        if groups % tp:
            raise ValueError(f"{where}: {groups} query groups do not split over --tensor-model-parallel-size {tp}: "
                             "use a tensor-parallel size that divides every layer's groups")
        if ffn_hidden_size % tp:
            raise ValueError(f"{where}: the MLP width {ffn_hidden_size} does not split over "
                             f"--tensor-model-parallel-size {tp}")
        # A uniform config of this one's class (upstream's HeterogeneousTransformerConfig names a plain one).
        layer_class = getattr(type(self), "layer_config_class", type(self))
        fields = {field.name: getattr(self, field.name) for field in dataclasses.fields(layer_class) if field.init}
        fields.update(num_query_groups=groups, ffn_hidden_size=ffn_hidden_size, heterogeneous_layers_config_path=None,
                      heterogeneous_layers_config_encoded_json=None, heterogeneous_block_configs=None)
        try:
            return layer_class(**fields)
        except ValueError as error:
            raise ValueError(f"{where} ({groups} query groups, MLP width {ffn_hidden_size}): {error}") from None

    def _refuse_other_layer_kinds(self):
        for flag, given in (("--num-experts", self.num_moe_experts is not None),
                            ("--multi-latent-attention", self.multi_latent_attention),
                            ("--hybrid-override-pattern", self.hybrid_layer_pattern is not None),
                            ("--mtp-num-layers", bool(self.mtp_num_layers))):
            if given:
                raise ValueError(f"{flag} does not combine with heterogeneous layers ({PATH_FLAG}): their layers "
                                 f"are dense standard-attention layers; drop {flag}")


def _layer_shape(config, block: LayerBlockConfig):
    """(query groups, MLP width) of a layer; the model's own where the layer has no attention or no MLP."""
    groups = block.attention.num_query_groups if block.attention.is_attention else config.num_query_groups
    width = block.mlp.ffn_hidden_size if block.mlp.is_mlp else config.ffn_hidden_size
    return groups, width


def read_config_file(path):
    """The text of the `--heterogeneous-layers-config-path` file."""
    if not os.path.isfile(path):
        raise ValueError(f"{PATH_FLAG} {path}: no such file; give the model's config.json with block_configs (or "
                         f"its text with {JSON_FLAG})")
    with open(path, encoding="utf-8") as handle:
        return handle.read()


def _config_document(text, source):
    try:
        document = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"{source} is not valid JSON: {error}") from None
    if not isinstance(document, dict) or BLOCK_CONFIGS_KEY not in document:
        raise ValueError(f"{source} must be a JSON object with {BLOCK_CONFIGS_KEY} (a Llama-Nemotron / "
                         "DeciLM config.json)")
    return document


def _check_shape_matches_flags(document, source, config):
    """Where the JSON states the model's depth, width or heads, they must be the flags' values."""
    for key, field, flag in _SHAPE_KEYS:
        if key in document and document[key] != getattr(config, field):
            raise ValueError(f"{source} has {key} {document[key]} but {flag} is {getattr(config, field)}: give "
                             f"{flag} {document[key]} (or the config.json of this model)")

