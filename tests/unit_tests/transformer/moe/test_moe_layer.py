"""`MoELayer` against a reference built here from its own router and experts (sum over the chosen experts of
probability x expert MLP), with shared experts (also gated) and capacity dropping; and on two ranks, EP=2 and TP=2
with sequence parallelism against the single-rank layer (outputs and every gradient within 1e-5), with each
dispatcher, and the gated shared experts under TP=2; at TP=2 without sequence parallelism (generation) the eval-mode
layer against the single-rank one, and its refusal to train."""

import pytest
import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.distributed.finalize_model_grads import _allreduce_sequence_parallel_grads
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.router import update_expert_biases
from megatron.core.transformer.transformer_config import TransformerConfig
from tests.unit_tests.multiprocess_harness import run_on_ranks

HIDDEN, SEQ, BATCH, LAYER_SEED = 16, 8, 2, 21
DISPATCHERS = ("allgather", "alltoall")


def moe_config(**overrides):
    fields = dict(num_layers=2, hidden_size=HIDDEN, num_attention_heads=2, num_moe_experts=4, moe_router_topk=2,
                  moe_ffn_hidden_size=24, init_seed=5, hidden_dropout=0.0, attention_dropout=0.0)
    fields.update(overrides)
    return TransformerConfig(**fields)


def _inputs():
    generator = torch.Generator().manual_seed(0)
    return torch.randn(SEQ, BATCH, HIDDEN, generator=generator), torch.randn(SEQ, BATCH, HIDDEN, generator=generator)


def _hand_built(layer, hidden, include_shared=True):
    """sum_e p[t, e] * expert_e(x_t) with the experts' own MLP forward, plus the shared experts."""
    with torch.no_grad():
        probs, routing_map = layer.router(hidden)
        tokens = hidden.reshape(-1, HIDDEN)
        output = torch.zeros_like(tokens)
        for token, expert in routing_map.nonzero().tolist():
            expert_output, expert_bias = layer.experts.local_experts[expert](tokens[token:token + 1])
            output[token] += probs[token, expert] * (expert_output + expert_bias)[0]
        output = output.view_as(hidden)
        if layer.shared_experts is not None and include_shared:
            output = output + layer.shared_experts(hidden)
    return output, routing_map


@pytest.mark.parametrize("dispatcher", DISPATCHERS)
@pytest.mark.parametrize("extra", [{}, {"moe_shared_expert_intermediate_size": 32, "moe_grouped_gemm": True},
                                   {"moe_router_score_function": "sigmoid", "moe_router_dtype": "fp64"}])
def test_layer_equals_hand_built_reference(dispatcher, extra):
    layer = MoELayer(moe_config(moe_token_dispatcher_type=dispatcher, **extra), layer_number=1, init_seed=LAYER_SEED)
    hidden, _ = _inputs()
    expected, _ = _hand_built(layer, hidden)
    torch.testing.assert_close(layer(hidden)[0], expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dispatcher", DISPATCHERS)
def test_dispatcher_keeps_no_routing_after_combining(dispatcher):
    """The routing of a forward (probabilities tied to its autograd graph, index tensors) is dropped once the
    tokens are combined: a second forward gives the same output, and none of it outlives the first."""
    layer = MoELayer(moe_config(moe_token_dispatcher_type=dispatcher), layer_number=1, init_seed=LAYER_SEED)
    hidden, _ = _inputs()
    first, _ = layer(hidden.requires_grad_())
    kept = set(layer.token_dispatcher.ROUTING_STATE) & set(vars(layer.token_dispatcher))
    assert not kept, f"routing state kept after combine: {sorted(kept)}"
    first.sum().backward()
    torch.testing.assert_close(layer(hidden)[0], first, rtol=0, atol=0)


def test_shared_expert_overlap_gives_the_same_result():
    common = dict(moe_token_dispatcher_type="alltoall", moe_shared_expert_intermediate_size=32)
    plain = MoELayer(moe_config(**common), init_seed=LAYER_SEED)
    overlapped = MoELayer(moe_config(moe_shared_expert_overlap=True, **common), init_seed=LAYER_SEED)
    hidden, _ = _inputs()
    assert torch.equal(plain(hidden)[0], overlapped(hidden)[0])


def test_shared_expert_gate_scales_the_shared_output():
    """output = routed + sigmoid(x . w) * shared MLP(x), w `[1, hidden]`; its gradient by the same formula."""
    gated = dict(moe_shared_expert_intermediate_size=32, moe_shared_expert_gate=True)
    layer = MoELayer(moe_config(**gated), init_seed=LAYER_SEED)
    shared = layer.shared_experts
    assert shared.gate_weight.shape == (1, HIDDEN) and shared.gate_weight.abs().sum() > 0
    assert "shared_experts.gate_weight" in dict(layer.named_parameters())
    assert "shared_experts.gate_weight" not in dict(MoELayer(moe_config(moe_shared_expert_intermediate_size=32),
                                                            init_seed=LAYER_SEED).named_parameters())
    hidden, upstream = _inputs()
    output, _ = layer(hidden)
    (output * upstream).sum().backward()

    gate_weight = shared.gate_weight.detach().clone().requires_grad_()
    routed, _ = _hand_built(layer, hidden, include_shared=False)
    with torch.no_grad():
        ungated, shared_bias = MLP.forward(shared, hidden)
        ungated = ungated + shared_bias
    gate = torch.sigmoid((hidden * gate_weight[0]).sum(dim=-1, keepdim=True))
    expected = routed + gate * ungated
    torch.testing.assert_close(output, expected, rtol=1e-6, atol=1e-6)
    (expected * upstream).sum().backward()
    torch.testing.assert_close(shared.gate_weight.grad, gate_weight.grad, rtol=1e-6, atol=1e-6)


def test_bad_input_names_the_tensor():
    layer = MoELayer(moe_config(), init_seed=LAYER_SEED)
    with pytest.raises(ValueError, match="hidden_states must be"):
        layer(torch.zeros(4, 2, HIDDEN + 1))
    with pytest.raises(ValueError, match="--num-experts"):
        MoELayer(TransformerConfig(num_layers=2, hidden_size=HIDDEN, num_attention_heads=2))


def test_upstream_constructor_arguments_and_layer_number():
    """MoELayer(config, submodules, layer_number) as upstream: the losses are logged under that layer, and under
    the one `set_layer_number` gives; pg_collection is refused by name."""
    from megatron.core.transformer.moe import moe_utils

    layer = MoELayer(moe_config(moe_aux_loss_coeff=0.1), None, 2)
    assert layer.layer_number == 2 and layer.router.layer_number == 2
    hidden, _ = _inputs()
    moe_utils.clear_aux_losses_tracker()  # what earlier tests' training forwards left
    try:
        layer(hidden)[0].sum().backward()
        logged = moe_utils.get_moe_layer_wise_logging_tracker()["load_balancing_loss"]["values"]
        assert logged[1].item() > 0 and logged.count_nonzero().item() == 1
        layer.set_layer_number(1)
        layer(hidden)[0].sum().backward()
        assert logged[0].item() == pytest.approx(logged[1].item())
    finally:
        moe_utils.clear_aux_losses_tracker()
    with pytest.raises(ValueError, match="pg_collection"):
        MoELayer(moe_config(), None, 1, pg_collection=object())


class _NoAttention(torch.nn.Module):
    def forward(self, hidden_states, **kwargs):
        return torch.zeros_like(hidden_states), None  # (output, bias), as the attention returns


@pytest.mark.parametrize("recompute", [False, True])
def test_forward_returns_output_and_mlp_bias_as_upstream(recompute):
    """`output, mlp_bias = moe_layer(hidden)` as upstream (mlp_bias None); the transformer layer adds the output
    to the residual stream, also when it checkpoints the layer."""
    from megatron.core.transformer.transformer_layer import TransformerLayer

    hidden, _ = _inputs()
    config = moe_config(moe_layer_recompute=recompute)
    layer = MoELayer(config, init_seed=LAYER_SEED)
    output, mlp_bias = layer(hidden)
    assert mlp_bias is None
    torch.testing.assert_close(output, _hand_built(layer, hidden)[0], rtol=1e-5, atol=1e-6)
    block = TransformerLayer(config, layer_number=1)
    block.self_attention = _NoAttention()  # the residual stream after attention is the input itself
    with torch.no_grad():
        expected = hidden + block.mlp(block.pre_mlp_layernorm(hidden))[0]
    torch.testing.assert_close(block(hidden.clone().requires_grad_())[0], expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dispatcher", DISPATCHERS)
def test_capacity_drops_tokens(dispatcher):
    # 16 tokens, top-2 of 4 experts, factor 0.5: each expert keeps ceil(16 * 2 / 4 * 0.5) = 4 tokens.
    layer = MoELayer(moe_config(moe_token_dispatcher_type=dispatcher, moe_expert_capacity_factor=0.5),
                     init_seed=LAYER_SEED)
    hidden, _ = _inputs()
    expected, routing_map = _hand_built(layer, hidden)
    assert routing_map.sum(dim=0).tolist() == [4, 4, 4, 4]
    torch.testing.assert_close(layer(hidden)[0], expected, rtol=1e-5, atol=1e-6)


def _run(layer, hidden, upstream):
    hidden = hidden.clone().requires_grad_()
    output, _ = layer(hidden)
    (output * upstream).sum().backward()
    grads = {name: p.grad.detach().clone() for name, p in layer.named_parameters()}
    return output.detach(), hidden.grad, grads


def _expert_key(name, first_global_index):
    """`experts.local_experts.{j}.rest` -> (global index, rest); None for other parameters."""
    if not name.startswith("experts.local_experts."):
        return None
    local, rest = name[len("experts.local_experts."):].split(".", 1)
    return first_global_index + int(local), rest


def _references(hidden, upstream):
    """The EP=1, TP=1 layer over all tokens, per dispatcher."""
    parallel_state.initialize_model_parallel()
    reference = {}
    for dispatcher in DISPATCHERS:
        layer = MoELayer(moe_config(moe_token_dispatcher_type=dispatcher), init_seed=LAYER_SEED)
        reference[dispatcher] = _run(layer, hidden, upstream)
    parallel_state.destroy_model_parallel()
    return reference


def _largest_differences(sizes, local, reference, hidden, upstream):
    """{dispatcher: largest difference of the output, input gradient, router and expert gradients} of the layer
    under `sizes` (this rank's tokens `local(...)`) against `reference`."""
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=sizes.get("tensor_model_parallel_size", 1),
        expert_model_parallel_size=sizes.get("expert_model_parallel_size", 1),
        expert_tensor_parallel_size=sizes.get("expert_tensor_parallel_size"))
    diffs = {}
    for dispatcher in DISPATCHERS:
        layer = MoELayer(moe_config(moe_token_dispatcher_type=dispatcher, **sizes), init_seed=LAYER_SEED)
        output, input_grad, grads = _run(layer, local(hidden), local(upstream))
        ref_output, ref_input_grad, ref_grads = reference[dispatcher]
        worst = max((output - local(ref_output)).abs().max().item(),
                    (input_grad - local(ref_input_grad)).abs().max().item())
        router_grad = grads["router.weight"].clone()
        dist.all_reduce(router_grad)  # each rank routed its own tokens
        worst = max(worst, (router_grad - ref_grads["router.weight"]).abs().max().item())
        tp = parallel_state.get_expert_tensor_parallel_world_size()  # the experts' split
        tp_rank = parallel_state.get_expert_tensor_parallel_rank()
        params = dict(layer.named_parameters())
        for name, grad in grads.items():
            key = _expert_key(name, layer.local_expert_indices[0])
            if key is None:
                continue
            dist.all_reduce(grad, group=parallel_state.get_expert_data_parallel_group())  # replicas' tokens
            ref_grad = ref_grads[f"experts.local_experts.{key[0]}.{key[1]}"]
            if getattr(params[name], "tensor_model_parallel", False) and tp > 1:
                ref_grad = ref_grad.chunk(tp, dim=params[name].partition_dim)[tp_rank]
            worst = max(worst, (grad - ref_grad).abs().max().item())
        diffs[dispatcher] = worst
    parallel_state.destroy_model_parallel()
    return diffs


def _parallel_layers_match_single_rank():
    """On 2 ranks: the EP=1 layer over all tokens, then EP=2 (each rank one sequence) and TP=2 + SP (each rank
    half of every sequence) with each dispatcher. Returns the largest differences."""
    rank = dist.get_rank()
    hidden, upstream = _inputs()
    reference = _references(hidden, upstream)
    diffs = {"dispatchers": (reference["allgather"][0] - reference["alltoall"][0]).abs().max().item()}
    layouts = {"ep2": (dict(expert_model_parallel_size=2), lambda t: t[:, rank:rank + 1]),
               "tp2_sp": (dict(tensor_model_parallel_size=2, sequence_parallel=True),
                          lambda t: t[rank * SEQ // 2:(rank + 1) * SEQ // 2])}
    for layout, (sizes, local) in layouts.items():
        for dispatcher, worst in _largest_differences(sizes, local, reference, hidden, upstream).items():
            diffs[f"{layout}/{dispatcher}"] = worst

    # Shared experts computed while the tokens travel (EP=2, alltoall) against the EP=1 layer with them.
    shared = dict(moe_token_dispatcher_type="alltoall", moe_shared_expert_intermediate_size=32)
    parallel_state.initialize_model_parallel()
    ref_output, ref_input_grad, ref_grads = _run(MoELayer(moe_config(**shared), init_seed=LAYER_SEED), hidden,
                                                 upstream)
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(expert_model_parallel_size=2)
    layer = MoELayer(moe_config(expert_model_parallel_size=2, moe_shared_expert_overlap=True, **shared),
                     init_seed=LAYER_SEED)
    local = layouts["ep2"][1]
    output, input_grad, grads = _run(layer, local(hidden), local(upstream))
    worst = max((output - local(ref_output)).abs().max().item(),
                (input_grad - local(ref_input_grad)).abs().max().item())
    for name, grad in grads.items():
        if name.startswith("shared_experts."):
            dist.all_reduce(grad)
            worst = max(worst, (grad - ref_grads[name]).abs().max().item())
    diffs["ep2/alltoall/shared_overlap"] = worst
    parallel_state.destroy_model_parallel()
    diffs["tp2_sp/shared_gate"] = _gated_shared_experts_under_tensor_parallel(hidden, upstream, layouts["tp2_sp"][1])

    # Expert bias: counts summed over the data-parallel ranks before the update.
    parallel_state.initialize_model_parallel(expert_model_parallel_size=2)
    layer = MoELayer(moe_config(hidden_size=4, num_attention_heads=1, moe_router_topk=1, expert_model_parallel_size=2,
                                moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                                moe_router_bias_update_rate=0.5), init_seed=LAYER_SEED)
    with torch.no_grad():
        layer.router.weight.copy_(10.0 * torch.eye(4))
    experts = [[0, 0, 1, 2], [0, 3, 3, 3]][rank]  # totals 3, 1, 1, 3 (mean 2)
    layer(torch.eye(4)[experts].view(4, 1, 4).requires_grad_())
    update_expert_biases([layer])
    diffs["expert_bias"] = layer.router.expert_bias.tolist()
    parallel_state.destroy_model_parallel()
    return diffs


def _gated_shared_experts_under_tensor_parallel(hidden, upstream, local):
    """The gated shared experts at TP=2 + SP (each rank half of every sequence) against the single-rank layer:
    output, input gradient, and the router's and shared experts' gradients after finalize_model_grads' sum of
    the sequence-parallel ones (the gate weight is marked like the router weight); the largest difference."""
    gated = dict(moe_shared_expert_intermediate_size=32, moe_shared_expert_gate=True)
    parallel_state.initialize_model_parallel()
    ref_output, ref_input_grad, ref_grads = _run(MoELayer(moe_config(**gated), init_seed=LAYER_SEED), hidden,
                                                 upstream)
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    layer = MoELayer(moe_config(tensor_model_parallel_size=2, sequence_parallel=True, **gated), init_seed=LAYER_SEED)
    local_hidden = local(hidden).clone().requires_grad_()
    output, _ = layer(local_hidden)
    (output * local(upstream)).sum().backward()
    _allreduce_sequence_parallel_grads([layer])
    worst = max((output - local(ref_output)).abs().max().item(),
                (local_hidden.grad - local(ref_input_grad)).abs().max().item())
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    for name, param in layer.named_parameters():
        if not name.startswith(("shared_experts.", "router.")):
            continue
        ref_grad = ref_grads[name]
        if getattr(param, "tensor_model_parallel", False):
            ref_grad = ref_grad.chunk(2, dim=param.partition_dim)[tp_rank]
        worst = max(worst, (param.grad - ref_grad).abs().max().item())
    assert layer.shared_experts.gate_weight.sequence_parallel
    parallel_state.destroy_model_parallel()
    return worst


def test_expert_and_tensor_parallel_equal_single_rank():
    for diffs in run_on_ranks(2, _parallel_layers_match_single_rank):
        assert diffs.pop("expert_bias") == [-0.5, 0.5, 0.5, -0.5]
        for case, worst in diffs.items():
            assert worst < 1e-5, (case, worst)


def _expert_and_tensor_parallel_together():
    """On 4 ranks: EP=2 x TP=2 with sequence parallelism (data-parallel rank d holds sequence d, TP rank t half t
    of it) against the single-rank layer."""
    rank = dist.get_rank()
    tp_rank, dp_rank = rank % 2, rank // 2  # tensor-parallel neighbours are consecutive ranks
    hidden, upstream = _inputs()
    reference = _references(hidden, upstream)
    sizes = dict(tensor_model_parallel_size=2, sequence_parallel=True, expert_model_parallel_size=2)
    return _largest_differences(sizes, lambda t: t[tp_rank * SEQ // 2:(tp_rank + 1) * SEQ // 2, dp_rank:dp_rank + 1],
                                reference, hidden, upstream)


def test_expert_parallel_with_tensor_parallel_and_sequence_parallel():
    for diffs in run_on_ranks(4, _expert_and_tensor_parallel_together):
        for dispatcher, worst in diffs.items():
            assert worst < 1e-5, (dispatcher, worst)


def _expert_tensor_parallel_size_apart_from_tensor_parallel():
    """On 4 ranks, against the single-rank layer, each rank with a quarter of the tokens (half a sequence): TP=2 +
    SP with whole experts (ETP=1) over EP=2 (two data-parallel replicas) and EP=4 (one), where the two TP ranks
    of a sequence are two expert-parallel ranks; and TP=1 with experts split over ETP=2 and EP=2 (the four
    data-parallel ranks one ETP x EP group)."""
    rank = dist.get_rank()
    half, dp_rank = rank % 2, rank // 2
    hidden, upstream = _inputs()
    reference = _references(hidden, upstream)
    local = (lambda t: t[half * SEQ // 2:(half + 1) * SEQ // 2, dp_rank:dp_rank + 1])
    layouts = {f"tp2_etp1_ep{ep}": dict(tensor_model_parallel_size=2, sequence_parallel=True,
                                        expert_model_parallel_size=ep, expert_tensor_parallel_size=1)
               for ep in (2, 4)}
    layouts["tp1_etp2_ep2"] = dict(expert_model_parallel_size=2, expert_tensor_parallel_size=2)
    diffs = {}
    for layout, sizes in layouts.items():
        for dispatcher, worst in _largest_differences(sizes, local, reference, hidden, upstream).items():
            diffs[f"{layout}/{dispatcher}"] = worst
    return diffs


def test_expert_tensor_parallel_size_apart_from_tensor_parallel_size():
    for diffs in run_on_ranks(4, _expert_tensor_parallel_size_apart_from_tensor_parallel):
        assert len(diffs) == 6
        for case, worst in diffs.items():
            assert worst < 1e-5, (case, worst)


def _tensor_parallel_without_sequence_parallel():
    """On 2 ranks, TP=2 without sequence parallelism (every rank holds all the tokens, as in generation): the layer
    in eval mode against the single-rank layer, each dispatcher, with experts split over ETP=2 and whole over EP=2
    (ETP=1), shared experts included; and the refusal of a training-mode forward."""
    hidden, _ = _inputs()
    shared = dict(moe_shared_expert_intermediate_size=32)
    parallel_state.initialize_model_parallel()
    reference = {dispatcher: MoELayer(moe_config(moe_token_dispatcher_type=dispatcher, **shared),
                                      init_seed=LAYER_SEED).eval()(hidden)[0].detach() for dispatcher in DISPATCHERS}
    parallel_state.destroy_model_parallel()
    diffs = {}
    for layout, sizes in {"tp2_etp2": dict(tensor_model_parallel_size=2),
                          "tp2_etp1_ep2": dict(tensor_model_parallel_size=2, expert_tensor_parallel_size=1,
                                               expert_model_parallel_size=2)}.items():
        parallel_state.initialize_model_parallel(**sizes)
        for dispatcher in DISPATCHERS:
            layer = MoELayer(moe_config(moe_token_dispatcher_type=dispatcher, **sizes, **shared),
                             init_seed=LAYER_SEED)
            with pytest.raises(ValueError, match="--tensor-model-parallel-size 2 needs --sequence-parallel"):
                layer.train()(hidden)
            with torch.no_grad():
                output, _ = layer.eval()(hidden)
            diffs[f"{layout}/{dispatcher}"] = (output - reference[dispatcher]).abs().max().item()
        parallel_state.destroy_model_parallel()
    return diffs


@pytest.mark.parametrize("world_size", [2])
def test_tensor_parallel_without_sequence_parallel_generates_like_one_rank_and_refuses_to_train(world_size):
    for diffs in run_on_ranks(world_size, _tensor_parallel_without_sequence_parallel):
        assert len(diffs) == 4
        for case, worst in diffs.items():
            assert worst < 1e-5, (case, worst)
