"""`ModuleSpec`, upstream's description of which module class to build with which arguments.

Layers here are built from the `TransformerConfig` alone (its fields pick norms, attention variant, MoE and the
Transformer Engine or local implementation), so a spec does not choose classes: `GPTModel` checks that the spec
it is given (from `megatron.core.models.gpt.gpt_layer_specs`) asks for what the config builds, through the
config fields recorded in `config_fields`.
"""

import dataclasses
from typing import Any, Dict, List, Optional


@dataclasses.dataclass
class ModuleSpec:
    """`module` built with `params`; `submodules` as upstream (not used to build here). `config_fields` are the
    `TransformerConfig` values this spec stands for, field name -> value."""

    module: Any
    params: Dict[str, Any] = dataclasses.field(default_factory=dict)
    submodules: Optional[Any] = None
    config_fields: Dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class TransformerBlockSubmodules:
    """Upstream's spec of a whole block (`get_gpt_decoder_block_spec`): `layer_specs`, one layer spec per layer
    of the pipeline stage, in order (each checked against the layer the config builds there, dense or MoE), and
    `layer_norm`, the final norm's class (the config picks the norm; None: the block applies no final norm, as
    upstream)."""

    layer_specs: Optional[List[Any]] = None
    layer_norm: Optional[Any] = None
