"""Selective recompute of `--recompute-modules` (core_attn, mlp, moe, shared_experts, layernorm, moe_act,
mla_up_proj): each gives the loss and gradients of a run without recompute (fp32, with dropout), keeps fewer
bytes for backward (by at least what the module's recompute drops), runs the module's forward again in backward;
also under tensor and sequence parallelism; the config rules name the flags; and a MoE `pretrain()` run on two
ranks trains the same losses."""

import contextlib
import functools

import pytest
import torch

from megatron.core.transformer import recompute
from megatron.core.transformer.transformer_config import TransformerConfig
from tests.unit_tests.models.gpt.gpt_test_utils import (
    MICRO_BATCH_SIZE,
    SEQ_LENGTH,
    fixed_batch,
    loss_and_grads,
    seeded_model,
)
from tests.unit_tests.multiprocess_harness import run_on_ranks

HIDDEN, FFN, MOE_FFN, SHARED_FFN, EXPERTS, TOPK = 32, 64, 48, 40, 4, 2
DROPOUT = 0.1
TOKENS = SEQ_LENGTH * MICRO_BATCH_SIZE
FLOAT = 4  # bytes
BASE = dict(num_layers=2, hidden_size=HIDDEN, num_attention_heads=4, ffn_hidden_size=FFN, gated_linear_unit=True,
            hidden_dropout=DROPOUT, attention_dropout=DROPOUT)
MOE = dict(num_moe_experts=EXPERTS, moe_router_topk=TOPK, moe_ffn_hidden_size=MOE_FFN, moe_layer_freq=[0, 1],
           moe_shared_expert_intermediate_size=SHARED_FFN)
MLA = dict(multi_latent_attention=True, q_lora_rank=10, kv_lora_rank=12, qk_head_dim=6, qk_pos_emb_head_dim=4,
           v_head_dim=10)
MODELS = {"dense": {}, "moe": MOE, "moe_grouped_gemm": dict(MOE, moe_grouped_gemm=True), "mla": MLA,
          "mla_moe": dict(MLA, **MOE)}
# The activations whose bytes each module's recompute drops, at the least (per model, both layers together):
# checkpoints keep no intermediate, output-dropping recompute keeps not even the outputs.
MLA_QUERY = TOKENS * 4 * (6 + 4)  # one layer's [s, b, heads, d_n + d_r] query (the key and value come on top)
AT_LEAST_DROPPED = {
    "core_attn": TOKENS * HIDDEN * 2,  # the attention output of each layer (its softmax and mask on top)
    "mlp": TOKENS * FFN * 2,  # fc1's output (gate and up) of the one dense layer
    "moe": TOKENS * HIDDEN * 4,  # the router's and the dispatcher's tokens (and the experts') of the MoE layer
    "shared_experts": TOKENS * SHARED_FFN * 2,  # their fc1 output
    "layernorm": TOKENS * HIDDEN * 4,  # both norms' outputs, both layers
    "moe_act": TOKENS * TOPK * MOE_FFN,  # the activation's output (fc2's input) of the routed tokens
    "mla_up_proj": MLA_QUERY * 2,  # the queries of both layers
}
CASES = [
    ("dense", ("core_attn",)), ("dense", ("mlp",)), ("dense", ("layernorm",)), ("moe", ("moe",)),
    ("moe", ("shared_experts",)), ("moe", ("moe_act",)), ("moe_grouped_gemm", ("moe_act",)), ("moe", ("layernorm",)),
    ("mla", ("mla_up_proj",)),
    # Combinations: the norm inside the MLP's checkpoint, the up projections inside core attention's.
    ("dense", ("layernorm", "mlp")), ("moe", ("layernorm", "moe")), ("mla", ("mla_up_proj", "core_attn")),
    ("mla_moe", ("mla_up_proj", "moe_act", "layernorm", "core_attn", "mlp", "shared_experts")),
]


@contextlib.contextmanager
def kept_bytes():
    """{storage pointer: bytes} of what autograd keeps for backward during the block: tensors saved outside any
    recompute region (a saved-tensor hook), those an output-dropping region lets through as they are, and the
    inputs checkpoints and output-dropping regions hold. Parameters are not counted."""
    kept = {}

    def record(tensor):
        if isinstance(tensor, torch.Tensor) and not isinstance(tensor, torch.nn.Parameter) and tensor.numel():
            kept[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    original_pack, original_init, original_checkpoint = (recompute._DroppedOutputs.pack,
                                                         recompute._DroppedOutputs.__init__, recompute.checkpoint)

    def pack(state, tensor):
        return record(original_pack(state, tensor))

    def init(state, function, inputs):
        [record(tensor) for tensor in inputs]
        original_init(state, function, inputs)

    def checkpoint(function, *args, **kwargs):
        [record(arg) for arg in args]
        return original_checkpoint(function, *args, **kwargs)

    recompute._DroppedOutputs.pack, recompute._DroppedOutputs.__init__, recompute.checkpoint = pack, init, checkpoint
    try:
        with torch.autograd.graph.saved_tensors_hooks(record, lambda tensor: tensor):
            yield kept
    finally:
        recompute._DroppedOutputs.pack, recompute._DroppedOutputs.__init__ = original_pack, original_init
        recompute.checkpoint = original_checkpoint


def _without_params(kept, model):
    params = {param.untyped_storage().data_ptr() for param in model.parameters()}
    return sum(nbytes for pointer, nbytes in kept.items() if pointer not in params)


def _count_forwards(model):
    """{module name: forward calls} of every module whose forward recompute may run again."""
    counts = {}
    for name, module in model.named_modules():
        if name.endswith(("input_layernorm", "pre_mlp_layernorm", "linear_fc1", "linear_q_up_proj",
                          "linear_kv_up_proj", "router", "shared_experts")):
            counts[name] = 0
            module.register_forward_pre_hook(lambda module, args, _name=name: counts.__setitem__(_name,
                                                                                                 counts[_name] + 1))
    return counts


@functools.cache
def _train(model_name, modules=None):
    """(per-token loss, gradients, kept bytes, forward calls) of one forward and backward."""
    recompute_fields = {} if modules is None else dict(recompute_granularity="selective", recompute_modules=modules)
    config = TransformerConfig(**BASE, **MODELS[model_name], **recompute_fields)
    model = seeded_model(config)
    counts = _count_forwards(model)
    tokens, labels, position_ids = fixed_batch()
    with kept_bytes() as kept:
        loss = model(tokens, position_ids, labels=labels)
    kept = _without_params(kept, model)
    model.zero_grad(set_to_none=True)
    loss.sum().backward()
    grads = {name: param.grad.detach().clone() for name, param in model.named_parameters()}
    return loss.detach(), grads, kept, counts


@pytest.mark.parametrize("model_name, modules", CASES, ids=[f"{m}-{'+'.join(mods)}" for m, mods in CASES])
def test_recompute_modules_match_no_recompute_and_keep_less(model_name, modules):
    plain_loss, plain_grads, plain_kept, plain_counts = _train(model_name)
    loss, grads, kept, counts = _train(model_name, modules)
    assert torch.equal(loss, plain_loss)
    assert grads.keys() == plain_grads.keys()
    for name, grad in plain_grads.items():
        assert torch.allclose(grads[name], grad, rtol=0, atol=1e-6), name
    at_least = sum(AT_LEAST_DROPPED[name] for name in modules) * FLOAT
    assert plain_kept - kept >= at_least, (plain_kept, kept, at_least)
    # The recomputed modules ran their forward again in backward; nothing else did.
    assert {name for name in counts if counts[name] != plain_counts[name]} == {
        name for name in counts if _recomputed_by(name, modules) and plain_counts[name]}
    assert all(counts[name] in (plain_counts[name], 2 * plain_counts[name]) for name in counts)


def _recomputed_by(name, modules):
    """Whether recomputing `modules` runs the module `name` (one `_count_forwards` counts) again."""
    last = name.split(".")[-1]
    if last in ("shared_experts", "router"):  # shared_experts checkpoints inside the module's forward
        return "moe" in modules
    if "shared_experts" in name:
        return "moe" in modules or ("shared_experts" in modules and "shared_experts" in name)
    return (("layernorm" in modules and last in ("input_layernorm", "pre_mlp_layernorm"))
            or ("mla_up_proj" in modules and last in ("linear_q_up_proj", "linear_kv_up_proj"))
            or ("mlp" in modules and name.endswith(".mlp.linear_fc1")))


def _tensor_parallel_losses_and_grads(model_name, modules):
    from megatron.core import parallel_state
    from tests.unit_tests.models.gpt.gpt_test_utils import full_grads

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    try:
        results = []
        for fields in ({}, dict(recompute_granularity="selective", recompute_modules=modules)):
            config = TransformerConfig(**BASE, **MODELS[model_name], tensor_model_parallel_size=2,
                                       sequence_parallel=True, **fields)
            model = seeded_model(config)
            tokens, labels, position_ids = fixed_batch()
            loss = model(tokens, position_ids, labels=labels)
            loss.sum().backward()
            results.append((loss.detach(), full_grads(model)))
        return results
    finally:
        parallel_state.destroy_model_parallel()


@pytest.mark.world_size(2)
def test_recompute_modules_with_tensor_and_sequence_parallel():
    """The recomputed up projections and experts run their tensor-parallel collectives again in backward."""
    modules = ("mla_up_proj", "moe_act", "layernorm", "core_attn", "mlp", "shared_experts")
    for (plain_loss, plain_grads), (loss, grads) in run_on_ranks(2, _tensor_parallel_losses_and_grads, "mla_moe",
                                                                 modules):
        assert torch.equal(loss, plain_loss)
        assert grads.keys() == plain_grads.keys()
        assert all(torch.allclose(grads[name], grad, rtol=0, atol=1e-6) for name, grad in plain_grads.items())


def test_dropout_changes_the_loss():
    """The comparisons above run with dropout: the recompute must replay it."""
    config = TransformerConfig(**BASE)
    model = seeded_model(config)
    train_loss, _ = loss_and_grads(model, fixed_batch())
    model.eval()
    with torch.no_grad():
        tokens, labels, position_ids = fixed_batch()
        eval_loss = model(tokens, position_ids, labels=labels)
    assert (train_loss - eval_loss).abs().max() > 1e-3


def test_output_recomputed_in_backward_drops_the_outputs_and_gives_the_same_gradients():
    torch.manual_seed(0)
    hidden = torch.randn(6, 8, requires_grad=True)
    norm = torch.nn.LayerNorm(8)
    weight = torch.randn(8, 8, requires_grad=True)
    calls = []

    def normalised(tensor):
        calls.append(torch.is_grad_enabled())
        return norm(tensor)

    def grads():
        values = [tensor.grad.clone() for tensor in (hidden, weight, norm.weight, norm.bias)]
        hidden.grad = weight.grad = norm.weight.grad = norm.bias.grad = None
        return values

    plain = (normalised(hidden) @ weight).tanh()
    plain.sum().backward()
    plain_grads = grads()
    calls.clear()
    with kept_bytes() as kept:
        output, consumer = recompute.output_recomputed_in_backward(normalised, hidden)
        with consumer:
            result = (output @ weight).tanh()
    assert output.untyped_storage().data_ptr() not in kept  # the matmul's saved input was replaced by a marker
    del output
    result.sum().backward()  # the norm's own parameters get their gradients in the recomputed graph's backward
    assert torch.equal(result, plain)
    assert all(torch.equal(a, b) for a, b in zip(grads(), plain_grads))
    assert calls == [False, True]  # unrecorded in forward, recomputed (recording) once in backward


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(recompute_modules=("attention",)), r"--recompute-modules: unknown attention; choose from core_attn"),
        (dict(recompute_modules=("mlp",)), r"--recompute-modules mlp only applies to --recompute-granularity "
                                           r"selective"),
        (dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1,
              recompute_modules=("layernorm",)), r"--recompute-modules layernorm only applies to "
                                                 r"--recompute-granularity selective \(got 'full'\)"),
        (dict(recompute_modules=("moe",)), r"--recompute-modules moe .* needs --num-experts"),
        (dict(recompute_modules=("moe_act",)), r"--recompute-modules moe_act .* needs --num-experts"),
        (dict(recompute_modules=("mla_up_proj",)), r"--recompute-modules mla_up_proj needs --multi-latent-attention"),
        (dict(MOE, moe_shared_expert_intermediate_size=None, recompute_modules=("shared_experts",)),
         r"--recompute-modules shared_experts needs shared experts \(--moe-shared-expert-intermediate-size\)"),
        (dict(MOE, moe_shared_expert_overlap=True, moe_token_dispatcher_type="alltoall",
              recompute_modules=("shared_experts",)),
         r"--recompute-modules shared_experts does not work with --moe-shared-expert-overlap"),
        (dict(MOE, recompute_modules=("moe", "moe_act")), r"--recompute-modules moe recomputes the whole MoE layer, "
                                                          r"which includes --recompute-modules moe_act: drop moe_act"),
        (dict(MOE, moe_layer_recompute=True, recompute_modules=("shared_experts",)),
         r"--moe-layer-recompute recomputes the whole MoE layer, .* drop shared_experts"),
        (dict(fp8="hybrid", fp8_recipe="delayed", recompute_modules=("layernorm", "mlp")),
         r"--fp8-recipe delayed does not support --recompute-modules mlp: .* use --fp8-recipe tensorwise or drop mlp"),
    ],
)
def test_config_rules_name_the_flags(fields, message):
    fields = dict(fields)
    granularity = fields.pop("recompute_granularity", "selective" if "mlp" not in fields["recompute_modules"]
                             or len(fields["recompute_modules"]) > 1 else None)
    with pytest.raises(ValueError, match=message):
        TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, recompute_granularity=granularity,
                          **fields)


def test_defaults_and_normalisation():
    config = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4)
    assert config.recompute_modules == ("core_attn",) and not config.recomputes("core_attn")
    selective = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4,
                                  recompute_granularity="selective", recompute_modules=["layernorm", "mlp", "mlp"])
    assert selective.recompute_modules == ("layernorm", "mlp") and selective.recomputes("mlp")
    assert not selective.recomputes("core_attn")  # the list replaces the default, as upstream
    none = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, recompute_granularity="selective",
                             recompute_modules=None)
    assert none.recompute_modules == ("core_attn",)


def test_flags_reach_the_transformer_config():
    from megatron.training.model_config import core_transformer_config_from_args
    from tests.unit_tests.training.test_arguments import validated

    config = core_transformer_config_from_args(validated(
        "--recompute-granularity selective --recompute-modules layernorm core_attn"))
    assert (config.recompute_granularity, config.recompute_modules) == ("selective", ("layernorm", "core_attn"))
    shorthand = core_transformer_config_from_args(validated("--recompute-activations"))
    assert (shorthand.recompute_granularity, shorthand.recompute_modules) == ("selective", ("core_attn",))
    with pytest.raises(ValueError, match="--recompute-modules layernorm only applies to --recompute-granularity "
                                         "selective"):
        core_transformer_config_from_args(validated("--recompute-modules layernorm"))


PRETRAIN_MOE = ("--train-iters 4 --lr-decay-iters 4 --num-experts 4 --moe-router-topk 2 --moe-ffn-hidden-size 48 "
                "--moe-shared-expert-intermediate-size 32 --moe-grouped-gemm --expert-model-parallel-size 2 "
                "--moe-layer-freq [0,1,1,1]")
RECOMPUTE = "--recompute-granularity selective --recompute-modules core_attn layernorm moe_act shared_experts mlp"


def _pretrain_losses(workdir, wrapper_flags=""):
    import pretrain_gpt
    from megatron.core.transformer.transformer_layer import TransformerLayer
    from tests.unit_tests.dist_checkpointing.pretrain_helpers import run_pretrain

    configs = set()

    def forward_step(data_iterator, model):
        layer = next(module for module in model.modules() if isinstance(module, TransformerLayer))
        configs.add((layer.config.recompute_granularity, layer.config.recompute_modules))
        return pretrain_gpt.forward_step(data_iterator, model)

    recomputed = run_pretrain(workdir, f"{PRETRAIN_MOE} {wrapper_flags} {RECOMPUTE}", forward_step)
    return run_pretrain(workdir, f"{PRETRAIN_MOE} {wrapper_flags}"), recomputed, configs


# Megatron-FSDP ZeRO-3 gathers, releases and reduces per unit from hooks: the regions that recompute in an inner
# backward must still hand it every gradient.
@pytest.mark.world_size(2)
@pytest.mark.parametrize("wrapper_flags",
                         ["", "--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params"])
def test_moe_pretrain_trains_the_same_losses(tmp_path, wrapper_flags):
    for plain, recomputed, configs in run_on_ranks(2, _pretrain_losses, str(tmp_path), wrapper_flags):
        assert configs == {("selective", ("core_attn", "layernorm", "moe_act", "shared_experts", "mlp"))}
        assert sorted(plain) == [1, 2, 3, 4] and recomputed == plain  # exact


def test_delayed_fp8_refuses_moe_layer_recompute_as_it_refuses_the_moe_module():
    with pytest.raises(ValueError, match=r"--fp8-recipe delayed does not support --moe-layer-recompute: .* use "
                                         r"--fp8-recipe tensorwise or drop --moe-layer-recompute"):
        TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, fp8="hybrid", fp8_recipe="delayed",
                          moe_layer_recompute=True, **MOE)
    TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, fp8="hybrid", fp8_recipe="tensorwise",
                      moe_layer_recompute=True, **MOE)  # current scaling recomputes identically
