"""`--fp8-param-gather` with the distributed optimizer on 4 ranks (TP=2 x DP=2): the gathered FP8 weights equal
the quantized fp32 main weights with one scale agreed by all shards, the FP8 weights are all-gathered as one
byte per element, and training matches FP8 training without it."""

import pytest
import torch
import torch.distributed as dist

from tests.unit_tests.multiprocess_harness import run_on_ranks

STEPS = 3
# Same FP8 computation on different code paths (gathered bytes vs quantizing in the layer): summation order only.
PARITY_TOLERANCE = 1e-5


def _build(fp8_param_gather):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.transformer_block import TransformerBlock
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=3, hidden_size=32, num_attention_heads=2, tensor_model_parallel_size=2, hidden_dropout=0.0,
        attention_dropout=0.0, init_seed=5, fp8="hybrid", fp8_recipe="tensorwise", fp8_param=fp8_param_gather,
        first_last_layers_bf16=True, num_layers_at_start_in_bf16=1, num_layers_at_end_in_bf16=0,
    )
    block = TransformerBlock(config)
    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=True, overlap_grad_reduce=True,
                                               overlap_param_gather=True, fp8_param_gather=fp8_param_gather)
    ddp = DistributedDataParallel(config, ddp_config, block)
    optimizer = get_megatron_optimizer(OptimizerConfig(lr=0.05, use_distributed_optimizer=True), [ddp])
    return config, block, ddp, optimizer


def _train(ddp, optimizer, gathers):
    from megatron.core import parallel_state
    from megatron.core.distributed import finalize_model_grads

    dp_rank = parallel_state.get_data_parallel_rank()
    losses = []
    for step in range(STEPS):
        generator = torch.Generator().manual_seed(100 * step + dp_rank)
        hidden = torch.randn(8, 2, 32, generator=generator)
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        gathers.append("step")
        loss = ddp(hidden).square().mean()
        loss.backward()
        finalize_model_grads([ddp])
        optimizer.step()
        reduced = loss.detach().clone()
        dist.all_reduce(reduced)
        losses.append(reduced.item() / dist.get_world_size())
    return losses


def _counting(gathers):
    original = dist.all_gather_into_tensor

    def counting_all_gather(output, input_, *args, **kwargs):
        gathers.append((str(output.dtype), output.numel() * output.element_size()))
        return original(output, input_, *args, **kwargs)

    return original, counting_all_gather


def _param_gather_on_ranks():
    from megatron.core import fp8_utils, parallel_state
    from megatron.core.fp8.params import fp8_weight_params

    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    model_parallel_cuda_manual_seed(11)
    results = {}
    runs = {}
    for fp8_param_gather in (False, True):
        gathers = []
        original, counting = _counting(gathers)
        dist.all_gather_into_tensor = counting
        try:
            config, block, ddp, optimizer = _build(fp8_param_gather)
            losses = _train(ddp, optimizer, gathers)
            ddp.finish_param_sync()
        finally:
            dist.all_gather_into_tensor = original
        runs[fp8_param_gather] = (config, block, ddp, optimizer, losses, gathers)

    config, block, ddp, optimizer, losses, gathers = runs[True]
    results["losses"] = (runs[False][4], losses)
    weights = fp8_weight_params(block, config)
    results["num_fp8_weights"] = len(weights)
    results["first_layer_excluded"] = all(not hasattr(p, "fp8_weight") for p in block.layers[0].parameters())

    # Gathered FP8 weights against the fp32 main weights quantized with the amax of the whole (TP x DP) weight.
    index_of = {id(param): index for index, param in enumerate(optimizer.model_params())}
    param_states = optimizer.gathered_state_dict()["param_states"]
    tp_group = parallel_state.get_tensor_model_parallel_group()
    scales = []
    for weight in weights:
        main = param_states[index_of[id(weight)]]["main_param"]
        amax = main.abs().max().reshape(1)
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=tp_group)
        expected = fp8_utils.quantize(main, torch.float8_e4m3fn, fp8_utils.scale_from_amax(amax[0], torch.float8_e4m3fn))
        assert fp8_utils.is_float8tensor(weight.fp8_weight) and weight.fp8_weight.dtype == torch.float8_e4m3fn
        assert torch.equal(weight.fp8_weight.data.view(torch.uint8), expected.data.view(torch.uint8))
        assert torch.equal(weight.fp8_weight.scale, expected.scale)
        assert torch.equal(weight.detach(), expected.dequantize())
        scales.append(float(weight.fp8_weight.scale))
    results["scales"] = scales

    # Weights loaded into the model (a checkpoint without optimizer state): reload_model_params() requantizes.
    with torch.no_grad():
        for weight in weights:
            weight.mul_(0.5)
    optimizer.reload_model_params()
    for weight, scale in zip(weights, scales):
        assert float(weight.fp8_weight.scale) == pytest.approx(2 * scale, rel=1e-6)

    # Bytes all-gathered per step (after the start-up gather, before the first "step" marker).
    def per_step(gather_log):
        first_step = gather_log.index("step")
        step_log = gather_log[first_step + 1:gather_log.index("step", first_step + 1)]
        return {dtype: sum(size for d, size in step_log if d == dtype) for dtype in {d for d, _ in step_log}}

    results["bytes_with"] = per_step(gathers)
    results["bytes_without"] = per_step(runs[False][5])
    results["fp8_elements"] = sum(weight.numel() for weight in weights)
    results["all_elements"] = sum(param.numel() for param in block.parameters())
    return results


def test_fp8_param_gather_with_tensor_and_data_parallelism():
    results = run_on_ranks(4, _param_gather_on_ranks)
    for rank_results in results:
        without, with_gather = rank_results["losses"]
        assert with_gather == pytest.approx(without, abs=PARITY_TOLERANCE)
        assert without[-1] < without[0]  # it trains
        assert rank_results["num_fp8_weights"] == 2 * 4  # layers 2 and 3: qkv, proj, fc1, fc2
        assert rank_results["first_layer_excluded"]
        # FP8 weights: one byte per element (their shard elements, padded to a multiple of DP=2); everything else
        # in fp32, the same bytes as the run without FP8 parameters minus 4 bytes per FP8 element.
        fp8_bytes = rank_results["bytes_with"]["torch.uint8"]
        assert fp8_bytes - rank_results["fp8_elements"] in (0, 1)
        fp32_without = rank_results["bytes_without"]["torch.float32"]
        assert set(rank_results["bytes_without"]) == {"torch.float32"}
        assert fp32_without - (rank_results["bytes_with"]["torch.float32"] + 4 * fp8_bytes) in (0, -4, -8)
    # Every rank (TP shards and DP replicas) uses the same scale for each weight.
    assert all(r["scales"] == results[0]["scales"] for r in results)
