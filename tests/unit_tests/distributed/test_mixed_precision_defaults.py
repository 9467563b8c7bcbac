"""Upstream's mixed-precision defaults: under `--bf16` gradients accumulate and are reduced in fp32 (Megatron DDP,
the distributed optimizer, FSDP2's reduce dtype) unless `--grad-reduce-in-bf16`; FSDP2 keeps fp32 shards and
computes in bf16; the optimizers read fp32 main gradients without copying them."""

import types

import pytest
import torch
import torch.distributed as dist

from megatron.training.arguments import parse_args, validate_args
from tests.unit_tests.multiprocess_harness import run_on_ranks

BASE = (
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --micro-batch-size 2 "
    "--train-iters 10 --lr 1e-3 --mock-data --vocab-size 128"
)
MICROBATCHES = 6


def _validated(extra, world_size=1):
    import os

    os.environ.update({"WORLD_SIZE": str(world_size), "RANK": "0"})
    return validate_args(parse_args(args=(BASE + " " + extra).split()))


@pytest.fixture
def single_process_env(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")


def test_bf16_accumulates_and_reduces_in_fp32_unless_opted_out(single_process_env):
    assert _validated("--bf16").accumulate_allreduce_grads_in_fp32
    assert not _validated("--bf16 --grad-reduce-in-bf16").accumulate_allreduce_grads_in_fp32
    assert not _validated("").accumulate_allreduce_grads_in_fp32
    fsdp = _validated("--bf16 --grad-reduce-in-bf16 --use-megatron-fsdp")
    assert fsdp.megatron_fsdp_grad_comm_dtype == "bf16"
    # An explicit half-precision Megatron-FSDP reduction is the user's choice, not overridden.
    explicit = _validated("--bf16 --use-megatron-fsdp --megatron-fsdp-grad-comm-dtype bf16")
    assert not explicit.accumulate_allreduce_grads_in_fp32


@pytest.mark.parametrize(
    "extra, message",
    [
        ("--grad-reduce-in-bf16", r"--grad-reduce-in-bf16 needs --bf16"),
        ("--bf16 --grad-reduce-in-bf16 --accumulate-allreduce-grads-in-fp32",
         r"--grad-reduce-in-bf16 and --accumulate-allreduce-grads-in-fp32 are exclusive"),
    ],
)
def test_gradient_precision_rules_name_the_flags(single_process_env, extra, message):
    with pytest.raises(ValueError, match=message):
        _validated(extra)


def _microbatch_input(rank, index):
    # Magnitudes spread over several binades, so that bf16 accumulation rounds visibly.
    generator = torch.Generator().manual_seed(100 * rank + index)
    return (torch.randn(4, 16, generator=generator) * (1.0 + 3.0 * index)).to(torch.bfloat16)


def _bf16_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 8)).to(torch.bfloat16)


def _ddp_grads_from_flags(extra, use_distributed_optimizer):
    """Main gradients of a bf16 model after MICROBATCHES microbatches on DP2, with the DDP config the command
    line gives, and the exact reference (every microbatch's bf16 gradient summed in fp64, averaged over DP)."""
    from megatron.core.distributed import DistributedDataParallel
    from megatron.training.model_config import ddp_config_from_args

    rank, world = dist.get_rank(), dist.get_world_size()
    flags = "--bf16 " + extra + (" --use-distributed-optimizer" if use_distributed_optimizer else "")
    args = _validated(flags, world_size=world)
    args.data_parallel_size = world
    model = _bf16_model()
    reference = {name: torch.zeros(p.shape, dtype=torch.float64) for name, p in model.named_parameters()}
    plain = _bf16_model()
    for source_rank in range(world):
        for index in range(MICROBATCHES):
            plain.zero_grad()
            plain(_microbatch_input(source_rank, index)).float().square().sum().backward()
            for name, param in plain.named_parameters():
                reference[name] += param.grad.double() / world
    ddp = DistributedDataParallel(types.SimpleNamespace(), ddp_config_from_args(args), model)
    ddp.zero_grad_buffer()
    for index in range(MICROBATCHES):
        last = index == MICROBATCHES - 1
        if last:
            ddp(_microbatch_input(rank, index)).float().square().sum().backward()
        else:
            with ddp.no_sync():
                ddp(_microbatch_input(rank, index)).float().square().sum().backward()
    ddp.finish_grad_sync()
    result = {}
    for name, param in model.named_parameters():
        main_grad = param.main_grad
        error = (main_grad.double() - reference[name]).abs().max().item()
        result[name] = (main_grad.dtype, error, reference[name].abs().max().item())
    return result


@pytest.mark.parametrize("use_distributed_optimizer", [False, True])
def test_bf16_ddp_accumulates_gradients_in_fp32(use_distributed_optimizer):
    default = run_on_ranks(2, _ddp_grads_from_flags, "", use_distributed_optimizer)
    opted_out = run_on_ranks(2, _ddp_grads_from_flags, "--grad-reduce-in-bf16", use_distributed_optimizer)
    for rank_result in default:
        for name, (dtype, error, scale) in rank_result.items():
            assert dtype == torch.float32, name
            # fp32 sums of bf16 values: only fp32 rounding (2^-24 relative per addition, 7 additions).
            assert error <= 1e-6 * scale, (name, error, scale)
    worst_bf16 = max(error / scale for rank_result in opted_out for _, error, scale in rank_result.values())
    assert all(dtype == torch.bfloat16 for rank_result in opted_out for dtype, _, _ in rank_result.values())
    # bf16 accumulation rounds each partial sum to 8 mantissa bits: visibly worse than fp32.
    assert worst_bf16 > 1e-4, worst_bf16


def _fsdp2_precision(extra):
    from torch.distributed.tensor import DTensor

    from megatron.core import parallel_state
    from megatron.core.distributed import wrap_data_parallel
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.training.model_config import ddp_config_from_args
    from tests.unit_tests.distributed.precision_gpt import build_gpt, gpt_batch, gpt_loss

    args = _validated("--bf16 --use-torch-fsdp2 --untie-embeddings-and-output-weights " + extra,
                      world_size=dist.get_world_size())
    args.data_parallel_size = dist.get_world_size()
    model = build_gpt(bf16=True, untie=True)
    chunk = wrap_data_parallel(model.config, ddp_config_from_args(args), model)
    compute_dtypes = set()
    handle = model.decoder.layers[0].mlp.linear_fc1.register_forward_pre_hook(
        lambda module, inputs: compute_dtypes.add(module.weight.dtype))
    optimizer = get_megatron_optimizer(OptimizerConfig(lr=1e-3, bf16=True), [chunk])
    gpt_loss(chunk, gpt_batch(0)).backward()
    chunk.finish_grad_sync()
    handle.remove()
    success, grad_norm, _ = optimizer.step()
    shard_dtypes = {param.dtype for param in model.parameters()}
    grad_dtypes = {param.grad.dtype for param in model.parameters() if param.grad is not None}
    main_is_model = all(main is model_param for model_param, main in optimizer._model_and_main)
    return {
        "dtensors": all(isinstance(param, DTensor) for param in model.parameters()),
        "shards": shard_dtypes, "grads": grad_dtypes, "compute": compute_dtypes,
        "reduce": chunk.mixed_precision_policy.reduce_dtype, "main_is_model": main_is_model,
        "stepped": bool(success) and float(grad_norm) > 0, "dp": parallel_state.get_data_parallel_world_size(),
    }


def test_fsdp2_bf16_keeps_fp32_shards_computes_in_bf16_and_reduces_in_fp32():
    default, opted_out = run_on_ranks(2, _fsdp2_precision, ""), run_on_ranks(2, _fsdp2_precision,
                                                                              "--grad-reduce-in-bf16")
    for result in default:
        assert result["dtensors"] and result["dp"] == 2 and result["stepped"]
        assert result["shards"] == {torch.float32} and result["grads"] == {torch.float32}
        assert result["compute"] == {torch.bfloat16}
        assert result["reduce"] == torch.float32
        # The fp32 shards are the optimizer's main weights: no second fp32 copy.
        assert result["main_is_model"]
    assert all(result["reduce"] == torch.bfloat16 for result in opted_out)


def test_optimizers_read_fp32_main_grads_without_copying():
    from megatron.core.optimizer.optimizer import fp32_grad

    fp32 = torch.ones(4)
    assert fp32_grad(fp32) is fp32
    bf16 = torch.ones(4, dtype=torch.bfloat16)
    assert fp32_grad(bf16).dtype == torch.float32 and fp32_grad(bf16).data_ptr() != bf16.data_ptr()


def _float16_optimizer_grad_storage():
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    results = {}
    for distributed in (False, True):
        model = _bf16_model()
        ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=distributed)
        ddp = DistributedDataParallel(types.SimpleNamespace(), ddp_config, model)
        optimizer = get_megatron_optimizer(OptimizerConfig(lr=1e-3, bf16=True, use_distributed_optimizer=distributed),
                                           [ddp])
        ddp.zero_grad_buffer()
        ddp(_microbatch_input(dist.get_rank(), 0)).float().sum().backward()
        ddp.finish_grad_sync()
        optimizer._copy_model_grads_to_main_grads()
        buffers = [buffer.grad_data for buffer in ddp.buffers]
        storages = {buffer.untyped_storage().data_ptr() for buffer in buffers}
        grads = [param.grad for param in optimizer.main_params() if param.grad is not None]
        results[distributed] = bool(grads) and all(grad.untyped_storage().data_ptr() in storages for grad in grads)
    return results


def test_main_grads_alias_the_fp32_gradient_buffers():
    for result in run_on_ranks(2, _float16_optimizer_grad_storage):
        assert result == {False: True, True: True}


@pytest.mark.parametrize("params_dtype, grad_reduce_in_fp32, expected", [
    (torch.bfloat16, True, torch.float32),
    (torch.bfloat16, False, torch.bfloat16),  # --bf16 --grad-reduce-in-bf16
    (torch.float16, False, torch.float16),  # --fp16 without --accumulate-allreduce-grads-in-fp32
    (torch.float32, False, torch.float32),
])
def test_megatron_fsdp_keeps_gradients_in_the_dtype_ddp_would(params_dtype, grad_reduce_in_fp32, expected):
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.distributed.fsdp.mcore_fsdp_adapter import _mixed_precision_policy

    config = types.SimpleNamespace(params_dtype=params_dtype)
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=grad_reduce_in_fp32,
                                               data_parallel_sharding_strategy="optim_grads_params")
    assert _mixed_precision_policy(config, ddp_config).main_grads_dtype == expected
