"""Rank bodies shared by the post-training tests: a tiny GPTModel quantized through modelopt's Megatron plugin
under one tensor-parallel layout, with what the tests compare (logits, loss, every quantizer's amax)."""

import torch
import torch.distributed as dist

from megatron.core import parallel_state
from tests.unit_tests.models.gpt.gpt_test_utils import fixed_batch, seeded_model, tiny_config
from tests.unit_tests.post_training.modelopt_plugins import import_modelopt_plugins

CALIBRATION_SEEDS = (11, 12)
EVAL_SEED = 21
SEQ = 16  # divisible by TP2 for sequence parallelism


def calibration_batches():
    return [fixed_batch(seed=seed, seq=SEQ) for seed in CALIBRATION_SEEDS]


def quantized_tiny_gpt(quant_cfg, tp, sequence_parallel=False):
    """A seeded tiny GPTModel (weights independent of the layout) quantized with `quant_cfg` and calibrated on
    the same batches on every rank."""
    from megatron.core.extensions import modelopt as modelopt_support

    import_modelopt_plugins()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    model = seeded_model(tiny_config(tp=tp, sequence_parallel=sequence_parallel), max_sequence_length=SEQ)

    def forward_loop(quantized):
        with torch.no_grad():
            for tokens, _, positions in calibration_batches():
                quantized(tokens, positions)

    modelopt_support.quantize(model, quant_cfg, forward_loop)
    return model


def _gather_over_tensor_parallel(tensor):
    group = parallel_state.get_tensor_model_parallel_group()
    pieces = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(pieces, tensor.contiguous(), group=group)
    return pieces


def amaxes_by_quantizer(model):
    """{quantizer name: [amax of each tensor-parallel rank]} for every calibrated quantizer."""
    from modelopt.torch.quantization.nn import TensorQuantizer

    amaxes = {}
    for name, module in model.named_modules():
        if isinstance(module, TensorQuantizer) and module.is_enabled and module.amax is not None:
            amaxes[name] = [piece.clone() for piece in _gather_over_tensor_parallel(module.amax.float())]
    return amaxes


def layout_outcome(quant_cfg, tp, sequence_parallel=False):
    """Logits and loss of the quantized model on an evaluation batch, its amaxes, and its quantized modules."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    model = quantized_tiny_gpt(quant_cfg, tp, sequence_parallel)
    tokens, labels, positions = fixed_batch(seed=EVAL_SEED, seq=SEQ)
    with torch.no_grad():
        logits = model(tokens, positions)
        loss = model(tokens, positions, labels=labels).mean()
    parallel_linears = {name: type(module).__mro__[1].__name__ for name, module in model.named_modules()
                        if isinstance(module, (ColumnParallelLinear, RowParallelLinear))}
    outcome = {"logits": logits, "loss": loss.item(), "amaxes": amaxes_by_quantizer(model),
               "parallel_linears": parallel_linears}
    parallel_state.destroy_model_parallel()
    return outcome


def ptq_across_layouts(quant_cfgs):
    """For each config: the outcome at TP1, TP2 and TP2 with sequence parallelism (2 ranks), and the model's
    loss before quantization at TP1."""
    results = {}
    for quant_cfg in quant_cfgs:
        results[quant_cfg] = {
            "tp1": layout_outcome(quant_cfg, 1),
            "tp2": layout_outcome(quant_cfg, 2),
            "tp2_sp": layout_outcome(quant_cfg, 2, sequence_parallel=True),
        }
    parallel_state.initialize_model_parallel()
    model = seeded_model(tiny_config(), max_sequence_length=SEQ)
    tokens, labels, positions = fixed_batch(seed=EVAL_SEED, seq=SEQ)
    with torch.no_grad():
        results["unquantized"] = {"logits": model(tokens, positions),
                                  "loss": model(tokens, positions, labels=labels).mean().item()}
    parallel_state.destroy_model_parallel()
    return results


def _moe_layout(tp):
    """Unquantized and FP8-quantized logits of a tiny MoE GPT (4 experts, top-2; MoE with TP needs sequence
    parallelism) and the class names under its experts."""
    from megatron.core.extensions import modelopt as modelopt_support

    import_modelopt_plugins()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    config = tiny_config(tp=tp, num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32,
                         sequence_parallel=tp > 1)
    model = seeded_model(config, max_sequence_length=SEQ)
    tokens, _, positions = fixed_batch(seed=EVAL_SEED, seq=SEQ)
    with torch.no_grad():
        unquantized = model(tokens, positions)

    def forward_loop(quantized):
        with torch.no_grad():
            for calibration_tokens, _, calibration_positions in calibration_batches():
                quantized(calibration_tokens, calibration_positions)

    modelopt_support.quantize(model, "fp8", forward_loop)
    with torch.no_grad():
        quantized_logits = model(tokens, positions)
    experts = {name: type(module).__name__ for name, module in model.named_modules()
               if name.endswith(("mlp.experts", "linear_fc1", "linear_fc2")) and ".experts" in name}
    parallel_state.destroy_model_parallel()
    return {"unquantized": unquantized, "quantized": quantized_logits, "experts": experts}


def moe_ptq_across_layouts():
    return {"tp1": _moe_layout(1), "tp2_sp": _moe_layout(2)}
