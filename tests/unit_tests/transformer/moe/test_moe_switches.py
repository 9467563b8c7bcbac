"""The MoE switches of upstream recipes, against formulas written here: router input jitter, forced (random)
load balancing with its straight-through gradient, routing-map padding for FP8 (output unchanged), probabilities
applied to the expert input (top-1), whole-layer recompute (same values and gradients, fewer saved tensors),
per-layer aux-loss logging; and their command-line flags and rules."""

from types import SimpleNamespace

import pytest
import torch

from megatron.core.transformer.moe import moe_utils
from megatron.core.transformer.moe.moe_config import fp8_routing_pad_multiple
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.routing import pad_routing_map, topk_routing
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.training.arguments import parse_args, validate_args
from megatron.training.model_config import core_transformer_config_from_args

HIDDEN, SEQ, BATCH, EXPERTS = 8, 6, 2, 4


def config(**overrides):
    fields = dict(num_layers=2, hidden_size=HIDDEN, num_attention_heads=2, num_moe_experts=EXPERTS,
                  moe_router_topk=2, moe_ffn_hidden_size=12, init_seed=3, hidden_dropout=0.0, attention_dropout=0.0)
    fields.update(overrides)
    return TransformerConfig(**fields)


def hidden(seed=0):
    return torch.randn(SEQ, BATCH, HIDDEN, generator=torch.Generator().manual_seed(seed))


@pytest.fixture(autouse=True)
def clean_tracker():
    moe_utils.clear_aux_losses_tracker()
    yield
    moe_utils.clear_aux_losses_tracker()


def test_input_jitter_multiplies_the_router_input_in_training_only():
    eps = 0.2
    router = TopKRouter(config(moe_input_jitter_eps=eps))
    x = hidden()
    tokens = x.reshape(-1, HIDDEN)
    torch.manual_seed(7)
    probs, _ = router(x)
    torch.manual_seed(7)
    noise = torch.empty_like(tokens).uniform_(1 - eps, 1 + eps)
    expected, _ = topk_routing((tokens * noise) @ router.weight.detach().t(), 2)
    torch.testing.assert_close(probs.detach(), expected)
    router.eval()
    plain, _ = topk_routing(tokens @ router.weight.detach().t(), 2)
    torch.testing.assert_close(router(x)[0].detach(), plain)


def test_force_load_balancing_routes_by_random_logits_straight_through():
    router = TopKRouter(config(moe_router_force_load_balancing=True))
    x = hidden()
    tokens = x.reshape(-1, HIDDEN)
    upstream = torch.randn(SEQ * BATCH, EXPERTS, generator=torch.Generator().manual_seed(1))
    torch.manual_seed(9)
    probs, routing_map = router(x)
    (probs * upstream).sum().backward()
    torch.manual_seed(9)
    random_logits = torch.randn(SEQ * BATCH, EXPERTS).requires_grad_()
    expected_probs, expected_map = topk_routing(random_logits, 2)
    assert torch.equal(routing_map, expected_map)
    (expected_probs * upstream).sum().backward()
    # d loss / d W = (d loss / d logits)^T x, with d logits taken as d random_logits (straight through).
    torch.testing.assert_close(router.weight.grad, random_logits.grad.t() @ tokens)


def test_pad_routing_map_to_multiples():
    routing_map = torch.zeros(40, 3, dtype=torch.bool)
    routing_map[[0, 5, 9], 0] = True  # 3 -> 16
    routing_map[:16, 1] = True  # 16 stays
    routing_map[:35, 2] = True  # 35 -> 40 (every token; 48 is out of reach)
    probs = routing_map.float() * 0.5
    padded_probs, padded = pad_routing_map(probs, routing_map, 16)
    assert padded.sum(dim=0).tolist() == [16, 16, 40]
    assert torch.equal(padded & routing_map, routing_map)
    added = padded & ~routing_map
    assert added[:, 0].nonzero().flatten().tolist() == [i for i in range(16) if i not in (0, 5, 9)][:13]
    assert torch.equal(padded_probs, probs) and padded_probs[added].abs().sum() == 0


@pytest.mark.parametrize("dispatcher", ["allgather", "alltoall"])
def test_fp8_padding_leaves_the_layer_output_unchanged(dispatcher, monkeypatch):
    layer = MoELayer(config(moe_token_dispatcher_type=dispatcher), init_seed=4)
    x = hidden()
    reference, _ = layer(x)
    route = layer.router.forward
    monkeypatch.setattr(layer.router, "forward", lambda h: pad_routing_map(*route(h), 5))
    counts = layer.router(x)[1].sum(dim=0)
    assert all(count % 5 == 0 or count == SEQ * BATCH for count in counts.tolist()) and counts.sum() > 2 * SEQ * BATCH
    torch.testing.assert_close(layer(x)[0], reference)


def test_apply_probs_on_input_scales_the_expert_input():
    layer = MoELayer(config(moe_router_topk=1, moe_router_pre_softmax=True, moe_apply_probs_on_input=True),
                     init_seed=4)
    x = hidden()
    output, _ = layer(x)
    with torch.no_grad():
        probs, routing_map = layer.router(x)
        tokens = x.reshape(-1, HIDDEN)
        expected = torch.zeros_like(tokens)
        for token, expert in routing_map.nonzero().tolist():
            scaled = tokens[token:token + 1] * probs[token, expert]
            expert_output, expert_bias = layer.experts.local_experts[expert](scaled)  # (output, bias)
            expected[token] = (expert_output + expert_bias)[0]
    torch.testing.assert_close(output, expected.view_as(x), rtol=1e-5, atol=1e-6)


def _run(layer, x):
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        output, _ = layer(x)
    output.square().sum().backward()
    return output.detach(), {name: p.grad.clone() for name, p in layer.named_parameters()}, x.grad.clone(), saved


def test_layer_recompute_same_values_fewer_saved_tensors():
    plain = MoELayer(config(moe_aux_loss_coeff=0.1), init_seed=4)
    recomputed = MoELayer(config(moe_aux_loss_coeff=0.1, moe_layer_recompute=True), init_seed=4)
    recomputed.load_state_dict(plain.state_dict())
    out_a, grads_a, input_grad_a, saved_a = _run(plain, hidden().requires_grad_())
    out_b, grads_b, input_grad_b, saved_b = _run(recomputed, hidden().requires_grad_())
    torch.testing.assert_close(out_a, out_b)
    torch.testing.assert_close(input_grad_a, input_grad_b)
    for name, grad in grads_a.items():
        torch.testing.assert_close(grads_b[name], grad, msg=name)
    assert len(saved_b) < len(saved_a) / 2


def test_per_layer_logging():
    for layer_number, value in ((1, 0.5), (3, 1.5)):
        moe_utils.save_to_aux_losses_tracker("load_balancing_loss", torch.tensor(value), layer_number, 4,
                                             per_layer=True)
    logged = moe_utils.reduce_aux_losses_for_logging(["load_balancing_loss"], 4, 2, num_microbatches=2,
                                                     data_parallel_size=1, device="cpu")
    assert logged == {"load_balancing_loss": 0.5, "load_balancing_loss_layer_0": 0.25,
                      "load_balancing_loss_layer_2": 0.75}
    moe_utils.save_to_aux_losses_tracker("load_balancing_loss", torch.tensor(0.5), 1, 4)
    assert moe_utils.reduce_aux_losses_for_logging(["load_balancing_loss"], 4, 1, 1, 1, "cpu") == {
        "load_balancing_loss": 0.5}
    router = TopKRouter(config(moe_aux_loss_coeff=0.1, moe_per_layer_logging=True), layer_number=2)
    router(hidden())
    assert "load_balancing_loss_layer_1" in moe_utils.reduce_aux_losses_for_logging(
        ["load_balancing_loss"], 2, 1, 1, 1, "cpu")


# ---- command line -------------------------------------------------------------------------------------------

BASE = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --micro-batch-size 2 "
        "--train-iters 10 --lr 1e-3 --mock-data --vocab-size 128")


def validated(extra, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    return validate_args(parse_args(args=(BASE + " " + extra).split()))


def test_flags_reach_the_config(monkeypatch):
    args = validated("--num-experts 4 --moe-router-topk 1 --moe-router-pre-softmax --moe-input-jitter-eps 0.01 "
                     "--moe-router-force-load-balancing --moe-apply-probs-on-input --moe-layer-recompute "
                     "--moe-per-layer-logging --moe-permute-fusion --moe-router-fusion "
                     "--moe-use-legacy-grouped-gemm --moe-deepep-num-sms 24", monkeypatch)
    moe = core_transformer_config_from_args(args)
    assert moe.moe_input_jitter_eps == 0.01 and moe.moe_router_force_load_balancing
    assert moe.moe_apply_probs_on_input and moe.moe_layer_recompute and moe.moe_per_layer_logging
    assert not moe.moe_router_padding_for_fp8


@pytest.mark.parametrize("extra, message", [
    ("--moe-layer-recompute", "--moe-layer-recompute needs --num-experts"),
    ("--num-experts 4 --moe-apply-probs-on-input", "--moe-apply-probs-on-input needs --moe-router-topk 1"),
    ("--num-experts 4 --moe-router-padding-for-fp8", "--moe-router-padding-for-fp8 pads the experts' token "
                                                     "counts for FP8 GEMMs: it needs --fp8-format"),
    ("--num-experts 4 --moe-input-jitter-eps 1.5", "--moe-input-jitter-eps must be in (0, 1)"),
    ("--num-experts 4 --moe-enable-deepep", "--moe-enable-deepep needs DeepEP on CUDA GPUs"),
    # Upstream's newer name is named too, whichever of the two was given.
    ("--num-experts 4 --moe-router-padding-for-quantization", "it needs --fp8-format; add it or drop the flag (or "
                                                              "its newer name --moe-router-padding-for-quantization)"),
    ("--moe-router-padding-for-quantization", "--moe-router-padding-for-fp8 (--moe-router-padding-for-quantization) "
                                              "needs --num-experts"),
])
def test_rules_name_the_flags(extra, message, monkeypatch):
    with pytest.raises(ValueError) as error:
        validated(extra, monkeypatch)
    assert message in str(error.value)


def test_routing_flags_on_a_dense_model_warn_naming_them(monkeypatch):
    """Upstream accepts these MoE flags without --num-experts and never reads them: a warning names them."""
    with pytest.warns(UserWarning) as record:
        validated("--moe-aux-loss-coeff 0.01 --moe-token-drop-policy position --moe-router-bias-update-rate 0.01",
                  monkeypatch)
    messages = [str(warning.message) for warning in record if "MoE flags without effect" in str(warning.message)]
    assert messages == ["--moe-aux-loss-coeff, --moe-token-drop-policy, --moe-router-bias-update-rate: MoE flags "
                        "without effect on a model without experts; add --num-experts or drop them"]
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*MoE flags without effect")
        validated("--num-experts 4 --moe-aux-loss-coeff 0.01 --moe-token-drop-policy position", monkeypatch)
        validated("", monkeypatch)


def test_removed_and_deprecated_upstream_flags(monkeypatch):
    with pytest.raises(ValueError) as error:
        validated("--num-experts 4 --moe-router-topk-limited-devices 1 --expert-model-parallel-size 2", monkeypatch)
    assert str(error.value) == ("--moe-router-topk-limited-devices was replaced upstream by group-limited routing "
                                "(one group of experts per expert-parallel rank): use --moe-router-num-groups 2 "
                                "--moe-router-group-topk 1 instead")
    with pytest.raises(ValueError, match=r"--moe-router-topk-limited-devices .* at --expert-model-parallel-size 1 it "
                                         r"limits nothing: drop it"):
        validated("--num-experts 4 --moe-router-topk-limited-devices 2", monkeypatch)
    with pytest.warns(UserWarning, match=r"--moe-extended-tp is deprecated and ignored .* set that instead"):
        args = validated("--num-experts 4 --moe-extended-tp", monkeypatch)
    assert core_transformer_config_from_args(args).expert_tensor_parallel_size == 1


@pytest.mark.parametrize("extra, message", [
    ("--moe-router-load-balancing-type none --moe-aux-loss-coeff 0.01",
     "--moe-aux-loss-coeff 0.01 (--moe-router-load-balancing-type none adds no auxiliary loss): without effect"),
    ("--moe-token-drop-policy position", "--moe-token-drop-policy position (dropless without a positive "
                                         "--moe-expert-capacity-factor: no token is dropped): without effect"),
    ("--moe-token-drop-policy position --moe-expert-capacity-factor -1", "--moe-token-drop-policy position"),
])
def test_moe_settings_without_effect_warn_naming_them(extra, message, monkeypatch):
    with pytest.warns(UserWarning) as record:
        validated("--num-experts 4 " + extra, monkeypatch)
    assert any(message in str(warning.message) for warning in record)


def test_router_padding_follows_the_fp8_recipe_alignment():
    # mxfp8 needs Transformer Engine on a GPU, so the config of that recipe is checked through the helper the router
    # calls: mxfp8's scales cover blocks of 32 elements, the per-tensor recipes' kernels need multiples of 16.
    assert [fp8_routing_pad_multiple(SimpleNamespace(fp8_recipe=recipe))
            for recipe in ("delayed", "tensorwise", "blockwise", "mxfp8")] == [16, 16, 16, 32]
    mxfp8 = config(moe_router_padding_for_fp8=True, fp8="e4m3")
    object.__setattr__(mxfp8, "fp8_recipe", "mxfp8")  # after validation, which refuses mxfp8 without TE
    tokens = torch.randn(80, 1, HIDDEN, generator=torch.Generator().manual_seed(0))  # 160 choices over 4 experts
    unpadded = TopKRouter(config())(tokens)[1].sum(dim=0)
    counts = TopKRouter(mxfp8)(tokens)[1].sum(dim=0)

    def padded_to(multiple):
        return torch.clamp(torch.ceil(unpadded / multiple) * multiple, max=80).long()

    assert torch.equal(counts, padded_to(32)) and not torch.equal(counts, padded_to(16)), (counts, unpadded)


def test_router_pads_after_counting_for_the_expert_bias():
    router = TopKRouter(config(moe_router_padding_for_fp8=True, fp8="e4m3", moe_router_score_function="sigmoid",
                               moe_router_enable_expert_bias=True))
    probs, routing_map = router(hidden())
    assert router.local_tokens_per_expert.sum().item() == 2 * SEQ * BATCH  # the real top-2 choices only
    assert all(count % 16 == 0 or count == SEQ * BATCH for count in routing_map.sum(dim=0).tolist())
    assert (probs > 0).sum().item() == 2 * SEQ * BATCH
