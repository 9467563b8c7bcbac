"""torch optimizer habits on the Megatron optimizers: `zero_grad(set_to_none=False)` zeroes gradients that are views
of DDP's gradient buffer (as upstream's `_zero_grad_group_helper` does), and `step(closure)` fails with a message
saying what to do instead (upstream's optimizers take no closure)."""

import pytest
import torch

from megatron.core.optimizer import ChainedOptimizer, OptimizerConfig, get_megatron_optimizer
from tests.unit_tests.optimizer.toy_models import build_toy_model, mse_loss, toy_batch
from tests.unit_tests.test_utilities import Utils


def _ddp_step(distributed_optimizer, dtype):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.model_parallel_config import ModelParallelConfig

    Utils.initialize_distributed()
    model = build_toy_model(dtype=dtype)
    half = dtype != torch.float32
    ddp = DistributedDataParallel(ModelParallelConfig(), DistributedDataParallelConfig(
        use_distributed_optimizer=distributed_optimizer, grad_reduce_in_fp32=half), model)
    optimizer = get_megatron_optimizer(OptimizerConfig(lr=0.01, bf16=half,
                                                       use_distributed_optimizer=distributed_optimizer), [ddp])
    inputs, targets = toy_batch(0, 4, dtype=dtype)
    mse_loss(ddp, inputs, targets).backward()
    finalize_model_grads([ddp])
    assert optimizer.step()[0]
    return model, optimizer


@pytest.mark.parametrize("distributed_optimizer, dtype", [(False, torch.float32), (False, torch.bfloat16),
                                                          (True, torch.float32)])
def test_zero_grad_without_set_to_none_zeroes_ddp_buffer_views(distributed_optimizer, dtype):
    model, optimizer = _ddp_step(distributed_optimizer, dtype)
    grads = [param.grad for param in optimizer.main_params() if param.grad is not None]
    assert grads and any(bool(grad.any()) for grad in grads)  # the step's gradients are still attached
    optimizer.zero_grad(set_to_none=False)
    assert all(param.grad is not None and not param.grad.any() for param in optimizer.main_params())
    assert all(not param.main_grad.any() for param in model.parameters())  # zeroed in DDP's buffer, as upstream
    optimizer.zero_grad()
    assert all(param.grad is None for param in optimizer.main_params())


def test_step_with_a_closure_says_to_run_the_backward_pass_first():
    model = build_toy_model()
    optimizer = get_megatron_optimizer(OptimizerConfig(lr=0.01), [model])
    chain = ChainedOptimizer([get_megatron_optimizer(OptimizerConfig(lr=0.01), [build_toy_model(seed=1)])])
    before = [param.detach().clone() for param in model.parameters()]

    def closure():
        optimizer.zero_grad()
        loss = mse_loss(model, *toy_batch(0, 4))
        loss.backward()
        return loss

    for stepped in (optimizer, chain):
        with pytest.raises(TypeError, match=r"step\(\) takes no closure .* then call optimizer.step\(\)"):
            stepped.step(closure)
    assert all(torch.equal(param, old) for param, old in zip(model.parameters(), before))
    closure()
    assert optimizer.step()[0]  # the advice works
