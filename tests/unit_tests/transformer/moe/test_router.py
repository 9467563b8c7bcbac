"""`TopKRouter`: the auxiliary losses' values (as logged) and gradients against their formulas written here (also
`global_aux_loss` over microbatches and over two data-parallel ranks, and several losses listed together), the
expert-bias update against a hand-counted case, router dtype, Sinkhorn balancing, and a recomputed forward."""

import pytest
import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.transformer.moe import moe_utils
from megatron.core.transformer.moe.router import TopKRouter, reset_global_aux_loss_counts, update_expert_biases
from megatron.core.transformer.recompute import checkpointed, is_recomputing
from megatron.core.transformer.transformer_config import TransformerConfig
from tests.unit_tests.multiprocess_harness import run_on_ranks

NUM_EXPERTS, TOPK, HIDDEN, SEQ, BATCH = 4, 2, 8, 5, 3


def router(**overrides):
    fields = dict(num_layers=2, hidden_size=HIDDEN, num_attention_heads=2, num_moe_experts=NUM_EXPERTS,
                  moe_router_topk=TOPK, init_seed=3)
    fields.update(overrides)
    return TopKRouter(TransformerConfig(**fields), layer_number=2)


@pytest.fixture(autouse=True)
def clean_state():
    moe_utils.clear_aux_losses_tracker()
    moe_utils.MoEAuxLossAutoScaler.backward_scale = None
    yield
    moe_utils.clear_aux_losses_tracker()
    moe_utils.MoEAuxLossAutoScaler.backward_scale = None


def _switch_loss(logits, coeff):
    scores = torch.softmax(logits, dim=-1)
    counts = torch.zeros_like(scores).scatter(1, scores.topk(TOPK, dim=-1).indices, 1.0).sum(dim=0)
    tokens = logits.size(0)
    return coeff * NUM_EXPERTS / (TOPK * tokens**2) * (counts * scores.sum(dim=0)).sum()


def _seq_loss(logits, coeff):
    scores = torch.softmax(logits, dim=-1).view(SEQ, BATCH, NUM_EXPERTS)
    chosen = torch.zeros_like(scores).scatter(2, scores.topk(TOPK, dim=-1).indices, 1.0)
    per_sequence = [(chosen[:, b].sum(0) * scores[:, b].sum(0)).sum() * NUM_EXPERTS / (TOPK * SEQ**2)
                    for b in range(BATCH)]
    return coeff * torch.stack(per_sequence).mean()


def _z_loss(logits, coeff):
    return coeff * (torch.logsumexp(logits, dim=-1) ** 2).mean()


@pytest.mark.parametrize("kind, formula, name", [
    ("aux_loss", _switch_loss, "load_balancing_loss"),
    ("seq_aux_loss", _seq_loss, "seq_load_balancing_loss"),
])
@pytest.mark.parametrize("backward_scale", [None, 0.25])
def test_load_balancing_and_z_loss_value_and_gradient(kind, formula, name, backward_scale):
    coeff, z_coeff = 0.3, 0.02
    module = router(moe_router_load_balancing_type=kind, moe_aux_loss_coeff=coeff, moe_z_loss_coeff=z_coeff)
    if backward_scale is not None:
        moe_utils.MoEAuxLossAutoScaler.set_loss_scale(backward_scale)
    hidden = torch.randn(SEQ, BATCH, HIDDEN, generator=torch.Generator().manual_seed(0))
    upstream = torch.randn(SEQ * BATCH, NUM_EXPERTS, generator=torch.Generator().manual_seed(1))
    probs, _ = module(hidden)
    (probs * upstream).sum().backward()

    weight = module.weight.detach().clone().requires_grad_()
    logits = hidden.reshape(-1, HIDDEN) @ weight.t()
    reference_probs = torch.zeros_like(logits)
    top = logits.topk(TOPK, dim=-1)
    reference_probs = reference_probs.scatter(1, top.indices, torch.softmax(top.values, dim=-1))
    aux, z = formula(logits, coeff), _z_loss(logits, z_coeff)
    scale = 1.0 if backward_scale is None else backward_scale
    ((reference_probs * upstream).sum() + scale * (aux + z)).backward()
    torch.testing.assert_close(module.weight.grad, weight.grad, rtol=1e-5, atol=1e-7)

    logged = moe_utils.reduce_aux_losses_for_logging([name, "z_loss"], num_layers=2, num_moe_layers=1,
                                                     num_microbatches=1, data_parallel_size=1, device="cpu")
    assert logged[name] == pytest.approx((aux / coeff).item(), rel=1e-6)
    assert logged["z_loss"] == pytest.approx((z / z_coeff).item(), rel=1e-6)


def test_sqrtsoftplus_router_and_its_aux_loss():
    """Probabilities: the chosen sqrt(softplus) scores over their sum; the aux loss on those scores normalised over
    all experts (with their own top-k counts)."""
    coeff = 0.3
    module = router(moe_router_score_function="sqrtsoftplus", moe_aux_loss_coeff=coeff)
    hidden = torch.randn(SEQ, BATCH, HIDDEN, generator=torch.Generator().manual_seed(13))
    upstream = torch.randn(SEQ * BATCH, NUM_EXPERTS, generator=torch.Generator().manual_seed(14))
    probs, _ = module(hidden)
    (probs * upstream).sum().backward()

    weight = module.weight.detach().clone().requires_grad_()
    scores = torch.sqrt(torch.log1p(torch.exp(hidden.reshape(-1, HIDDEN) @ weight.t())))
    top = scores.topk(TOPK, dim=-1)
    reference_probs = torch.zeros_like(scores).scatter(1, top.indices, top.values / top.values.sum(-1, keepdim=True))
    normalised = scores / scores.sum(dim=-1, keepdim=True)
    counts = torch.zeros_like(scores).scatter(1, normalised.topk(TOPK, dim=-1).indices, 1.0).sum(dim=0)
    aux = coeff * NUM_EXPERTS / (TOPK * scores.size(0) ** 2) * (counts * normalised.sum(dim=0)).sum()
    torch.testing.assert_close(probs, reference_probs.detach(), rtol=1e-6, atol=1e-7)
    ((reference_probs * upstream).sum() + aux).backward()
    torch.testing.assert_close(module.weight.grad, weight.grad, rtol=1e-6, atol=1e-7)
    logged = moe_utils.reduce_aux_losses_for_logging(["load_balancing_loss"], 2, 1, 1, 1, "cpu")
    assert logged["load_balancing_loss"] == pytest.approx((aux / coeff).item(), rel=1e-6)


def test_no_aux_loss_in_evaluation():
    module = router(moe_aux_loss_coeff=0.1, moe_z_loss_coeff=0.1)
    with torch.no_grad():
        module(torch.randn(SEQ, BATCH, HIDDEN))
    assert moe_utils.reduce_aux_losses_for_logging(["load_balancing_loss", "z_loss"], 2, 1, 1, 1, "cpu") == {
        "load_balancing_loss": 0.0, "z_loss": 0.0}


def test_router_dtype():
    module = router(moe_router_dtype="fp64")
    probs, _ = module(torch.randn(SEQ, BATCH, HIDDEN))
    assert probs.dtype == torch.float64 and module.weight.dtype == torch.float32


@pytest.mark.parametrize("score_function", ["sigmoid", "sqrtsoftplus"])
def test_pre_softmax_leaves_sigmoid_routing_unchanged(score_function):
    """DeepSeek-V3 recipes pass --moe-router-pre-softmax with sigmoid scores; upstream accepts it and routes as
    without it (sigmoid scores are always taken before the top-k)."""
    hidden = torch.randn(SEQ, BATCH, HIDDEN, generator=torch.Generator().manual_seed(6))
    fields = dict(moe_router_score_function=score_function, moe_router_topk_scaling_factor=2.5)
    plain, with_flag = router(**fields), router(moe_router_pre_softmax=True, **fields)
    probs, routing_map = with_flag(hidden)
    scores = torch.sigmoid(hidden.reshape(-1, HIDDEN) @ plain.weight.detach().t())
    if score_function == "sqrtsoftplus":
        scores = torch.sqrt(torch.nn.functional.softplus(hidden.reshape(-1, HIDDEN) @ plain.weight.detach().t()))
    chosen = scores.topk(TOPK, dim=-1)
    expected = torch.zeros_like(scores).scatter(1, chosen.indices, 2.5 * chosen.values / chosen.values.sum(-1, True))
    torch.testing.assert_close(probs.detach(), expected)
    assert routing_map.tolist() == plain(hidden)[1].tolist()


def _one_hot_router(rate=0.1):
    module = router(num_moe_experts=4, moe_router_topk=1, hidden_size=4, moe_router_score_function="sigmoid",
                    moe_router_enable_expert_bias=True, moe_router_bias_update_rate=rate)
    with torch.no_grad():
        module.weight.copy_(10.0 * torch.eye(4))
    return module


def test_expert_bias_update_against_hand_counts():
    module = _one_hot_router(rate=0.1)
    experts = torch.tensor([0, 0, 0, 1, 2, 2, 3, 3])  # counts 3, 1, 2, 2 (mean 2)
    tokens = torch.eye(4)[experts].view(8, 1, 4).requires_grad_()
    _, routing_map = module(tokens)
    assert routing_map.nonzero()[:, 1].tolist() == experts.tolist()
    assert module.local_tokens_per_expert.tolist() == [3.0, 1.0, 2.0, 2.0]
    update_expert_biases([module])
    torch.testing.assert_close(module.expert_bias, torch.tensor([-0.1, 0.1, 0.0, 0.0]))
    assert module.local_tokens_per_expert.tolist() == [0.0] * 4
    assert "expert_bias" in module.state_dict() and "local_tokens_per_expert" not in module.state_dict()
    # The bias changes the choice, not the probabilities: sigmoid(10) for expert 0 loses to 0.5 + 5.6.
    with torch.no_grad():
        module.expert_bias.copy_(torch.tensor([0.0, 5.6, 0.0, 0.0]))
    probs, routing_map = module(torch.eye(4)[:1].view(1, 1, 4))
    assert routing_map[0].tolist() == [False, True, False, False]
    assert probs[0, 1].item() == pytest.approx(0.5)


def test_expert_bias_buffers_stay_fp32_when_the_model_is_cast_to_bf16():
    """As upstream: a bf16 cast (`Float16Module`, `.bfloat16()`) keeps the expert bias and its counts in fp32,
    where an update of 1e-3 to a bias of 0.5 and a count of 1000 + 1 are exact."""
    from megatron.core.transformer.module import Float16Module

    module = router(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True, bf16=True,
                    params_dtype=torch.bfloat16)
    with torch.no_grad():
        module.expert_bias.fill_(0.5)
    model = Float16Module(module.config, torch.nn.Sequential(module))
    assert module.weight.dtype == torch.bfloat16
    assert module.expert_bias.dtype == module.local_tokens_per_expert.dtype == torch.float32
    module.local_tokens_per_expert.copy_(torch.tensor([1000.0, 1.0, 1.0, 1.0]))
    module.local_tokens_per_expert += 1.0
    assert module.local_tokens_per_expert.tolist() == [1001.0, 2.0, 2.0, 2.0]
    update_expert_biases([model])
    torch.testing.assert_close(module.expert_bias, torch.tensor([0.499, 0.501, 0.501, 0.501]), rtol=0, atol=1e-7)
    model.bfloat16()
    assert module.expert_bias.dtype == torch.float32 and module.expert_bias[1].item() == pytest.approx(0.501)


def test_upstream_constructor_refuses_a_process_group_collection():
    with pytest.raises(ValueError, match="pg_collection"):
        TopKRouter(router().config, object())


def test_gating_gives_the_logits_in_the_router_dtype():
    module = router(moe_router_dtype="fp64")
    hidden = torch.randn(SEQ, BATCH, HIDDEN)
    logits = module.gating(hidden)
    assert logits.dtype == torch.float64 and logits.shape == (SEQ, BATCH, NUM_EXPERTS)
    torch.testing.assert_close(logits, hidden.double() @ module.weight.double().t())


def test_sinkhorn_balances_rows_and_columns():
    cost = torch.randn(12, 4, generator=torch.Generator().manual_seed(2))
    balanced = moe_utils.sinkhorn(cost, tol=1e-9)
    torch.testing.assert_close(balanced.sum(dim=0), torch.full((4,), 1 / 4), rtol=1e-4, atol=0)
    torch.testing.assert_close(balanced.sum(dim=1), torch.full((12,), 1 / 12), rtol=1e-4, atol=0)
    module = router(moe_router_load_balancing_type="sinkhorn", moe_router_topk=1)
    hidden = torch.randn(SEQ, BATCH, HIDDEN, generator=torch.Generator().manual_seed(4))
    probs, routing_map = module(hidden)
    logits = hidden.reshape(-1, HIDDEN) @ module.weight.detach().t()
    chosen = moe_utils.sinkhorn(logits).argmax(dim=-1)
    assert routing_map.float().argmax(dim=-1).tolist() == chosen.tolist()
    torch.testing.assert_close(probs.sum(dim=-1), torch.sigmoid(logits).gather(1, chosen[:, None])[:, 0])


def test_recomputed_forward_logs_and_counts_once():
    """Under activation recompute the router's forward runs again in backward; the logged losses and the
    expert-bias token counts must still be those of one forward."""
    coeff, z_coeff = 0.3, 0.02
    module = router(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                    moe_aux_loss_coeff=coeff, moe_z_loss_coeff=z_coeff)
    hidden = torch.randn(SEQ, BATCH, HIDDEN, generator=torch.Generator().manual_seed(5))
    names = ["load_balancing_loss", "z_loss"]

    def router_then_more(tokens):
        # Work after the router that saves tensors for backward, so the recompute runs the whole router.
        return torch.exp(module(tokens)[0])

    router_then_more(hidden.clone().requires_grad_()).sum().backward()
    plain_counts = module.local_tokens_per_expert.clone()
    plain_logged = moe_utils.reduce_aux_losses_for_logging(names, 2, 1, 1, 1, "cpu")
    plain_grad = module.weight.grad.clone()
    assert plain_counts.sum().item() == SEQ * BATCH * TOPK
    assert plain_logged["load_balancing_loss"] > 0 and plain_logged["z_loss"] > 0

    module.weight.grad = None
    module.local_tokens_per_expert.zero_()
    checkpointed(router_then_more, hidden.clone().requires_grad_()).sum().backward()
    recomputed_logged = moe_utils.reduce_aux_losses_for_logging(names, 2, 1, 1, 1, "cpu")
    assert module.local_tokens_per_expert.tolist() == plain_counts.tolist()
    for name in names:
        assert recomputed_logged[name] == pytest.approx(plain_logged[name], rel=1e-6)
    torch.testing.assert_close(module.weight.grad, plain_grad)
    assert not is_recomputing()


def test_no_load_balancing_loss_with_type_none():
    """`--moe-router-load-balancing-type none` takes no auxiliary loss whatever `--moe-aux-loss-coeff` says."""
    hidden = torch.randn(SEQ, BATCH, HIDDEN, generator=torch.Generator().manual_seed(6))
    upstream = torch.randn(SEQ * BATCH, NUM_EXPERTS, generator=torch.Generator().manual_seed(7))
    grads = []
    for coeff in (0.0, 0.5):
        module = router(moe_router_load_balancing_type="none", moe_aux_loss_coeff=coeff)
        probs, _ = module(hidden)
        (probs * upstream).sum().backward()
        grads.append(module.weight.grad)
    assert grads[0].abs().sum() > 0
    torch.testing.assert_close(grads[1], grads[0], rtol=0, atol=0)
    assert moe_utils._tracked == {}


# -------------------------------------------------------------------------------------------------------------
# global_aux_loss and listed losses
# -------------------------------------------------------------------------------------------------------------


def _topk_counts(logits):
    scores = torch.softmax(logits, dim=-1)
    return torch.zeros_like(scores).scatter(1, scores.topk(TOPK, dim=-1).indices, 1.0).sum(dim=0)


def _softmax_topk_probs(logits):
    top = logits.topk(TOPK, dim=-1)
    return torch.zeros_like(logits).scatter(1, top.indices, torch.softmax(top.values, dim=-1))


def _global_loss(logits, average_counts, coeff, group_size=1):
    """This rank's share: coeff * E / (k * T^2) * sum_i avg_c_i * sum_{x local} s_{x,i}, T = local tokens x the
    TP x DP x CP size."""
    tokens = logits.size(0) * group_size
    scores = torch.softmax(logits, dim=-1)
    return coeff * NUM_EXPERTS / (TOPK * tokens**2) * (average_counts * scores.sum(dim=0)).sum()


def test_global_aux_loss_averages_counts_over_microbatches_until_reset():
    coeff = 0.3
    module = router(moe_router_load_balancing_type="global_aux_loss", moe_aux_loss_coeff=coeff)
    generator = torch.Generator().manual_seed(8)
    batches = [torch.randn(SEQ, BATCH, HIDDEN, generator=generator) for _ in range(3)]
    upstream = torch.randn(SEQ * BATCH, NUM_EXPERTS, generator=generator)
    weight = module.weight.detach().clone()
    counts = [_topk_counts(hidden.reshape(-1, HIDDEN) @ weight.t()) for hidden in batches]
    assert not torch.equal(counts[0], counts[1])
    # Microbatches 1 and 2 of a global batch; after the reset, microbatch 3 opens the next global batch.
    averages = [counts[0], (counts[0] + counts[1]) / 2, counts[2]]
    losses = []
    for microbatch, (hidden, average) in enumerate(zip(batches, averages)):
        if microbatch == 2:
            reset_global_aux_loss_counts([module])
        module.weight.grad = None
        probs, _ = module(hidden)
        (probs * upstream).sum().backward()
        reference_weight = weight.clone().requires_grad_()
        logits = hidden.reshape(-1, HIDDEN) @ reference_weight.t()
        loss = _global_loss(logits, average, coeff)
        ((_softmax_topk_probs(logits) * upstream).sum() + loss).backward()
        torch.testing.assert_close(module.weight.grad, reference_weight.grad, rtol=1e-6, atol=1e-7)
        losses.append(loss.item())
    assert module.global_aux_microbatches == 1
    assert module.global_tokens_per_expert.tolist() == counts[2].tolist()
    logged = moe_utils.reduce_aux_losses_for_logging(["global_load_balancing_loss"], num_layers=2, num_moe_layers=1,
                                                     num_microbatches=3, data_parallel_size=1, device="cpu")
    assert logged["global_load_balancing_loss"] == pytest.approx(sum(losses) / coeff / 3, rel=1e-6)


def test_global_aux_loss_recomputed_forward_uses_its_own_average():
    """Both microbatches' forwards run before their backwards (as under pipelining), the router recomputed in
    backward: each recomputed forward must use the average count of its original forward."""
    generator = torch.Generator().manual_seed(10)
    batches = [torch.randn(SEQ, BATCH, HIDDEN, generator=generator) for _ in range(2)]

    def run(recompute):
        module = router(moe_router_load_balancing_type="global_aux_loss", moe_aux_loss_coeff=0.3)

        def router_then_more(tokens):
            return torch.exp(module(tokens)[0])

        outputs = [checkpointed(router_then_more, hidden.clone().requires_grad_()) if recompute
                   else router_then_more(hidden.clone().requires_grad_()) for hidden in batches]
        grads = []
        for output in outputs:
            module.weight.grad = None
            output.sum().backward()
            grads.append(module.weight.grad.clone())
        return module, grads

    plain, plain_grads = run(recompute=False)
    recomputed, recomputed_grads = run(recompute=True)
    weight = plain.weight.detach()
    assert not torch.equal(*[_topk_counts(hidden.reshape(-1, HIDDEN) @ weight.t()) for hidden in batches])
    assert recomputed.global_aux_microbatches == plain.global_aux_microbatches == 2
    assert torch.equal(recomputed.global_tokens_per_expert, plain.global_tokens_per_expert)
    for recomputed_grad, plain_grad in zip(recomputed_grads, plain_grads):
        torch.testing.assert_close(recomputed_grad, plain_grad, rtol=1e-6, atol=1e-7)


def _global_aux_loss_over_two_data_parallel_ranks():
    """Two microbatches on each of two data-parallel ranks. Returns the largest gradient difference from the
    formula, the logged loss and the loss of the formula (both ranks' shares, averaged over the microbatches)."""
    rank = dist.get_rank()
    moe_utils.clear_aux_losses_tracker()
    moe_utils.MoEAuxLossAutoScaler.backward_scale = None
    parallel_state.initialize_model_parallel()  # TP 1, DP 2
    coeff = 0.3
    module = router(moe_router_load_balancing_type="global_aux_loss", moe_aux_loss_coeff=coeff)
    generator = torch.Generator().manual_seed(9)
    batches = [[torch.randn(SEQ, BATCH, HIDDEN, generator=generator) for _ in range(2)] for _ in range(2)]
    upstream = torch.randn(SEQ * BATCH, NUM_EXPERTS, generator=generator)
    weight = module.weight.detach().clone()
    running, worst, global_losses = torch.zeros(NUM_EXPERTS), 0.0, []
    for microbatch, per_rank in enumerate(batches):  # per_rank[r]: rank r's tokens
        running += sum(_topk_counts(hidden.reshape(-1, HIDDEN) @ weight.t()) for hidden in per_rank)
        average = running / (microbatch + 1)
        module.weight.grad = None
        probs, _ = module(per_rank[rank])
        (probs * upstream).sum().backward()
        reference_weight = weight.clone().requires_grad_()
        logits = [hidden.reshape(-1, HIDDEN) @ reference_weight.t() for hidden in per_rank]
        share = _global_loss(logits[rank], average, coeff, group_size=2)
        ((_softmax_topk_probs(logits[rank]) * upstream).sum() + share).backward()
        worst = max(worst, (module.weight.grad - reference_weight.grad).abs().max().item())
        global_losses.append(sum(_global_loss(rank_logits, average, coeff, group_size=2).item()
                                 for rank_logits in logits))
    logged = moe_utils.reduce_aux_losses_for_logging(["global_load_balancing_loss"], num_layers=2, num_moe_layers=1,
                                                     num_microbatches=2, data_parallel_size=2, device="cpu")
    parallel_state.destroy_model_parallel()
    return worst, logged["global_load_balancing_loss"], sum(global_losses) / coeff / 2


def test_global_aux_loss_counts_over_data_parallel_ranks():
    for worst, logged, expected in run_on_ranks(2, _global_aux_loss_over_two_data_parallel_ranks):
        assert worst < 1e-6
        assert logged == pytest.approx(expected, rel=1e-6)


def test_listed_losses_add_up_with_their_own_coefficients():
    """seq_aux_loss and global_aux_loss listed together (coefficients 0.2 and 0.5) give the sum of the gradients
    of the single-loss runs, and log what each of them logs."""
    hidden = torch.randn(SEQ, BATCH, HIDDEN, generator=torch.Generator().manual_seed(11))
    upstream = torch.randn(SEQ * BATCH, NUM_EXPERTS, generator=torch.Generator().manual_seed(12))
    names = ["seq_load_balancing_loss", "global_load_balancing_loss"]

    def run(kind, coeff):
        module = router(moe_router_load_balancing_type=kind, moe_aux_loss_coeff=coeff)
        probs, _ = module(hidden)
        (probs * upstream).sum().backward()
        return module.weight.grad, moe_utils.reduce_aux_losses_for_logging(names, 2, 1, 1, 1, "cpu")

    both, both_logged = run(["seq_aux_loss", "global_aux_loss"], [0.2, 0.5])
    seq, seq_logged = run("seq_aux_loss", 0.2)
    glob, glob_logged = run("global_aux_loss", 0.5)
    without, _ = run("none", 0.0)
    assert min((seq - without).abs().max(), (glob - without).abs().max()) > 1e-4  # each loss matters
    torch.testing.assert_close(both + without, seq + glob, rtol=1e-6, atol=1e-7)
    assert both_logged == pytest.approx({names[0]: seq_logged[names[0]], names[1]: glob_logged[names[1]]}, rel=1e-6)
    assert seq_logged[names[1]] == 0.0 and glob_logged[names[0]] == 0.0


def _losses_logged_over_two_tensor_parallel_ranks():
    """Each of two TP ranks routes half of the sequence (sequence parallel). Returns the logged losses and the
    single-rank formulas' values on the whole sequence."""
    rank = dist.get_rank()
    moe_utils.clear_aux_losses_tracker()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    coeff, z_coeff = 0.3, 0.02
    module = router(moe_aux_loss_coeff=coeff, moe_z_loss_coeff=z_coeff, tensor_model_parallel_size=2,
                    sequence_parallel=True)
    hidden = torch.randn(2 * SEQ, BATCH, HIDDEN, generator=torch.Generator().manual_seed(4))
    module(hidden[rank * SEQ:(rank + 1) * SEQ])
    logged = moe_utils.reduce_aux_losses_for_logging(["load_balancing_loss", "z_loss"], num_layers=2,
                                                     num_moe_layers=1, num_microbatches=1, data_parallel_size=1,
                                                     device="cpu")
    parallel_state.destroy_model_parallel()
    logits = hidden.reshape(-1, HIDDEN) @ module.weight.detach().t()
    return logged, (_switch_loss(logits, coeff) / coeff).item(), (_z_loss(logits, z_coeff) / z_coeff).item()


def test_tensor_parallel_ranks_log_the_whole_sequence_losses():
    for logged, aux, z in run_on_ranks(2, _losses_logged_over_two_tensor_parallel_ranks):
        assert logged == pytest.approx({"load_balancing_loss": aux, "z_loss": z}, rel=1e-6)
