"""`--fp8-margin` is part of the delayed recipe: current (tensorwise) scaling takes none, as Megatron's tensorwise
recipe (Transformer Engine's `Float8CurrentScaling`) has no margin, in the layers' scaling states and in the
scales `--fp8-param-gather` quantizes weights with."""

from types import SimpleNamespace

import pytest
import torch

from megatron.core.fp8.formats import fp8_max, get_fp8_format
from megatron.core.fp8.fsdp_gather import fp8_gather_codec_policy
from megatron.core.fp8.params import Fp8ParamStorage
from megatron.core.fp8.recipe import Fp8RecipeSettings
from megatron.core.fp8.scaling import LinearScaling

MARGIN = 3


@pytest.mark.parametrize("scaling, divisor", [("tensorwise", 1.0), ("delayed", 2.0**MARGIN)])
def test_margin_divides_delayed_scales_only(scaling, divisor):
    recipe = Fp8RecipeSettings(get_fp8_format("hybrid"), scaling=scaling, margin=MARGIN)
    states = LinearScaling(recipe, "none")
    values = torch.tensor([[0.5, -3.0], [2.0, 1.0]])
    for state in states.states():
        quantized = state.quantize(values)  # delayed, first step: scaled by the tensor's own amax too
        expected = torch.tensor(fp8_max(state.dtype) / divisor, dtype=torch.float32) / 3.0
        torch.testing.assert_close(quantized.scale, expected, rtol=1e-6, atol=0)
        torch.testing.assert_close(state.scale_for(values), expected, rtol=1e-6, atol=0)


@pytest.mark.parametrize("recipe, expected_margin", [("tensorwise", 0), ("delayed", MARGIN)])
def test_fp8_param_gather_scales_take_the_recipes_margin(recipe, expected_margin):
    config = SimpleNamespace(fp8="e4m3", fp8_recipe=recipe, fp8_margin=MARGIN, transformer_impl="local")
    assert Fp8ParamStorage.from_config(4, "cpu", config).margin == expected_margin
    codec = fp8_gather_codec_policy(torch.nn.Linear(2, 2), config).make_codec()
    assert codec.margin == expected_margin


def test_upstream_recipe_enum_configures_the_same_recipe_as_its_name():
    from megatron.core.enums import Fp8Recipe as RecipeName
    from megatron.core.fp8_utils import get_fp8_context
    from megatron.core.transformer.transformer_config import TransformerConfig

    assert [member.value for member in RecipeName] == ["delayed", "tensorwise", "mxfp8", "blockwise", "custom"]
    by_enum = TransformerConfig(num_layers=2, hidden_size=8, num_attention_heads=2, fp8="hybrid",
                                fp8_recipe=RecipeName.tensorwise)
    by_name = TransformerConfig(num_layers=2, hidden_size=8, num_attention_heads=2, fp8="hybrid",
                                fp8_recipe="tensorwise")
    recipe = Fp8RecipeSettings.from_config(by_enum)
    assert recipe is Fp8RecipeSettings.from_config(by_name) and type(recipe.scaling) is str
    assert recipe.scaling == "tensorwise" and not recipe.is_delayed
    with get_fp8_context(by_enum, 0) as region:
        assert region.recipe is recipe
    with pytest.raises(ValueError, match="--fp8-recipe mxfp8 needs Transformer Engine"):
        TransformerConfig(num_layers=2, hidden_size=8, num_attention_heads=2, fp8="hybrid",
                          fp8_recipe=RecipeName.mxfp8)
