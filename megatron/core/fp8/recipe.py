"""`Fp8RecipeSettings`: the format and scaling rules of one FP8 run, built from a `TransformerConfig`.

Named apart from the recipe names themselves, `megatron.core.enums.Fp8Recipe` (also `fp8_utils.Fp8Recipe`),
which are only the `--fp8-recipe` choices; this object adds the format, margin and history settings.
"""

import functools
from dataclasses import dataclass

from megatron.core.fp8.formats import (
    AMAX_COMPUTE_ALGOS,
    GPU_ONLY_RECIPES,
    TORCH_NATIVE_RECIPES,
    Fp8Format,
    get_fp8_format,
)


@dataclass(frozen=True)
class Fp8RecipeSettings:
    """How tensors are scaled into FP8.

    `tensorwise`: each tensor is scaled by its own current amax (reduced over the tensor-parallel ranks that
    hold shards of it). `delayed`: the scale comes from a history of the last `amax_history_len` amaxes
    (`most_recent` or `max` of it), so quantizing needs no reduction on the critical path; the amaxes seen in
    a forward pass are reduced across the ranks that share the tensors when the FP8 region ends.
    `margin` divides the delayed scale by 2**margin to leave head-room for amaxes that grow past the history's;
    current scaling has no such risk and ignores it (`scale_margin`), as Megatron's tensorwise recipe (Transformer
    Engine's `Float8CurrentScaling`) takes no margin. `fp8_wgrad` False (`--no-fp8-wgrad`): the
    linear layers compute their weight gradients from the unquantized input and output gradient.
    """

    fp8_format: Fp8Format
    scaling: str = "delayed"
    margin: int = 0
    amax_history_len: int = 1
    amax_compute_algo: str = "most_recent"
    fp8_wgrad: bool = True

    def __post_init__(self):
        if self.scaling in GPU_ONLY_RECIPES:
            raise ValueError(
                f"--fp8-recipe {self.scaling} needs Transformer Engine on a GPU (--transformer-impl "
                f"transformer_engine); the torch-native FP8 backend implements {TORCH_NATIVE_RECIPES}"
            )
        if self.scaling not in TORCH_NATIVE_RECIPES:
            raise ValueError(f"--fp8-recipe must be one of {TORCH_NATIVE_RECIPES + GPU_ONLY_RECIPES}, "
                             f"got {self.scaling!r}")
        if self.amax_history_len < 1:
            raise ValueError(f"--fp8-amax-history-len must be >= 1, got {self.amax_history_len}")
        if self.amax_compute_algo not in AMAX_COMPUTE_ALGOS:
            raise ValueError(f"--fp8-amax-compute-algo must be one of {AMAX_COMPUTE_ALGOS}, "
                             f"got {self.amax_compute_algo!r}")
        if self.margin < 0:
            raise ValueError(f"--fp8-margin must be >= 0, got {self.margin}")

    @property
    def is_delayed(self) -> bool:
        return self.scaling == "delayed"

    @property
    def scale_margin(self) -> int:
        """The margin scales are computed with: `margin` under delayed scaling, 0 under current scaling."""
        return self.margin if self.is_delayed else 0

    @classmethod
    def from_config(cls, config) -> "Fp8RecipeSettings":
        """The recipe of `config`'s FP8 flags: one object per distinct setting (the FP8 region asks for it per
        layer and pass, and layers compare it by identity first)."""
        # str(): a `megatron.core.enums.Fp8Recipe` member and its name are one setting (and one cached recipe).
        return _recipe(cls, config.fp8, str(config.fp8_recipe), config.fp8_margin, config.fp8_amax_history_len,
                       config.fp8_amax_compute_algo, getattr(config, "fp8_wgrad", True))


def scale_margin_of(config) -> int:
    """`Fp8RecipeSettings.scale_margin` of `config`'s FP8 flags (any recipe name, Transformer Engine's too)."""
    return getattr(config, "fp8_margin", 0) if getattr(config, "fp8_recipe", "delayed") == "delayed" else 0


@functools.lru_cache(maxsize=64)
def _recipe(cls, fp8_format, scaling, margin, amax_history_len, amax_compute_algo, fp8_wgrad):
    return cls(fp8_format=get_fp8_format(fp8_format), scaling=scaling, margin=margin,
               amax_history_len=amax_history_len, amax_compute_algo=amax_compute_algo, fp8_wgrad=fp8_wgrad)
