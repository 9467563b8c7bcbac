"""Import nvidia-modelopt and its seven Megatron plugin modules once per process, recording the warnings
modelopt's plugin loader prints when a plugin fails (every post-training rank body calls this first, so the
record is taken at the process's first modelopt import)."""

import importlib
import sys
import warnings

PLUGIN_MODULES = (
    "modelopt.torch.quantization.plugins.megatron",
    "modelopt.torch.opt.plugins.mcore_dist_checkpointing",
    "modelopt.torch.distill.plugins.megatron",
    "modelopt.torch.prune.plugins.mcore_minitron",
    "modelopt.torch.speculative.plugins.megatron_eagle",
    "modelopt.torch.sparsity.weight_sparsity.plugins.megatron",
    "modelopt.torch.export.plugins.mcore_custom",
)
# Importing these runs modelopt's plugin loader (`import_plugin`) for each plugin above.
PLUGIN_PARENTS = (
    "modelopt.torch.quantization", "modelopt.torch.opt", "modelopt.torch.distill", "modelopt.torch.prune",
    "modelopt.torch.speculative", "modelopt.torch.sparsity", "modelopt.torch.export",
)

_record = None


def import_modelopt_plugins():
    """{"fresh": modelopt was first imported here, "warnings": [messages], "outcomes": {plugin: outcome}}."""
    global _record
    if _record is None:
        fresh = "modelopt" not in sys.modules
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for name in PLUGIN_PARENTS:
                importlib.import_module(name)
        outcomes = {}
        for name in PLUGIN_MODULES:
            try:
                importlib.import_module(name)
                outcomes[name] = "imported"
            except ModuleNotFoundError as exc:  # modelopt's loader skips these silently
                outcomes[name] = f"needs {exc.name}"
            except Exception as exc:
                outcomes[name] = f"failed: {exc!r}"
        _record = {"fresh": fresh, "warnings": [str(item.message) for item in caught], "outcomes": outcomes}
    return _record
