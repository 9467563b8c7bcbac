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
    # Two chunks per rank, as under an interleaved pipeline: the tied weight is in the first chunk of the first stage
    # (the input embedding) and in the last chunk of the last stage (the output layer).
    first_stage = parallel_state.is_pipeline_first_stage(ignore_virtual=True)
    finalize_model_grads([module, fsdp_like] if first_stage else [fsdp_like, module])

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


def _tied_embedding_pieces_under_megatron_fsdp(strategy):
    """PP2 x DP2 GPT with a tied embedding under Megatron-FSDP: the embedding gradient is all-reduced over the
    embedding group once, piece by piece (no full vocab x hidden buffer), with the full-buffer path's result."""
    import importlib

    finalize_module = importlib.import_module("megatron.core.distributed.finalize_model_grads")
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from tests.unit_tests.distributed.test_mcore_fsdp_adapter import SEQ, MICRO_BATCH, _batches, _build, _layout, _wrap
    from tests.unit_tests.pipeline_parallel.test_gpt_pipeline import _forward_step

    chunk = _wrap(_build(_layout(pp=2)), strategy)
    chunk.zero_grad_buffer()
    get_forward_backward_func()(forward_step_func=_forward_step, data_iterator=iter(_batches(0, 2)), model=[chunk],
                                num_microbatches=2, seq_length=SEQ, micro_batch_size=MICRO_BATCH)
    chunk.finish_grad_sync()
    is_shared = finalize_module._has_attribute("shared_embedding")
    pieces = chunk.optimizer_grad_pieces(is_shared)
    before = [piece.grad.clone() for piece in pieces]
    full_numel = sum(piece.param.numel() for piece in pieces)

    sizes = []
    real_all_reduce = dist.all_reduce

    def counting_all_reduce(tensor, *args, **kwargs):
        sizes.append(tensor.numel())
        return real_all_reduce(tensor, *args, **kwargs)

    finalize_module._allreduce_shared_embedding_grads([chunk])  # first call also checks the layouts (cached)
    for piece, saved in zip(pieces, before):
        piece.grad.copy_(saved)
    finalize_module.dist.all_reduce = counting_all_reduce
    try:
        finalize_module._allreduce_shared_embedding_grads([chunk])
    finally:
        finalize_module.dist.all_reduce = real_all_reduce
    piecewise = [piece.grad.clone() for piece in pieces]
    for piece, saved in zip(pieces, before):
        piece.grad.copy_(saved)
    finalize_module._all_reduce_sharded_grads(chunk, is_shared, parallel_state.get_embedding_group())
    full_buffer = [piece.grad.clone() for piece in pieces]
    return {"sizes": sizes, "piece_numel": sum(piece.grad.numel() for piece in pieces), "full_numel": full_numel,
            "equal": all(torch.equal(a, b) for a, b in zip(piecewise, full_buffer)),
            "changed": any(not torch.equal(a, b) for a, b in zip(piecewise, before))}


@pytest.mark.parametrize("strategy", ["no_shard", "optim", "optim_grads_params"])
def test_tied_embedding_grads_reduced_piecewise_under_megatron_fsdp(strategy):
    results = run_on_ranks(4, _tied_embedding_pieces_under_megatron_fsdp, strategy)
    # Rows of tokens absent from a stage's batch have zero gradient there, so not every piece changes.
    assert any(result["changed"] for result in results)
    for result in results:
        assert result["equal"], result
        # One all-reduce, of this rank's piece only: the whole gradient under ZeRO-0, half of it at DP2 otherwise.
        expected = result["full_numel"] if strategy == "no_shard" else result["full_numel"] // 2
        assert result["sizes"] == [result["piece_numel"]] and result["piece_numel"] == expected, result


def test_zero_global_tokens_leave_gradients_unscaled_as_upstream():
    model = build_toy_model()
    for salt, param in enumerate(model.parameters()):
        param.grad = _rank_grad(param.shape, 0, salt)
    expected = [param.grad.clone() for param in model.parameters()]
    finalize_model_grads([model], num_tokens=torch.tensor(0))  # every loss token masked in the global batch
    for param, grad in zip(model.parameters(), expected, strict=True):
        assert torch.equal(param.grad, grad)
    finalize_model_grads([model], num_tokens=torch.tensor(4))
    for param, grad in zip(model.parameters(), expected, strict=True):
        torch.testing.assert_close(param.grad, grad / 4)
    with pytest.raises(ValueError, match=r"finalize_model_grads\(pg_collection=\.\.\.\) is not supported here"):
        finalize_model_grads([model], num_tokens=None, pg_collection=object())


def _token_count_with_an_averaging_wrapper():
    model = build_toy_model()
    chunk = DistributedDataParallel(types.SimpleNamespace(calculate_per_token_loss=False),
                                    DistributedDataParallelConfig(), model)
    chunk.zero_grad_buffer()
    inputs, targets = toy_batch(0, 4)
    torch.nn.functional.mse_loss(chunk(inputs), targets, reduction="sum").backward()
    try:
        finalize_model_grads([chunk], num_tokens=torch.tensor(4))
    except ValueError as error:
        return str(error)
    return None


@pytest.mark.parametrize("world_size", [1])
def test_token_count_for_a_wrapper_that_averages_is_refused(world_size):
    (message,) = run_on_ranks(world_size, _token_count_with_an_averaging_wrapper)
    assert message is not None and "DistributedDataParallel was built from a model config without " \
        "calculate_per_token_loss (--calculate-per-token-loss)" in message
