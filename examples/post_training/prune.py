"""Minitron width pruning (hidden and FFN sizes) with nvidia-modelopt's `mcore_minitron` mode: where it can run.

modelopt's Megatron pruning plugin (`modelopt.torch.prune.plugins.mcore_minitron`, built on its NAS plugin
`modelopt.torch.nas.plugins.megatron`) imports transformer_engine unconditionally, so it needs Transformer
Engine and therefore CUDA; modelopt skips it silently where TE is missing. Beyond TE its NAS plugin imports
upstream Megatron-Core modules this code base does not have (hybrid/Mamba models `megatron.core.models.hybrid`,
`megatron.core.ssm.gated_delta_net`, the MoE layer specs `megatron.core.models.gpt.moe_module_specs`, module specs
`megatron.core.transformer.spec_utils`) and rebuilds upstream's layer internals dynamically. `check_pruning_available()`
says which of these stands in the way here; `main()` runs it and stops with that message.
"""

import importlib

MINITRON_PLUGIN = "modelopt.torch.prune.plugins.mcore_minitron"


def check_pruning_available():
    """Raise RuntimeError naming what modelopt's Minitron pruning plugin needs and this environment lacks."""
    from megatron.core.optional_deps import HAVE_TE, have_modelopt

    if not have_modelopt():
        raise RuntimeError("Minitron pruning needs nvidia-modelopt: pip install -e '.[modelopt]'")
    if not HAVE_TE:
        raise RuntimeError(
            "Minitron pruning (modelopt's mcore_minitron mode) needs transformer-engine, which modelopt's Megatron "
            "NAS plugin imports unconditionally, and so a CUDA machine with TE installed (pip install '.[te]'); "
            "it does not run on CPUs. Quantization (quantize.py), QAT and distillation (distill.py) do."
        )
    try:
        importlib.import_module(MINITRON_PLUGIN)
    except ImportError as exc:
        raise RuntimeError(
            f"modelopt's Minitron pruning plugin does not import against this megatron.core ({exc}): it builds on "
            "upstream Megatron-Core modules (hybrid and Mamba models, gated delta net, MoE and layer specs) that "
            "this code base does not provide"
        ) from exc


def main():
    check_pruning_available()
    raise RuntimeError("modelopt's Minitron pruning plugin imported, but pruning this code base's GPTModel with it "
                       "has not been validated: its NAS plugin expects upstream Megatron-Core's layer internals")


if __name__ == "__main__":
    main()
