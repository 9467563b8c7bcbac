"""`ModuleSpec`, upstream's description of which module class to build with which arguments.

Layers here are built from the `TransformerConfig` alone (its fields pick norms, attention variant, MoE and the
Transformer Engine or local implementation), so a spec does not choose classes: `GPTModel` checks that the spec
it is given (from `megatron.core.models.gpt.gpt_layer_specs`) asks for what the config builds, through the
config fields recorded in `config_fields`.
"""

import dataclasses
from typing import Any, Dict, Optional


@dataclasses.dataclass
class ModuleSpec:
    """`module` built with `params`; `submodules` as upstream (not used to build here). `config_fields` are the
    `TransformerConfig` values this spec stands for, field name -> value."""

    module: Any
    params: Dict[str, Any] = dataclasses.field(default_factory=dict)
    submodules: Optional[Any] = None
    config_fields: Dict[str, Any] = dataclasses.field(default_factory=dict)
