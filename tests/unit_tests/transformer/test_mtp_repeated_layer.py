"""`--mtp-use-repeated-layer`: one multi-token-prediction layer (`mtp.layers.0`) run at every depth. Its depth
losses equal those of a per-depth model whose depths all carry that layer's weights, and differ from those of
independently initialised depths."""

import argparse

import pytest

from megatron.core.transformer.moe.router import routers_of
from tests.unit_tests.models.gpt.gpt_test_utils import fixed_batch, seeded_model, tiny_config
from tests.unit_tests.test_utilities import Utils


def _repeated_against_per_depth():
    Utils.initialize_model_parallel()
    try:
        tokens, labels, position_ids = fixed_batch()
        repeated = seeded_model(tiny_config(mtp_num_layers=3, mtp_use_repeated_layer=True),
                                position_embedding_type="rope")
        per_depth = seeded_model(tiny_config(mtp_num_layers=3), position_embedding_type="rope")
        independent_main, independent_depths = per_depth(tokens, position_ids, labels=labels)
        state = {name: value for name, value in repeated.state_dict().items()}
        for depth in (1, 2):  # every depth of the per-depth model gets the shared layer's weights
            state.update({name.replace("mtp.layers.0.", f"mtp.layers.{depth}."): value
                          for name, value in repeated.state_dict().items() if name.startswith("mtp.layers.0.")})
        per_depth.load_state_dict(state)
        main, depths = repeated(tokens, position_ids, labels=labels)
        shared_main, shared_depths = per_depth(tokens, position_ids, labels=labels)
        return {
            "mtp_layer_indices": sorted({name.split(".")[2] for name, _ in repeated.named_parameters()
                                         if name.startswith("mtp.")}),
            "depths": depths.shape[0],
            "shared_diff": (depths - shared_depths).abs().max().item(),
            "main_diff": (main - shared_main).abs().max().item(),
            "independent_diff": (depths[1:] - independent_depths[1:]).abs().max().item(),
            "independent_main_diff": (main - independent_main).abs().max().item(),
        }
    finally:
        Utils.destroy_model_parallel()


def test_one_layer_runs_at_every_depth():
    result = _repeated_against_per_depth()
    assert result["mtp_layer_indices"] == ["0"] and result["depths"] == 3
    assert result["shared_diff"] == 0.0 and result["main_diff"] == 0.0
    assert result["independent_main_diff"] == 0.0  # the decoder is the same in both models
    assert result["independent_diff"] > 1e-3  # depths 2 and 3 really run the shared weights


def test_moe_aux_losses_are_logged_under_each_depth():
    from megatron.core.transformer.multi_token_prediction import MultiTokenPredictionBlock

    config = tiny_config(mtp_num_layers=2, mtp_use_repeated_layer=True, num_moe_experts=2, moe_router_topk=2)
    block = MultiTokenPredictionBlock(config)
    (router,) = routers_of([block])
    assert [(block.layer_at(depth) is block.layers[0], router.layer_number) for depth in (1, 2)] == [
        (True, config.num_layers + 1), (True, config.num_layers + 2)]


def test_flag_reaches_the_config_and_needs_mtp_num_layers():
    from megatron.training.argument_groups import mtp

    assert mtp.transformer_config_kwargs(argparse.Namespace(
        mtp_num_layers=2, mtp_loss_scaling_factor=0.1, mtp_use_repeated_layer=True))["mtp_use_repeated_layer"]
    with pytest.raises(ValueError, match="--mtp-use-repeated-layer needs --mtp-num-layers"):
        mtp.validate(argparse.Namespace(mtp_num_layers=None, mtp_use_repeated_layer=True,
                                        pipeline_model_parallel_layout=None))
    with pytest.raises(ValueError, match="--mtp-use-repeated-layer needs --mtp-num-layers"):
        tiny_config(mtp_use_repeated_layer=True)
