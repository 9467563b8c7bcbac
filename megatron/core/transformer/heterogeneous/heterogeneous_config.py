"""`HeterogeneousTransformerConfig`, upstream's config class for heterogeneous layers, at upstream's import path
(scripts pass it as `core_transformer_config_from_args(args, config_class=HeterogeneousTransformerConfig)`). Every
`TransformerConfig` takes the heterogeneous fields (`heterogeneous_fields`); this class only insists that they are
given."""

from dataclasses import dataclass
from typing import ClassVar

from megatron.core.transformer.heterogeneous.heterogeneous_fields import JSON_FLAG, PATH_FLAG
from megatron.core.transformer.transformer_config import TransformerConfig


@dataclass(frozen=True, kw_only=True)
class HeterogeneousTransformerConfig(TransformerConfig):
    layer_config_class: ClassVar[type] = TransformerConfig  # each layer's own config is uniform

    def __post_init__(self):
        if self.heterogeneous_layers_config_path is None and self.heterogeneous_layers_config_encoded_json is None:
            raise ValueError(f"HeterogeneousTransformerConfig needs the layers: give {PATH_FLAG} (or "
                             f"{JSON_FLAG}), or build a TransformerConfig for uniform layers")
        super().__post_init__()
