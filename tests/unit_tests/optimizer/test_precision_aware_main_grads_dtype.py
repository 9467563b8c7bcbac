"""The distributed optimizer's precision-aware path reads gradients in --main-grads-dtype: bf16 gradient buffers
(--grad-reduce-in-bf16) under fp32 main gradients are clipped and stepped in fp32, as the plain optimizer does."""

import types

import torch
import torch.distributed as dist

from megatron.core.optimizer import OptimizerConfig
from tests.unit_tests.multiprocess_harness import run_on_ranks


def _train_bf16_buffers(precision_aware):
    """Three clipped steps of a bf16 toy model on DP2 with bf16 gradient buffers; the fp32 main parameters and the
    dtypes of the gradients the optimizer read."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import get_megatron_optimizer

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4)).bfloat16()
    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=True, grad_reduce_in_fp32=False)
    ddp = DistributedDataParallel(types.SimpleNamespace(), ddp_config, model)
    config = OptimizerConfig(lr=1e-2, use_distributed_optimizer=True, bf16=True, clip_grad=1e-3,
                             use_precision_aware_optimizer=precision_aware)
    optimizer = get_megatron_optimizer(config, [ddp])
    grad_dtypes = set()
    for step in range(3):
        generator = torch.Generator().manual_seed(10 * step + dist.get_rank())
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        ddp(torch.randn(8, 16, generator=generator).bfloat16()).float().square().mean().backward()
        ddp.finish_grad_sync()
        assert optimizer.step()[0]
        grad_dtypes |= {(getattr(p, "decoupled_grad", None) if precision_aware else p.grad).dtype
                        for p in optimizer.main_params()}
    return {"main": [p.detach().clone() for p in optimizer.main_params()], "grad_dtypes": grad_dtypes}


def test_bf16_gradient_buffers_are_read_as_fp32_main_gradients():
    plain = run_on_ranks(2, _train_bf16_buffers, False)
    precision_aware = run_on_ranks(2, _train_bf16_buffers, True)
    for rank in range(2):
        assert precision_aware[rank]["grad_dtypes"] == plain[rank]["grad_dtypes"] == {torch.float32}
        for ours, reference in zip(precision_aware[rank]["main"], plain[rank]["main"]):
            torch.testing.assert_close(ours, reference, rtol=1e-6, atol=0)
