"""MoE in FP8 (torch-native backend): the experts and the shared experts run their GEMMs through the FP8 linear
path, the router stays in its own dtype.

- One layer in FP8 (e4m3 / hybrid, current and delayed scaling) against the same layer in fp32, within the
  dense FP8 linear tests' bounds, and not equal to it (FP8 was in effect); grouped experts equal sequential ones.
- Delayed scaling: one step's amaxes of every expert and of the shared experts are recorded by
  `reduce_fp8_amaxes`, and the next forward uses those histories.
- On two ranks, EP=2 against EP=1 (each rank one sequence) over two steps: the second runs on the reduced
  histories, which shows that an expert's amaxes are reduced by its global index.
- A tiny FP8 MoE GPT trains through `pretrain()`.
"""

import pytest
import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.fp8_utils import get_fp8_context, reduce_fp8_amaxes
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.transformer_config import TransformerConfig
from tests.unit_tests.multiprocess_harness import run_on_ranks

HIDDEN, SEQ, BATCH, LAYER_SEED = 32, 16, 2, 21
# The bounds of the dense FP8 layer tests (tests/unit_tests/tensor_parallel/test_fp8_linear.py): relative
# Frobenius error of FP8 against fp32 for two chained linears, forward and backward (e4m3 rounds each operand by
# at most 2**-4, e5m2 by 2**-3; ~2x headroom over random data).
FORWARD_FP8_BOUND = 0.12
BACKWARD_FP8_BOUND = 0.2
# Identical FP8 computations that differ in fp32 summation order only (token order within an expert).
EXACT_TOLERANCE = 1e-5


def moe_fp8_config(fp8="hybrid", recipe="delayed", **overrides):
    fields = dict(num_layers=2, hidden_size=HIDDEN, num_attention_heads=2, num_moe_experts=4, moe_router_topk=2,
                  moe_ffn_hidden_size=48, init_seed=5, hidden_dropout=0.0, attention_dropout=0.0,
                  moe_token_dispatcher_type="alltoall", fp8=fp8, fp8_recipe=recipe, fp8_amax_history_len=2,
                  gated_linear_unit=True, activation_func=torch.nn.functional.silu)
    fields.update(overrides)
    return TransformerConfig(**fields)


def _inputs():
    generator = torch.Generator().manual_seed(0)
    return torch.randn(SEQ, BATCH, HIDDEN, generator=generator), torch.randn(SEQ, BATCH, HIDDEN, generator=generator)


def _run(layer, hidden, upstream, fp8):
    """Forward and backward of `layer` (inside the layer's FP8 context when `fp8`): output, input gradient and
    every parameter gradient."""
    for param in layer.parameters():
        param.grad = None
    hidden = hidden.clone().requires_grad_()
    context = get_fp8_context(layer.config, layer_no=0) if fp8 else torch.enable_grad()
    with context:
        output, _ = layer(hidden)
    (output * upstream).sum().backward()
    grads = {name: param.grad.detach().clone() for name, param in layer.named_parameters()}
    return output.detach(), hidden.grad, grads


def _relative_error(actual, expected):
    return ((actual - expected).norm() / expected.norm()).item()


def _expert_linears(layer):
    return {name: module for name, module in layer.named_modules() if hasattr(module, "fp8_amax_history")}


@pytest.mark.parametrize("fp8,recipe", [("e4m3", "tensorwise"), ("hybrid", "delayed")])
def test_fp8_layer_tracks_fp32_and_grouped_equals_sequential(fp8, recipe):
    hidden, upstream = _inputs()
    common = dict(moe_shared_expert_intermediate_size=32)
    layer = MoELayer(moe_fp8_config(fp8, recipe, **common), init_seed=LAYER_SEED)
    grouped = MoELayer(moe_fp8_config(fp8, recipe, moe_grouped_gemm=True, **common), init_seed=LAYER_SEED)
    grouped.load_state_dict(layer.state_dict())

    fp32_output, fp32_input_grad, fp32_grads = _run(layer, hidden, upstream, fp8=False)
    output, input_grad, grads = _run(layer, hidden, upstream, fp8=True)
    assert _relative_error(output, fp32_output) < FORWARD_FP8_BOUND
    assert _relative_error(input_grad, fp32_input_grad) < BACKWARD_FP8_BOUND
    weight_errors = {name: _relative_error(grads[name], fp32_grads[name]) for name in grads
                     if "linear_fc" in name and name.endswith("weight")}
    assert len(weight_errors) == 2 * 4 + 2  # fc1 and fc2 of four experts and of the shared experts
    assert max(weight_errors.values()) < BACKWARD_FP8_BOUND, weight_errors
    # FP8 was in effect in every expert and the shared experts (their gradients moved off fp32), not the router.
    assert min(weight_errors.values()) > 1e-4, weight_errors
    assert torch.equal(grads["router.weight"] != 0, fp32_grads["router.weight"] != 0)

    grouped_output, grouped_input_grad, grouped_grads = _run(grouped, hidden, upstream, fp8=True)
    assert torch.equal(grouped_output, output) and torch.equal(grouped_input_grad, input_grad)
    assert all(torch.equal(grouped_grads[name], grads[name]) for name in grads)

    if recipe == "delayed":
        linears = _expert_linears(layer)
        assert len(linears) == 2 * 4 + 2
        reduce_fp8_amaxes([layer])
        for name, linear in linears.items():
            # input, weight, output gradient: each recorded once, a positive amax (every expert got tokens)
            assert linear.fp8_amax_recorded_count.tolist() == [1, 1, 1], name
            assert (linear.fp8_amax_history[:, 0] > 0).all(), name
        # The next pass quantizes with the recorded scales: still within the bound, no longer the same numbers.
        second_output = _run(layer, hidden, upstream, fp8=True)[0]
        assert _relative_error(second_output, fp32_output) < FORWARD_FP8_BOUND


def _two_steps(layer, hidden, upstream):
    """Two forward/backward passes with the step's amax reduction between them; the second pass's results."""
    _run(layer, hidden, upstream, fp8=True)
    reduce_fp8_amaxes([layer])
    return _run(layer, hidden, upstream, fp8=True)


def _expert_histories(layer):
    """{checkpoint name of each expert's FP8 amax history: its values}, by global expert index."""
    from megatron.core.expert_parameters import global_expert_name

    return {global_expert_name(name, buffer): buffer.clone() for name, buffer in layer.named_buffers()
            if name.startswith("experts.") and name.endswith("fp8_amax_history")}


def _expert_parallel_equals_single_rank_in_fp8():
    """On 2 ranks, per recipe: the EP=1 layer over all tokens (both ranks alike), then EP=2 with each rank one
    sequence; the largest difference of the second step's output, input gradient and expert gradients, and
    (delayed) of the experts' amax histories, which checkpoints name by global expert index."""
    from megatron.core.dist_checkpointing.model_state import model_sharded_state_dict

    rank = dist.get_rank()
    hidden, upstream = _inputs()
    local = lambda tensor: tensor[:, rank:rank + 1]  # noqa: E731
    diffs = {}
    for recipe in ("delayed", "tensorwise"):
        parallel_state.initialize_model_parallel()
        reference_layer = MoELayer(moe_fp8_config(recipe=recipe), init_seed=LAYER_SEED)
        reference = _two_steps(reference_layer, hidden, upstream)
        reference_histories = _expert_histories(reference_layer)
        parallel_state.destroy_model_parallel()
        parallel_state.initialize_model_parallel(expert_model_parallel_size=2)
        layer = MoELayer(moe_fp8_config(recipe=recipe, expert_model_parallel_size=2), init_seed=LAYER_SEED)
        output, input_grad, grads = _two_steps(layer, local(hidden), local(upstream))
        worst = max((output - local(reference[0])).abs().max().item(),
                    (input_grad - local(reference[1])).abs().max().item())
        histories = _expert_histories(layer)
        if recipe == "delayed":
            saved_names = {name for name in model_sharded_state_dict([layer], for_saving=True)
                           if name.endswith("fp8_amax_history") and name.startswith("experts.")}
            expected_names = {f"experts.local_experts.{index}.linear_fc{fc}.fp8_amax_history"
                              for index in layer.local_expert_indices for fc in (1, 2)}
            diffs["history_names"] = sorted(saved_names ^ expected_names)  # empty: named by global index
            for name, history in histories.items():
                worst = max(worst, ((history - reference_histories[name]).abs().max()
                                    / reference_histories[name].abs().max()).item())
        first = layer.local_expert_indices[0]
        for name, grad in grads.items():
            if name.startswith("experts.local_experts."):
                index, rest = name[len("experts.local_experts."):].split(".", 1)
                expected = reference[2][f"experts.local_experts.{first + int(index)}.{rest}"]
                worst = max(worst, (grad - expected).abs().max().item() / max(expected.abs().max().item(), 1e-12))
        diffs[recipe] = worst
        parallel_state.destroy_model_parallel()
    return diffs


def test_expert_parallel_equals_single_rank_in_fp8():
    for diffs in run_on_ranks(2, _expert_parallel_equals_single_rank_in_fp8):
        assert diffs.pop("history_names") == []
        for recipe, worst in diffs.items():
            assert worst < EXACT_TOLERANCE, (recipe, worst)


FP8_MOE_ITERS = 3
# A 2-layer GPT on byte-level tokens of the bundled corpus, every layer MoE (4 experts, top-2, shared experts,
# grouped GEMM), FP8 hybrid with delayed scaling.
FP8_MOE_GPT = (
    "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 32 "
    "--position-embedding-type rope --normalization RMSNorm --swiglu --hidden-dropout 0 --attention-dropout 0 "
    "--make-vocab-size-divisible-by 64 --micro-batch-size 4 --global-batch-size 8 --lr 1e-2 --min-lr 1e-3 "
    "--lr-decay-style cosine --lr-warmup-iters 1 --seed 1234 --tokenizer-type ByteLevelTokenizer --split 100,0,0 "
    f"--num-workers 0 --log-interval 100 --eval-iters 0 --train-iters {FP8_MOE_ITERS} "
    "--num-experts 4 --moe-router-topk 2 --moe-ffn-hidden-size 48 --moe-shared-expert-intermediate-size 32 "
    "--moe-grouped-gemm --moe-token-dispatcher-type alltoall --moe-aux-loss-coeff 1e-2 "
    "--fp8-format hybrid --fp8-recipe delayed"
)


def _pretrain_fp8_moe(corpus_prefix, metrics):
    """pretrain() of the FP8 MoE GPT; the losses and every FP8 linear's amax counts."""
    import json

    import pretrain_gpt
    from megatron.core.dist_checkpointing.model_state import unwrap_model
    from megatron.core.enums import ModelType
    from megatron.training.training import pretrain

    models = []

    def forward_step(data_iterator, model):
        models.append(model)
        return pretrain_gpt.forward_step(data_iterator, model)

    argv = f"{FP8_MOE_GPT} --data-path {corpus_prefix} --metrics-file {metrics}".split()
    pretrain(pretrain_gpt.train_valid_test_datasets_provider, pretrain_gpt.model_provider,
             ModelType.encoder_or_decoder, forward_step, argv=argv)
    with open(metrics) as records:
        losses = {record["iteration"]: record["lm loss"] for record in map(json.loads, records)}
    model = unwrap_model(models[0])
    counts = {name: module.fp8_amax_recorded_count.tolist() for name, module in model.named_modules()
              if hasattr(module, "fp8_amax_recorded_count")}
    return losses, counts


def test_fp8_moe_gpt_trains_through_pretrain(tmp_path):
    from tests.unit_tests.corpus_data import write_corpus_prefix

    corpus_prefix = write_corpus_prefix(tmp_path, 100)
    losses, counts = run_on_ranks(1, _pretrain_fp8_moe, corpus_prefix, str(tmp_path / "metrics.jsonl"))[0]
    assert sorted(losses) == list(range(1, FP8_MOE_ITERS + 1))
    print(f"FP8 MoE GPT losses: {losses}")
    assert losses[FP8_MOE_ITERS] < losses[1] - 0.3, losses
    expert_linears = [name for name in counts if ".mlp.experts.local_experts." in name]
    shared_linears = [name for name in counts if ".mlp.shared_experts." in name]
    assert len(expert_linears) == 2 * 4 * 2 and len(shared_linears) == 2 * 2  # 2 layers x (4 experts + shared)
    for name, recorded in counts.items():  # one record per optimizer step, every FP8 linear
        assert recorded == [FP8_MOE_ITERS] * 3, (name, recorded)
