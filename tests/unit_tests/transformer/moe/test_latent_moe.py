"""Latent MoE (`--moe-latent-size`): `MoELayer` with `fc1_latent_proj` / `fc2_latent_proj`.

- One rank, against the per-token formula written out here in float64 from the layer's raw weights (not its
  modules): out_t = P2 (sum_e p_te y_e(P1 x_t + c1)) + c2 + shared(x_t), y_e the expert MLP at the latent width;
  every gradient by autograd through that formula. With linear biases and shared experts, with each dispatcher,
  with grouped GEMM, and with `--moe-apply-probs-on-input` (the projected token scaled by its probability).
- Whole-layer recompute, grouped GEMM and the shared experts' overlap give the plain layer's numbers; the
  projections' weights do not depend on the layer's build (meta device, other modules); the configuration rules
  name the flag.
- FP8: the experts' GEMMs (at the latent width) run in FP8, the projections in fp32.
- On two ranks: EP=2 (each rank one sequence) and TP=2 + SP (each rank half of every sequence), each dispatcher,
  against the single-rank layer for the output, the input gradient and every parameter gradient (the projections'
  summed over the tensor-parallel group as finalize_model_grads sums the router's).
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.core import parallel_state
from megatron.core.distributed.finalize_model_grads import _allreduce_sequence_parallel_grads
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.transformer_config import TransformerConfig
from tests.unit_tests.multiprocess_harness import run_on_ranks

HIDDEN, LATENT, SEQ, BATCH, LAYER_SEED = 16, 8, 8, 2, 21
EXPERTS, FFN, SHARED = 4, 24, 32
DISPATCHERS = ("allgather", "alltoall")
# fp32 layer against the float64 formula: each output sums ~100 fp32 products of O(1) values.
FORMULA_TOLERANCE = 1e-5


def latent_config(**overrides):
    fields = dict(num_layers=2, hidden_size=HIDDEN, num_attention_heads=2, num_moe_experts=EXPERTS,
                  moe_router_topk=2, moe_ffn_hidden_size=FFN, moe_latent_size=LATENT, init_seed=5,
                  hidden_dropout=0.0, attention_dropout=0.0, add_bias_linear=True,
                  moe_shared_expert_intermediate_size=SHARED)
    fields.update(overrides)
    return TransformerConfig(**fields)


def _inputs():
    generator = torch.Generator().manual_seed(0)
    return torch.randn(SEQ, BATCH, HIDDEN, generator=generator), torch.randn(SEQ, BATCH, HIDDEN, generator=generator)


def _formula(weights, hidden, topk, probs_on_input):
    """The layer's output by the per-token formula, in float64, from `weights` (name -> float64 leaf tensor).
    Softmax top-k routing renormalised over the chosen k; top-1 `probs_on_input` takes the full softmax's
    probability (pre-softmax) and scales the projected token instead of the expert's output."""
    tokens = hidden.reshape(-1, HIDDEN)
    logits = tokens @ weights["router.weight"].t()
    chosen = logits.topk(topk, dim=-1).indices
    if probs_on_input:
        chosen_probs = torch.softmax(logits, dim=-1).gather(1, chosen)
    else:
        chosen_probs = torch.softmax(logits.gather(1, chosen), dim=-1)
    outputs = []
    for token in range(tokens.size(0)):
        x = tokens[token]
        latent = weights["fc1_latent_proj.weight"] @ x + weights["fc1_latent_proj.bias"]
        combined = torch.zeros(LATENT, dtype=torch.float64)
        for slot in range(topk):
            expert, prob = int(chosen[token, slot]), chosen_probs[token, slot]
            prefix = f"experts.local_experts.{expert}."
            expert_input = prob * latent if probs_on_input else latent
            inner = F.gelu(weights[prefix + "linear_fc1.weight"] @ expert_input + weights[prefix + "linear_fc1.bias"])
            expert_output = weights[prefix + "linear_fc2.weight"] @ inner + weights[prefix + "linear_fc2.bias"]
            combined = combined + (expert_output if probs_on_input else prob * expert_output)
        output = weights["fc2_latent_proj.weight"] @ combined + weights["fc2_latent_proj.bias"]
        shared = "shared_experts."
        inner = F.gelu(weights[shared + "linear_fc1.weight"] @ x + weights[shared + "linear_fc1.bias"])
        output = output + weights[shared + "linear_fc2.weight"] @ inner + weights[shared + "linear_fc2.bias"]
        outputs.append(output)
    return torch.stack(outputs).view(hidden.shape)


def _run(layer, hidden, upstream):
    for param in layer.parameters():
        param.grad = None
    hidden = hidden.clone().requires_grad_()
    output, _ = layer(hidden)
    (output * upstream).sum().backward()
    grads = {name: param.grad.detach().clone() for name, param in layer.named_parameters()}
    return output.detach(), hidden.grad, grads


def _formula_run(layer, hidden, upstream, topk, probs_on_input=False):
    weights = {name: param.detach().double().requires_grad_() for name, param in layer.named_parameters()}
    hidden = hidden.double().requires_grad_()
    output = _formula(weights, hidden, topk, probs_on_input)
    (output * upstream.double()).sum().backward()
    return output.detach(), hidden.grad, {name: weight.grad for name, weight in weights.items()}


def _largest_difference(got, expected):
    output, input_grad, grads = got
    ref_output, ref_input_grad, ref_grads = expected
    assert set(grads) == set(ref_grads)
    worst = max((output.double() - ref_output).abs().max().item(),
                (input_grad.double() - ref_input_grad).abs().max().item())
    for name, grad in grads.items():
        worst = max(worst, (grad.double() - ref_grads[name]).abs().max().item())
    return worst


CASES = {
    "allgather": dict(moe_token_dispatcher_type="allgather"),
    "alltoall": dict(moe_token_dispatcher_type="alltoall"),
    "alltoall_grouped_gemm": dict(moe_token_dispatcher_type="alltoall", moe_grouped_gemm=True),
    "probs_on_input": dict(moe_router_topk=1, moe_router_pre_softmax=True, moe_apply_probs_on_input=True),
}


@pytest.mark.parametrize("case", CASES)
def test_layer_equals_the_per_token_formula_with_every_gradient(case):
    config = latent_config(**CASES[case])
    layer = MoELayer(config, init_seed=LAYER_SEED)
    names = dict(layer.named_parameters())
    assert names["fc1_latent_proj.weight"].shape == (LATENT, HIDDEN)
    assert names["fc2_latent_proj.weight"].shape == (HIDDEN, LATENT)
    assert names["experts.local_experts.0.linear_fc1.weight"].shape == (FFN, LATENT)
    assert names["experts.local_experts.0.linear_fc2.weight"].shape == (LATENT, FFN)
    assert names["shared_experts.linear_fc1.weight"].shape == (SHARED, HIDDEN)
    hidden, upstream = _inputs()
    got = _run(layer, hidden, upstream)
    expected = _formula_run(layer, hidden, upstream, config.moe_router_topk, config.moe_apply_probs_on_input)
    assert _largest_difference(got, expected) < FORMULA_TOLERANCE
    # The projections are not the identity: without them (hidden-width experts) the numbers differ.
    assert got[2]["fc1_latent_proj.weight"].abs().sum() > 0 and got[2]["fc2_latent_proj.bias"].abs().sum() > 0


def test_recompute_grouped_gemm_and_shared_expert_overlap_give_the_plain_layers_numbers():
    hidden, upstream = _inputs()
    plain = _run(MoELayer(latent_config(), init_seed=LAYER_SEED), hidden, upstream)
    for changes in (dict(moe_layer_recompute=True), dict(recompute_granularity="selective", recompute_modules=["moe"]),
                    dict(moe_grouped_gemm=True),
                    dict(moe_token_dispatcher_type="alltoall", moe_shared_expert_overlap=True)):
        got = _run(MoELayer(latent_config(**changes), init_seed=LAYER_SEED), hidden, upstream)
        assert _largest_difference(got, tuple(_double(part) for part in plain)) < 1e-6, changes


def _double(part):
    return {name: value.double() for name, value in part.items()} if isinstance(part, dict) else part.double()


def test_projections_are_seeded_by_name_and_bias_free_without_linear_biases():
    """The projections' weights come from seeds of their own (not the router's, not each other's); without
    --add-bias-linear they have no bias, as transformers' with mlp_bias false."""
    layer = MoELayer(latent_config(add_bias_linear=False, moe_shared_expert_intermediate_size=None),
                     init_seed=LAYER_SEED)
    again = MoELayer(latent_config(add_bias_linear=False, moe_shared_expert_intermediate_size=None,
                                   moe_token_dispatcher_type="alltoall", moe_grouped_gemm=True), init_seed=LAYER_SEED)
    assert layer.fc1_latent_proj.bias is None and layer.fc2_latent_proj.bias is None
    for name in ("fc1_latent_proj.weight", "fc2_latent_proj.weight"):
        assert torch.equal(dict(layer.named_parameters())[name], dict(again.named_parameters())[name])
    fc1, fc2 = layer.fc1_latent_proj.weight, layer.fc2_latent_proj.weight
    assert not torch.equal(fc1, fc2.t()) and 0.01 < fc1.std().item() < 0.03  # init_method_std 0.02
    other = MoELayer(latent_config(add_bias_linear=False, moe_shared_expert_intermediate_size=None),
                     init_seed=LAYER_SEED + 1)
    assert not torch.equal(other.fc1_latent_proj.weight, fc1)
    assert MoELayer(latent_config(moe_latent_size=None), init_seed=LAYER_SEED).fc1_latent_proj is None


@pytest.mark.parametrize("changes, message", [
    (dict(moe_latent_size=0), "--moe-latent-size must be a positive integer, got 0"),
    (dict(moe_latent_size=7, tensor_model_parallel_size=2, sequence_parallel=True),
     r"--moe-latent-size \(7\) must be divisible by --tensor-model-parallel-size \(2\)"),
    (dict(num_moe_experts=None, moe_router_topk=2, moe_ffn_hidden_size=None, moe_shared_expert_intermediate_size=None),
     "--moe-latent-size needs --num-experts"),
])
def test_configuration_rules_name_the_flag(changes, message):
    with pytest.raises(ValueError, match=message):
        latent_config(**changes)


def test_fp8_experts_run_at_the_latent_width_and_the_projections_in_fp32():
    from megatron.core.fp8_utils import get_fp8_context

    from tests.unit_tests.transformer.moe.test_moe_fp8 import BACKWARD_FP8_BOUND, FORWARD_FP8_BOUND

    config = latent_config(hidden_size=32, moe_latent_size=16, moe_ffn_hidden_size=48, fp8="hybrid",
                           fp8_recipe="tensorwise", add_bias_linear=False, moe_shared_expert_intermediate_size=None)
    layer = MoELayer(config, init_seed=LAYER_SEED)
    generator = torch.Generator().manual_seed(0)
    hidden, upstream = (torch.randn(16, 2, 32, generator=generator) for _ in range(2))
    fp32 = _run(layer, hidden, upstream)
    with get_fp8_context(config, layer_no=0):
        fp8 = _run(layer, hidden, upstream)

    def relative(name=None, index=0):
        got, expected = (fp8[index], fp32[index]) if name is None else (fp8[2][name], fp32[2][name])
        return ((got - expected).norm() / expected.norm()).item()

    assert relative() < FORWARD_FP8_BOUND and relative(index=1) < BACKWARD_FP8_BOUND
    expert_errors = [relative(name) for name in fp32[2] if name.startswith("experts.")]
    assert len(expert_errors) == 8 and 1e-4 < min(expert_errors) and max(expert_errors) < BACKWARD_FP8_BOUND
    for name in ("fc1_latent_proj.weight", "fc2_latent_proj.weight"):
        assert relative(name) < BACKWARD_FP8_BOUND  # fp32 GEMMs fed by the FP8 experts' gradients


def _parallel_layouts_match_single_rank():
    """On 2 ranks, per dispatcher: the single-rank layer over all tokens, then EP=2 (each rank one sequence) and TP=2
    + SP (each rank half of every sequence). Largest difference of the output, the input gradient and every
    parameter gradient (dense ones summed as the data-parallel wrappers / finalize_model_grads sum them; expert
    ones summed over the expert data-parallel group, sliced to this rank's share under expert TP)."""
    rank = dist.get_rank()
    hidden, upstream = _inputs()
    parallel_state.initialize_model_parallel()
    reference = {dispatcher: _run(MoELayer(latent_config(moe_token_dispatcher_type=dispatcher), init_seed=LAYER_SEED),
                                  hidden, upstream) for dispatcher in DISPATCHERS}
    parallel_state.destroy_model_parallel()
    layouts = {"ep2": (dict(expert_model_parallel_size=2), lambda t: t[:, rank:rank + 1]),
               "tp2_sp": (dict(tensor_model_parallel_size=2, sequence_parallel=True),
                          lambda t: t[rank * SEQ // 2:(rank + 1) * SEQ // 2])}
    diffs = {}
    for layout, (sizes, local) in layouts.items():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=sizes.get("tensor_model_parallel_size", 1),
                                                 expert_model_parallel_size=sizes.get("expert_model_parallel_size", 1))
        for dispatcher in DISPATCHERS:
            layer = MoELayer(latent_config(moe_token_dispatcher_type=dispatcher, **sizes), init_seed=LAYER_SEED)
            output, input_grad, _ = _run(layer, local(hidden), local(upstream))
            _allreduce_sequence_parallel_grads([layer])
            ref_output, ref_input_grad, ref_grads = reference[dispatcher]
            worst = max((output - local(ref_output)).abs().max().item(),
                        (input_grad - local(ref_input_grad)).abs().max().item())
            etp, etp_rank = (parallel_state.get_expert_tensor_parallel_world_size(),
                             parallel_state.get_expert_tensor_parallel_rank())
            for name, param in layer.named_parameters():
                grad = param.grad.clone()
                if name.startswith("experts.local_experts."):
                    local_index, rest = name[len("experts.local_experts."):].split(".", 1)
                    ref_grad = ref_grads[f"experts.local_experts.{layer.local_expert_indices[int(local_index)]}.{rest}"]
                    dist.all_reduce(grad, group=parallel_state.get_expert_data_parallel_group())
                    if getattr(param, "tensor_model_parallel", False) and etp > 1:
                        ref_grad = ref_grad.chunk(etp, dim=param.partition_dim)[etp_rank]
                else:
                    ref_grad = ref_grads[name]
                    if getattr(param, "tensor_model_parallel", False) and layout == "tp2_sp":
                        ref_grad = ref_grad.chunk(2, dim=param.partition_dim)[rank]
                    if layout == "ep2":
                        dist.all_reduce(grad)  # the data-parallel replicas' tokens
                worst = max(worst, (grad - ref_grad).abs().max().item())
            diffs[f"{layout}/{dispatcher}"] = worst
        assert layer.fc1_latent_proj.weight.sequence_parallel == (layout == "tp2_sp")
        parallel_state.destroy_model_parallel()
    return diffs


def test_expert_and_tensor_parallel_equal_single_rank():
    for diffs in run_on_ranks(2, _parallel_layouts_match_single_rank):
        assert len(diffs) == 4
        for case, worst in diffs.items():
            assert worst < 1e-5, (case, worst)


def test_meta_device_build_materialises_the_eager_weights():
    """Megatron-FSDP builds on the meta device and resets module by module: the projections draw what an eager
    build draws."""
    from megatron.core.transformer.init_seeds import reset_children_parameters

    eager = MoELayer(latent_config(), init_seed=LAYER_SEED)
    deferred = MoELayer(latent_config(init_model_with_meta_device=True), init_seed=LAYER_SEED)
    assert deferred.fc1_latent_proj.weight.is_meta
    deferred = deferred.to_empty(device="cpu")
    reset_children_parameters(deferred)
    for name, tensor in eager.state_dict().items():
        assert torch.equal(deferred.state_dict()[name], tensor), name
