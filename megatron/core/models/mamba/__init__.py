from megatron.core.models.mamba.mamba_model import MambaModel

__all__ = ["MambaModel"]
