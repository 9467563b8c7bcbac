"""finalize_model_grads: sequence-parallel and shared-embedding all-reduces, per-token scaling, duck typing."""

import copy
import types

import pytest
import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from tests.unit_tests.multiprocess_harness import run_on_ranks
from tests.unit_tests.optimizer.toy_models import build_toy_model, toy_batch


def _rank_grad(shape, rank, salt):
    return torch.randn(shape, generator=torch.Generator().manual_seed(100 * rank + salt))


def _tp_and_pp_reductions():
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    rank = dist.get_rank()
    module = torch.nn.Module()
    module.norm = torch.nn.Parameter(torch.zeros(5))
    module.norm.sequence_parallel = True
    module.plain = torch.nn.Parameter(torch.zeros(3))
    module.embedding = torch.nn.Parameter(torch.zeros(4, 2))
    module.embedding.shared_embedding = True
    for salt, param in enumerate(module.parameters()):
        param.grad = _rank_grad(param.shape, rank, salt)

    calls = []
    fsdp_like = torch.nn.Module()
    fsdp_like.finish_grad_sync = lambda: calls.append("finish_grad_sync")
    finalize_model_grads([module, fsdp_like])

    tp_ranks = dist.get_process_group_ranks(parallel_state.get_tensor_model_parallel_group())
    embedding_ranks = parallel_state.get_embedding_global_ranks()
    torch.testing.assert_close(module.norm.grad, sum(_rank_grad(5, r, 0) for r in tp_ranks))
    torch.testing.assert_close(module.plain.grad, _rank_grad(3, rank, 1))  # untouched
    torch.testing.assert_close(module.embedding.grad, sum(_rank_grad((4, 2), r, 2) for r in embedding_ranks))
    assert len(embedding_ranks) == 2 and calls == ["finish_grad_sync"]
    return True


@pytest.mark.parametrize("world_size", [4])
def test_sequence_parallel_and_shared_embedding_grads_are_all_reduced(world_size):
    assert all(run_on_ranks(world_size, _tp_and_pp_reductions))


def _per_token_loss_matches_global_mean(use_ddp):
    rank, world_size = dist.get_rank(), dist.get_world_size()
    tokens_per_rank = [3 + r for r in range(world_size)]  # unequal token counts per rank
    model = build_toy_model()
    reference = copy.deepcopy(model)
    inputs, targets = toy_batch(0, sum(tokens_per_rank))
    start = sum(tokens_per_rank[:rank])
    local = slice(start, start + tokens_per_rank[rank])
    torch.nn.functional.mse_loss(reference(inputs), targets, reduction="none").sum(dim=1).mean().backward()

    if use_ddp:
        config = types.SimpleNamespace(calculate_per_token_loss=True)
        chunk = DistributedDataParallel(config, DistributedDataParallelConfig(), model)
        chunk.zero_grad_buffer()
    else:
        chunk = model
    per_token = torch.nn.functional.mse_loss(chunk(inputs[local]), targets[local], reduction="none").sum(dim=1)
    per_token.sum().backward()
    if not use_ddp:  # plain modules are not data-parallel reduced by finalize_model_grads: do it by hand
        for param in model.parameters():
            dist.all_reduce(param.grad)
    finalize_model_grads([chunk], num_tokens=torch.tensor(tokens_per_rank[rank]))
    for name, param in model.named_parameters():
        grad = param.main_grad if use_ddp else param.grad
        torch.testing.assert_close(grad, dict(reference.named_parameters())[name].grad, atol=1e-6, rtol=1e-5)
    return True


@pytest.mark.parametrize("use_ddp", [True, False])
@pytest.mark.parametrize("world_size", [2])
def test_num_tokens_scaling_gives_global_per_token_mean(world_size, use_ddp):
    assert all(run_on_ranks(world_size, _per_token_loss_matches_global_mean, use_ddp))
