"""The step's FP8 weight cache under Megatron-FSDP ZeRO-3 (`optim_grads_params`) at DP=2, where every microbatch
gathers the weights again before its forward and its backward and releases them after.

- Each FP8 linear weight is quantized once per optimizer step, as under a wrapper that keeps the weights: the
  gathers rewrite the same values into the same storage, which the cache (keyed on the weight's version counter
  and storage) sees as unchanged.
- Loading a state dict writes the weights behind the parameters (into Megatron-FSDP's buffers): the next forward
  quantizes the loaded weights, not the cached ones, and computes what a fresh quantization computes.
"""

import types

import torch

from tests.unit_tests.multiprocess_harness import run_on_ranks

MICROBATCHES = 4
STEPS = 3


def _fp8_linears(chunk):
    from megatron.core.tensor_parallel.layers import _Fp8LinearMixin

    return [module for module in chunk.modules() if isinstance(module, _Fp8LinearMixin)
            and module._fp8_scaling is not None]


def _weight_cache_on_ranks():
    import megatron_fsdp.collectives as fsdp_collectives

    from megatron.core import fp8_utils
    from megatron.core.fp8.scaling import ScalingState
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.training.model_setup import install_schedule_hooks
    from tests.unit_tests.pipeline_parallel.test_gpt_pipeline import _forward_step
    from tests.unit_tests.test_fp8_fsdp_param_gather import _batches, _build

    _, chunk = _build(1, fp8_param_gather=False)
    # this model's units are small enough for the schedule to keep them gathered from their forward to their
    # backward (coalesce_gather_bytes): gather them again for each use, the case this test is about
    chunk.module.schedule.coalesce_gather_bytes = 0
    optimizer = get_megatron_optimizer(OptimizerConfig(lr=3e-3, clip_grad=1.0), [chunk])
    install_schedule_hooks([chunk], optimizer, types.SimpleNamespace(fp16=False))
    quantized, gathers = [], []
    original_quantize, original_gather = ScalingState.quantize, fsdp_collectives.all_gather_pieces_in_place

    def counting_quantize(self, tensor, with_transpose=False):
        quantized.append(self)
        return original_quantize(self, tensor, with_transpose)

    def counting_gather(*args, **kwargs):
        gathers.append(1)
        return original_gather(*args, **kwargs)

    def weight_quantizations():
        weights = {id(layer._fp8_scaling.weight) for layer in _fp8_linears(chunk)}
        return sum(id(state) in weights for state in quantized)

    batch = _batches(0)[0]

    def forward():
        return chunk(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])

    ScalingState.quantize, fsdp_collectives.all_gather_pieces_in_place = counting_quantize, counting_gather
    try:
        per_step = []
        for step in range(STEPS):
            quantized.clear()
            gathers.clear()
            chunk.zero_grad_buffer()
            optimizer.zero_grad()
            get_forward_backward_func()(
                forward_step_func=_forward_step, data_iterator=iter(_batches(step) * MICROBATCHES), model=[chunk],
                num_microbatches=MICROBATCHES, seq_length=batch["tokens"].shape[1],
                micro_batch_size=batch["tokens"].shape[0])
            per_step.append((weight_quantizations(), len(gathers)))
            fp8_utils.reduce_fp8_amaxes([chunk])  # the training loop's step hook, before the optimizer step
            assert optimizer.step()[0]

        # A forward caches the weights; a load then writes other values into the same storage.
        forward().sum().backward()
        loaded = {key: (value.full_tensor() if hasattr(value, "full_tensor") else value).clone()
                  for key, value in chunk.state_dict().items() if torch.is_tensor(value)}
        for key in loaded:
            if key.endswith("mlp.linear_fc1.weight"):
                loaded[key] = loaded[key] * 0.5
        chunk.load_state_dict(loaded)
        quantized.clear()
        after_load = forward().detach()
        after_load_quantizations = weight_quantizations()
        fp8_utils.reduce_fp8_amaxes([chunk])  # a fresh start: every weight quantized again
        fresh = forward().detach()
    finally:
        ScalingState.quantize, fsdp_collectives.all_gather_pieces_in_place = original_quantize, original_gather
    return per_step, len(_fp8_linears(chunk)), after_load_quantizations, torch.equal(after_load, fresh)


def test_fsdp_z3_quantizes_each_fp8_weight_once_per_step_and_after_a_load():
    for per_step, fp8_weights, after_load_quantizations, load_matches_fresh in run_on_ranks(2, _weight_cache_on_ranks):
        assert fp8_weights == 4  # the linears of the one transformer layer in FP8 (layer 0 stays in bf16)
        for step, (quantizations, gathers) in enumerate(per_step[1:], start=2):
            # The weights are gathered again for every microbatch's forward and backward ...
            assert gathers >= 2 * MICROBATCHES, (step, per_step)
            # ... yet each is quantized once in the step (the first step runs before the loop's step hook).
            assert quantizations == fp8_weights, (step, per_step)
        assert after_load_quantizations == fp8_weights
        assert load_matches_fresh
