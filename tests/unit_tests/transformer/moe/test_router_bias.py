"""The router bias (`--moe-router-bias`, gpt-oss): logits x W^T + b and their gradients against the formula, zeros
at initialisation, apart from the aux-loss-free expert bias, only where asked for (bias-linear MoE models keep
their routers), and training at EP2 under the distributed optimizer, Megatron-FSDP and FSDP2, and at TP2 with
sequence parallelism, as at EP1; a checkpoint saved at EP2 loads at EP1 with the same biases."""

import pytest
import torch

from megatron.core.transformer.moe.router import TopKRouter, update_expert_biases
from megatron.core.transformer.transformer_config import TransformerConfig
from tests.unit_tests.multiprocess_harness import run_on_ranks

NUM_EXPERTS, TOPK, HIDDEN, TOKENS = 4, 2, 8, 6


def _router(**overrides):
    fields = dict(num_layers=2, hidden_size=HIDDEN, num_attention_heads=2, num_moe_experts=NUM_EXPERTS,
                  moe_router_topk=TOPK, init_seed=3)
    return TopKRouter(TransformerConfig(**{**fields, **overrides}))


def test_logits_are_xw_plus_b_with_their_gradients():
    router = _router(moe_router_bias=True)
    assert router.bias.shape == (NUM_EXPERTS,) and not torch.count_nonzero(router.bias)  # zeros at first
    with torch.no_grad():
        router.bias.copy_(torch.tensor([0.9, -0.4, 0.0, 0.3]))
    hidden = torch.randn(TOKENS, 1, HIDDEN, generator=torch.Generator().manual_seed(0))
    upstream = torch.randn(TOKENS, NUM_EXPERTS, generator=torch.Generator().manual_seed(1))
    probs, routing_map = router(hidden)
    (probs * upstream).sum().backward()

    weight = router.weight.detach().clone().requires_grad_()
    bias = router.bias.detach().clone().requires_grad_()
    logits = hidden.reshape(TOKENS, HIDDEN) @ weight.t() + bias
    top = logits.topk(TOPK, dim=-1)
    expected = torch.zeros_like(logits).scatter(1, top.indices, torch.softmax(top.values, dim=-1))
    (expected * upstream).sum().backward()
    torch.testing.assert_close(probs, expected.detach())
    assert torch.equal(routing_map, expected.detach() > 0)
    torch.testing.assert_close(router.bias.grad, bias.grad)
    torch.testing.assert_close(router.weight.grad, weight.grad)
    assert bias.grad.abs().max() > 1e-3
    # The same weights without the bias choose otherwise: the bias is in the logits.
    unbiased = hidden.reshape(TOKENS, HIDDEN) @ weight.detach().t()
    assert not torch.equal(unbiased.topk(TOPK, dim=-1).indices.sort().values, top.indices.sort().values)


def test_bias_is_asked_for_and_apart_from_the_expert_bias():
    plain = _router()  # add_bias_linear (the default) alone gives no router bias: existing checkpoints load
    assert plain.bias is None and "bias" not in plain.state_dict()
    router = _router(moe_router_bias=True, moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True)
    assert {"weight", "bias", "expert_bias"} <= set(router.state_dict())
    assert [name for name, _ in router.named_parameters()] == ["weight", "bias"]
    with torch.no_grad():
        router.bias.fill_(0.5)
    router(torch.randn(TOKENS, 1, HIDDEN, generator=torch.Generator().manual_seed(0)))
    update_expert_biases([router])
    assert torch.count_nonzero(router.expert_bias) and torch.equal(router.bias, torch.full((NUM_EXPERTS,), 0.5))
    with pytest.raises(ValueError, match="--moe-router-bias .* drop --disable-bias-linear or drop --moe-router-bias"):
        _router(moe_router_bias=True, add_bias_linear=False)
    with pytest.raises(ValueError, match="--moe-router-bias needs --num-experts"):
        TransformerConfig(num_layers=2, hidden_size=HIDDEN, num_attention_heads=2, moe_router_bias=True)


MOE = ("--num-experts 4 --moe-router-topk 2 --moe-ffn-hidden-size 24 --train-iters 3 --lr-decay-iters 3 --lr 0.05 "
       "--min-lr 0.005")


def _train(workdir, extra):
    from tests.unit_tests.dist_checkpointing.pretrain_helpers import run_pretrain

    return run_pretrain(workdir, f"{MOE} {extra}")


# Layouts of two ranks that must train as EP1 over two data-parallel ranks under Megatron DDP.
LAYOUTS = ("--expert-model-parallel-size 2 --use-distributed-optimizer",
           "--expert-model-parallel-size 2 --use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params",
           "--expert-model-parallel-size 2 --use-torch-fsdp2",
           "--tensor-model-parallel-size 2 --sequence-parallel")


@pytest.mark.world_size(2)
def test_ep2_tp2_and_every_wrapper_train_as_ep1(tmp_path):
    ep1 = run_on_ranks(2, _train, str(tmp_path), "--moe-router-bias")[0]
    unbiased = run_on_ranks(2, _train, str(tmp_path), "")[0]
    assert sorted(ep1) == [1, 2, 3]
    assert ep1[1] == pytest.approx(unbiased[1], rel=1e-6)  # zeros at first: the same first step
    assert abs(ep1[3] - unbiased[3]) > 1e-4  # then the biases train (measured: 6e-4 apart)
    for layout in LAYOUTS:
        losses = run_on_ranks(2, _train, str(tmp_path), f"--moe-router-bias {layout}")[0]
        for iteration in ep1:
            assert losses[iteration] == pytest.approx(ep1[iteration], rel=0, abs=5e-6), layout


def _save_or_load(root, ep, save):
    from megatron.core.transformer.moe.router import routers_of
    from megatron.training import checkpointing
    from tests.unit_tests.dist_checkpointing.pretrain_helpers import TrainingState

    state = TrainingState(f"{MOE} --moe-router-bias --expert-model-parallel-size {ep} --ckpt-format torch_dist "
                          + (f"--save {root}" if save else f"--load {root} --finetune"))
    try:
        routers = routers_of(state.model)
        if save:
            with torch.no_grad():
                for index, router in enumerate(routers):
                    router.bias.copy_(torch.arange(NUM_EXPERTS, dtype=torch.float32) + 10 * index)
            checkpointing.save_checkpoint(1, state.model, state.optimizer, state.scheduler, state.args)
        else:
            checkpointing.load_checkpoint(state.model, state.optimizer, state.scheduler, state.args)
        return [router.bias.detach().clone() for router in routers]
    finally:
        state.close()


@pytest.mark.world_size(2)
def test_checkpoint_saved_at_ep2_loads_at_ep1(tmp_path):
    saved = run_on_ranks(2, _save_or_load, str(tmp_path), 2, True)
    loaded = run_on_ranks(2, _save_or_load, str(tmp_path), 1, False)
    assert len(saved[0]) == 4  # one router a layer
    for rank in range(2):
        for before, after in zip(saved[0], loaded[rank]):
            assert torch.equal(before, after)
    assert torch.equal(loaded[1][3], torch.tensor([30.0, 31.0, 32.0, 33.0]))
