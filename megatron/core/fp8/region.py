"""The torch-native FP8 region: linear layers run inside one quantize their GEMMs with its recipe.

A region only says which recipe is in effect; it does no communication. Under delayed scaling the amaxes the
layers record (forward and backward, every microbatch) stay pending on the device until the training step
reduces all of them at once (`megatron.core.fp8.scaling.reduce_fp8_amaxes`).
"""

import threading

from megatron.core.fp8.recipe import Fp8RecipeSettings

_LOCAL = threading.local()


def _region_stack():
    if not hasattr(_LOCAL, "regions"):
        _LOCAL.regions = []
    return _LOCAL.regions


class Fp8Region:
    """A torch-native FP8 region: linear layers run inside it quantize with `recipe`."""

    def __init__(self, recipe: Fp8RecipeSettings):
        self.recipe = recipe

    def __enter__(self):
        _region_stack().append(self)
        return self

    def __exit__(self, *exc):
        _region_stack().pop()
        return False


def active_fp8_region():
    """The innermost torch-native FP8 region, or None when FP8 is not in effect."""
    stack = _region_stack()
    return stack[-1] if stack else None
