"""The glue of the auxiliary losses: their backward scale follows the language-model loss's, the tracker
averages over MoE layers and microbatches, and the FLOPs estimate counts top-k experts."""

import math
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.transformer.moe import moe_utils
from megatron.training.training_log import training_flops_per_iteration
from tests.unit_tests.multiprocess_harness import run_on_ranks


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
    init_num_microbatches_calculator(0, None, global_batch_size=4, micro_batch_size=2, data_parallel_size=1)
    try:
        for layer, value in ((1, 1.0), (2, 1.5), (1, 1.25), (2, 1.25)):  # two microbatches
            moe_utils.save_to_aux_losses_tracker("load_balancing_loss", torch.tensor(value), layer, 3)
        assert moe_aux_losses(args) == {"load_balancing_loss": pytest.approx(5.0 / 4)}
    finally:
        destroy_num_microbatches_calculator()


# Upstream's functions of moe_utils, by their names and arguments, against values computed by hand.

def test_upstream_loss_and_capacity_functions():
    probs = torch.tensor([[0.5, 0.3, 0.2], [0.1, 0.6, 0.3]])
    counts = torch.tensor([1.0, 2.0, 1.0])
    # 0.1 * 3 / (2 * 4^2) * (0.6 * 1 + 0.9 * 2 + 0.5 * 1)
    expected = 0.1 * 3 / (2 * 16) * 2.9
    assert moe_utils.switch_load_balancing_loss_func(probs, counts, 4, 2, 3, 0.1).item() == pytest.approx(expected)
    # Two groups side by side ([s, b * E], upstream's seq_aux_loss): E comes from num_experts, not the width.
    wide = torch.cat([probs, probs], dim=1)
    assert moe_utils.switch_load_balancing_loss_func(wide, torch.cat([counts, counts]), 4, 2, 3, 0.1).item() == (
        pytest.approx(2 * expected))
    logits = torch.tensor([[0.0, 0.0], [1.0, 2.0]])
    logsumexp = [math.log(2.0), math.log(math.exp(1.0) + math.exp(2.0))]
    assert moe_utils.z_loss_func(logits, 0.5).item() == pytest.approx(0.5 * (logsumexp[0] ** 2 + logsumexp[1] ** 2) / 2)
    assert moe_utils.get_capacity(num_tokens=10 * 2, num_experts=4, capacity_factor=1.5) == 8  # ceil(7.5)
    assert moe_utils.get_capacity(num_tokens=4, num_experts=8, capacity_factor=1.0, min_capacity=2) == 2
    updated = moe_utils.get_updated_expert_bias(torch.tensor([4.0, 1.0, 1.0]), torch.tensor([0.5, 0.0, -0.5]), 0.1)
    assert updated.tolist() == pytest.approx([0.4, 0.1, -0.4])  # mean count 2: -0.1, +0.1, +0.1
    cost = torch.tensor([[0.0, 3.0], [0.0, 3.0], [0.0, 3.0], [3.0, 0.0]])
    loose, tight = moe_utils.sinkhorn(cost, tol=1.0), moe_utils.sinkhorn(cost, tol=1e-9)
    assert not torch.allclose(loose, tight)
    torch.testing.assert_close(tight.sum(dim=0), torch.full((2,), 0.5), rtol=1e-5, atol=1e-7)


def test_upstream_topk_softmax_with_capacity():
    logits = torch.tensor([[3.0, 1.0, 0.0], [2.0, 0.0, 1.5], [0.0, 4.0, 3.5], [1.0, 0.2, 0.0]])
    probs, routing_map, tokens_per_expert = moe_utils.topk_softmax_with_capacity(logits, 2)
    expected = torch.zeros(4, 3)
    for token, (first, second) in enumerate(((0, 1), (0, 2), (1, 2), (0, 1))):
        chosen = logits[token, [first, second]]
        expected[token, [first, second]] = torch.exp(chosen) / torch.exp(chosen).sum()
    torch.testing.assert_close(probs, expected)
    assert routing_map.tolist() == (expected > 0).tolist() and tokens_per_expert.tolist() == [3, 3, 2]
    scaled, _, _ = moe_utils.topk_softmax_with_capacity(logits, 2, use_pre_softmax=True, scaling_factor=2.0)
    torch.testing.assert_close(scaled, 2.0 * torch.softmax(logits, dim=-1) * (expected > 0))
    # Capacity ceil(4 * 2 / 3 * 0.5) = 2 tokens per expert. Expert 0 has tokens 0, 1, 3 (probabilities 0.88,
    # 0.62, 0.69), expert 1 tokens 0, 2, 3 (0.12, 0.62, 0.31), expert 2 tokens 1, 2 (no drop).
    by_probs, map_probs, counts = moe_utils.topk_softmax_with_capacity(logits, 2, capacity_factor=0.5)
    assert counts.tolist() == [3, 3, 2]  # counted before the drops
    assert map_probs.t().tolist() == [[True, False, False, True], [False, False, True, True],
                                      [False, True, True, False]]
    torch.testing.assert_close(by_probs, expected * map_probs)
    _, map_position, _ = moe_utils.topk_softmax_with_capacity(logits, 2, capacity_factor=0.5,
                                                             drop_policy="position")
    assert map_position.t().tolist() == [[True, True, False, False], [True, False, True, False],
                                         [False, True, True, False]]
    with pytest.raises(ValueError, match="--moe-expert-capacity-factor"):
        moe_utils.topk_softmax_with_capacity(logits, 2, pad_to_capacity=True)


def test_upstream_permute_and_unpermute():
    tokens = torch.arange(10, dtype=torch.float32).view(5, 2)
    routing_map = torch.tensor([[1, 0, 1], [0, 1, 0], [1, 1, 0], [0, 0, 1], [0, 1, 0]], dtype=torch.bool)
    probs = torch.tensor([[0.6, 0.0, 0.4], [0.0, 1.0, 0.0], [0.3, 0.7, 0.0], [0.0, 0.0, 1.0], [0.0, 1.0, 0.0]])
    permuted, permuted_probs, sorted_indices = moe_utils.permute(tokens, routing_map, probs=probs)
    assert sorted_indices.tolist() == [0, 2, 1, 2, 4, 0, 3]  # expert 0's tokens, then expert 1's, then 2's
    assert torch.equal(permuted, tokens[[0, 2, 1, 2, 4, 0, 3]])
    assert permuted_probs.tolist() == pytest.approx([0.6, 0.3, 1.0, 0.7, 1.0, 0.4, 1.0])
    # Without probabilities each token comes back once per expert; with them, weighted (the probs sum to 1).
    summed = moe_utils.unpermute(permuted, sorted_indices, tokens.shape)
    assert torch.equal(summed, tokens * routing_map.sum(dim=1, keepdim=True))
    weighted = moe_utils.unpermute(permuted, sorted_indices, tokens.shape, probs=probs.double(),
                                   routing_map=routing_map)
    assert weighted.dtype == torch.float32
    torch.testing.assert_close(weighted, tokens)
    # drop_and_pad: capacity 2 slots per expert, the routed tokens first, then the earliest others (prob 0).
    padded, padded_probs, padded_indices = moe_utils.permute(tokens, routing_map, probs=probs, num_out_tokens=6,
                                                             drop_and_pad=True)
    assert padded_indices.tolist() == [0, 2, 1, 2, 0, 3] and torch.equal(padded, tokens[[0, 2, 1, 2, 0, 3]])
    assert padded_probs.tolist() == pytest.approx([0.6, 0.3, 1.0, 0.7, 0.4, 1.0])
    restored = moe_utils.unpermute(padded, padded_indices, tokens.shape, probs=probs, routing_map=routing_map,
                                   drop_and_pad=True)
    torch.testing.assert_close(restored, tokens * torch.tensor([[1.0], [1.0], [1.0], [1.0], [0.0]]))
    with pytest.raises(ValueError, match="routing_map"):
        moe_utils.unpermute(permuted, sorted_indices, tokens.shape, probs=probs)


class _RecordingWriter:
    def __init__(self):
        self.scalars = {}

    def add_scalar(self, name, value, iteration):
        self.scalars[name] = (pytest.approx(value), iteration)


def test_upstream_tracker_view_and_track_moe_metrics():
    moe_utils.save_to_aux_losses_tracker("load_balancing_loss", torch.tensor(5.0), None, 4)  # unnumbered: skipped
    assert moe_utils.get_moe_layer_wise_logging_tracker() == {}
    for microbatch_value in (1.0, 3.0):  # two microbatches of MoE layers 1 and 3 (0-based 0 and 2) of 4
        moe_utils.save_to_aux_losses_tracker("load_balancing_loss", torch.tensor(microbatch_value), 1, 4)
        moe_utils.save_to_aux_losses_tracker("load_balancing_loss", torch.tensor(2 * microbatch_value), 3, 4)
    tracker = moe_utils.get_moe_layer_wise_logging_tracker()
    assert tracker["load_balancing_loss"]["values"].tolist() == [4.0, 0.0, 8.0, 0.0]
    writer, totals = _RecordingWriter(), {"load_balancing_loss": torch.tensor(1.0)}
    moe_utils.track_moe_metrics(loss_scale=1 / 2, iteration=7, writer=writer, total_loss_dict=totals,
                                per_layer_logging=True, track_names=["load_balancing_loss"], num_layers=4,
                                moe_layer_freq=2)
    assert writer.scalars == {"load_balancing_loss": (3.0, 7), "moe/load_balancing_loss_layer_0": (2.0, 7),
                              "moe/load_balancing_loss_layer_2": (4.0, 7)}
    assert totals["load_balancing_loss"].item() == pytest.approx(1.0 + 3.0)
    assert moe_utils.get_moe_layer_wise_logging_tracker() == {}  # cleared


def _log_upstream_style_saves(tensor_model_parallel_size):
    """Two ranks (TP 2, or DP 2), two microbatches of layer 2 of 3, saved as a user's router would upstream."""
    rank = dist.get_rank()
    moe_utils.clear_aux_losses_tracker()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tensor_model_parallel_size)
    tp_group = parallel_state.get_tensor_model_parallel_group()
    tp_dp_group = parallel_state.get_tensor_and_data_parallel_group(with_context_parallel=True)
    for microbatch in range(2):
        value = float(10 * rank + microbatch + 1)  # rank 0: 1, 2; rank 1: 11, 12 (sums 3 and 23)
        moe_utils.save_to_aux_losses_tracker("share_loss", torch.tensor(value), 2, 3, reduce_group=tp_group,
                                             per_layer=True)
        moe_utils.save_to_aux_losses_tracker("averaged_loss", torch.tensor(value), 2, 3, avg_group=tp_group)
        moe_utils.save_to_aux_losses_tracker("global_loss", torch.tensor(value), 2, 3, tp_dp_group, None, True)
    names = ["share_loss", "averaged_loss", "global_loss"]
    logged = moe_utils.reduce_aux_losses_for_logging(names, num_layers=3, num_moe_layers=1, num_microbatches=2,
                                                     data_parallel_size=parallel_state.get_data_parallel_world_size(),
                                                     device="cpu")
    parallel_state.destroy_model_parallel()
    return logged


def test_tracker_honours_upstream_reduce_and_avg_groups_over_tensor_parallel_ranks():
    # TP 2: the shares add up over TP (12 + 14 over 2 microbatches), avg_group averages them (6 + 7 over 2), the
    # TP x DP sum (here TP) adds them up too; --moe-per-layer-logging adds each layer's value of every loss.
    for logged in run_on_ranks(2, _log_upstream_style_saves, 2):
        expected = {"share_loss": 13.0, "averaged_loss": 6.5, "global_loss": 13.0}
        assert logged == pytest.approx({**expected, **{f"{name}_layer_1": value for name, value in expected.items()}})


def test_tracker_averages_data_parallel_replicas_unless_the_reduce_group_spans_them():
    # DP 2: a TP group of one rank leaves each replica's value (3 and 23 over 2 microbatches), averaged over the
    # replicas (upstream's DP average); a reduce group with DP adds the replicas' shares.
    for logged in run_on_ranks(2, _log_upstream_style_saves, 1):
        expected = {"share_loss": 6.5, "averaged_loss": 6.5, "global_loss": 13.0}
        assert logged == pytest.approx({**expected, **{f"{name}_layer_1": value for name, value in expected.items()}})
