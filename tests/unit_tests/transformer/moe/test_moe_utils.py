"""The glue of the auxiliary losses: their backward scale follows the language-model loss's, the tracker
averages over MoE layers and microbatches, and the FLOPs estimate counts top-k experts."""

from types import SimpleNamespace

import pytest
import torch

from megatron.core.transformer.moe import moe_utils
from megatron.training.training_log import training_flops_per_iteration


@pytest.fixture(autouse=True)
def clean_state():
    yield
    moe_utils.clear_aux_losses_tracker()
    moe_utils.MoEAuxLossAutoScaler.backward_scale = None


def test_backward_scale_follows_the_loss():
    config = SimpleNamespace(num_moe_experts=4, grad_scale_func=lambda loss: loss * 8.0, context_parallel_size=2,
                             calculate_per_token_loss=False)
    moe_utils.set_aux_loss_backward_scale(config, num_microbatches=4)
    assert moe_utils.MoEAuxLossAutoScaler.backward_scale.item() == 4.0  # 8 x 2 / 4
    # A per-token loss is summed over DP x CP and divided by the global token count, and each CP rank's auxiliary
    # loss is its share of the sequence's: the loss scale alone, whatever the CP size (CP2 then matches 1 rank).
    config.calculate_per_token_loss = True
    for context_parallel_size in (1, 2):
        config.context_parallel_size = context_parallel_size
        moe_utils.set_aux_loss_backward_scale(config, num_microbatches=4)
        assert moe_utils.MoEAuxLossAutoScaler.backward_scale.item() == 8.0
    moe_utils.set_aux_loss_backward_scale(SimpleNamespace(num_moe_experts=None), num_microbatches=4)
    assert moe_utils.MoEAuxLossAutoScaler.backward_scale.item() == 8.0  # untouched without experts
    activation, loss = torch.ones(3, requires_grad=True), torch.tensor(2.0, requires_grad=True)
    moe_utils.MoEAuxLossAutoScaler.apply(activation, loss).sum().backward()
    assert loss.grad.item() == 8.0 and activation.grad.tolist() == [1.0, 1.0, 1.0]


def test_tracker_averages_layers_and_microbatches():
    for microbatch_value in (1.0, 3.0):  # two microbatches of layers 1 and 3 (of 4)
        moe_utils.save_to_aux_losses_tracker("load_balancing_loss", torch.tensor(microbatch_value), 1, 4)
        moe_utils.save_to_aux_losses_tracker("load_balancing_loss", torch.tensor(2 * microbatch_value), 3, 4)
    logged = moe_utils.reduce_aux_losses_for_logging(["load_balancing_loss"], num_layers=4, num_moe_layers=2,
                                                     num_microbatches=2, data_parallel_size=1, device="cpu")
    assert logged == {"load_balancing_loss": pytest.approx((4.0 + 8.0) / (2 * 2))}
    assert moe_utils.reduce_aux_losses_for_logging(["load_balancing_loss"], 4, 2, 2, 1, "cpu") == {
        "load_balancing_loss": 0.0}  # cleared after logging


def test_tracked_names_of_single_and_listed_losses():
    assert moe_utils.tracked_aux_loss_names("global_aux_loss", 0.1, None) == ["global_load_balancing_loss"]
    assert moe_utils.tracked_aux_loss_names("aux_loss", 0.0, 0.1) == ["z_loss"]
    assert moe_utils.tracked_aux_loss_names(["seq_aux_loss", "global_aux_loss", "aux_loss"], [0.1, 0.2, 0.0],
                                            1e-3) == ["seq_load_balancing_loss", "global_load_balancing_loss",
                                                      "z_loss"]


def test_flops_count_the_topk_experts_not_the_router():
    args = SimpleNamespace(hidden_size=32, num_layers=2, seq_length=16, kv_channels=8, num_attention_heads=4,
                           num_query_groups=4, swiglu=False, ffn_hidden_size=64, padded_vocab_size=128,
                           num_experts=None)
    dense = training_flops_per_iteration(args, 1)
    args.num_experts, args.moe_router_topk, args.moe_ffn_hidden_size = 8, 2, 32
    args.moe_shared_expert_intermediate_size, args.moe_layer_freq = None, 2  # layer 0 MoE, layer 1 dense
    # 2 experts of 32 cost one MLP of 64, and the router is not counted (as upstream's estimate)
    assert training_flops_per_iteration(args, 1) == dense


def test_training_log_reports_the_tracked_losses():
    from megatron.core.num_microbatches_calculator import (
        destroy_num_microbatches_calculator,
        init_num_microbatches_calculator,
    )
    from megatron.training.training_log import moe_aux_losses

    args = SimpleNamespace(num_experts=4, moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=0.01,
                           moe_z_loss_coeff=None, moe_layer_freq="([1]*2+[0]*1)", num_layers=3,
                           data_parallel_size=1, device="cpu")
    assert moe_aux_losses(SimpleNamespace(num_experts=None)) == {}
    init_num_microbatches_calculator(0, global_batch_size=4, micro_batch_size=2, data_parallel_size=1)
    try:
        for layer, value in ((1, 1.0), (2, 1.5), (1, 1.25), (2, 1.25)):  # two microbatches
            moe_utils.save_to_aux_losses_tracker("load_balancing_loss", torch.tensor(value), layer, 3)
        assert moe_aux_losses(args) == {"load_balancing_loss": pytest.approx(5.0 / 4)}
    finally:
        destroy_num_microbatches_calculator()
