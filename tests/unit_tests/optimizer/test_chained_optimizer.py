"""`ChainedOptimizer`: two Megatron optimizers stepped as one equal torch AdamW over both models with one global
clip, skip together on fp16 overflow, and round-trip their state (torch-style and sharded)."""

import copy

import pytest
import torch
import torch.distributed as dist

from megatron.core.optimizer import ChainedOptimizer, OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from tests.unit_tests.multiprocess_harness import run_on_ranks
from tests.unit_tests.optimizer.toy_models import build_toy_model, mse_loss, reference_param_groups, toy_batch

CLIP_GRAD, WEIGHT_DECAY = 0.05, 0.1


def _chain(models, dtype=torch.float32, **config):
    settings = dict(lr=0.01, weight_decay=WEIGHT_DECAY, clip_grad=CLIP_GRAD, log_num_zeros_in_grad=True)
    settings.update(config)
    return ChainedOptimizer([get_megatron_optimizer(OptimizerConfig(**settings), [model]) for model in models])


def _backward(models, step, samples=8, rank=0, world_size=1):
    inputs, targets = toy_batch(step, samples * world_size)
    local = slice(rank * samples, (rank + 1) * samples)
    dtype = next(models[0].parameters()).dtype
    loss = sum(mse_loss(model, inputs[local].to(dtype), targets[local].to(dtype)) for model in models)
    return loss


def _reference(models):
    references = [copy.deepcopy(model) for model in models]
    groups = [group for reference in references for group in reference_param_groups(reference, WEIGHT_DECAY, 0.01)]
    for group in groups:
        group["wd_mult"] = 1.0 if group["weight_decay"] else 0.0
    return references, torch.optim.AdamW(groups)


def _reference_step(references, optimizer, step, samples):
    optimizer.zero_grad()
    _backward(references, step, samples).backward()
    params = [param for reference in references for param in reference.parameters()]
    zeros = sum(int((param.grad == 0).sum()) for param in params)
    norm = torch.nn.utils.clip_grad_norm_(params, CLIP_GRAD).item()
    optimizer.step()
    return norm, zeros


def _schedule(optimizer):
    return OptimizerParamScheduler(optimizer, init_lr=0.0, max_lr=0.01, min_lr=0.001, lr_warmup_steps=1,
                                   lr_decay_steps=4, lr_decay_style="cosine", start_wd=WEIGHT_DECAY,
                                   end_wd=WEIGHT_DECAY, wd_incr_steps=4, wd_incr_style="constant")


def test_chain_steps_like_one_adamw_over_both_models_with_one_global_clip():
    models = [build_toy_model(seed=0), build_toy_model(seed=1)]
    references, reference_optimizer = _reference(models)
    chain = _chain(models)
    scheduler, reference_scheduler = _schedule(chain), _schedule(reference_optimizer)
    assert len(chain.param_groups) == 4 and chain.get_parameters() == chain.main_params()
    for step in range(3):
        scheduler.step()
        reference_scheduler.step()
        chain.zero_grad()
        _backward(models, step).backward()
        update_successful, grad_norm, num_zeros = chain.step()
        expected_norm, expected_zeros = _reference_step(references, reference_optimizer, step, 8)
        assert update_successful and num_zeros == expected_zeros
        assert grad_norm == pytest.approx(expected_norm, rel=1e-6) and grad_norm > CLIP_GRAD
        # The scheduler's learning rate reached the groups of both optimizers.
        assert [group["lr"] for group in chain.param_groups] == [reference_optimizer.param_groups[0]["lr"]] * 4
        assert chain.get_lr() == reference_optimizer.param_groups[0]["lr"]
    for model, reference in zip(models, references, strict=True):
        for param, expected in zip(model.parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(param, expected, atol=1e-6, rtol=1e-5)


def test_fp16_overflow_in_one_optimizer_skips_all_and_backs_off_every_scale():
    models = [build_toy_model(seed=0, dtype=torch.float16), build_toy_model(seed=1, dtype=torch.float16)]
    chain = _chain(models, fp16=True, initial_loss_scale=1024.0, hysteresis=1)
    before = [param.detach().clone() for model in models for param in model.parameters()]
    chain.scale_loss(_backward(models, 0)).backward()
    models[1][0].weight.grad[0, 0] = float("inf")
    assert chain.step() == (False, None, None)
    assert [optimizer.get_loss_scale().item() for optimizer in chain.chained_optimizers] == [512.0, 512.0]
    after = [param.detach() for model in models for param in model.parameters()]
    assert all(torch.equal(old, new) for old, new in zip(before, after, strict=True))
    chain.zero_grad()
    chain.scale_loss(_backward(models, 1)).backward()
    assert chain.step()[0]


def test_state_dict_and_sharded_state_dict_round_trips_continue_identically(tmp_path):
    from megatron.core import dist_checkpointing

    models = [build_toy_model(seed=0), build_toy_model(seed=1)]
    chain = _chain(models)
    for step in range(2):
        chain.zero_grad()
        _backward(models, step).backward()
        chain.step()
    torch_state = copy.deepcopy(chain.state_dict())
    dist_checkpointing.save(chain.sharded_state_dict(), tmp_path / "chain")
    saved_weights = [copy.deepcopy(model.state_dict()) for model in models]

    def resumed(load):
        fresh_models = [build_toy_model(seed=5), build_toy_model(seed=6)]
        for model, weights in zip(fresh_models, saved_weights, strict=True):
            model.load_state_dict(weights)
        fresh = _chain(fresh_models)
        load(fresh)
        fresh.zero_grad()
        _backward(fresh_models, 2).backward()
        fresh.step()
        return [param.detach().clone() for model in fresh_models for param in model.parameters()]

    by_torch_state = resumed(lambda fresh: fresh.load_state_dict(torch_state))
    by_sharded_state = resumed(lambda fresh: fresh.load_state_dict(
        dist_checkpointing.load(fresh.sharded_state_dict(is_loading=True), tmp_path / "chain")))
    chain.zero_grad()
    _backward(models, 2).backward()
    chain.step()
    expected = [param.detach() for model in models for param in model.parameters()]
    for first, second, reference in zip(by_torch_state, by_sharded_state, expected, strict=True):
        assert torch.equal(first, reference) and torch.equal(second, reference)
    with pytest.raises(ValueError, match="holds 1 optimizers, this chain 2"):
        _chain([build_toy_model(), build_toy_model()]).load_state_dict(torch_state[:1])


def test_chain_refuses_shared_parameters_and_differing_loss_scales():
    model = build_toy_model()
    optimizer = get_megatron_optimizer(OptimizerConfig(lr=0.01), [model])
    with pytest.raises(ValueError, match="optimizers 0 and 1 step the same parameter"):
        ChainedOptimizer([optimizer, get_megatron_optimizer(OptimizerConfig(lr=0.01), [model])])
    fp16_model = build_toy_model(dtype=torch.float16)
    fp16_optimizer = get_megatron_optimizer(OptimizerConfig(lr=0.01, fp16=True, loss_scale=8.0), [fp16_model])
    with pytest.raises(ValueError, match=r"loss scales of the optimizers differ \(\[None, 8.0\]"):
        ChainedOptimizer([optimizer, fp16_optimizer])


def _data_parallel_chain_matches_adamw():
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.model_parallel_config import ModelParallelConfig

    rank, world_size = dist.get_rank(), dist.get_world_size()
    models = [build_toy_model(seed=0), build_toy_model(seed=1)]
    references, reference_optimizer = _reference(models)
    chunks = [DistributedDataParallel(ModelParallelConfig(), DistributedDataParallelConfig(
        use_distributed_optimizer=sharded, bucket_size=40), model) for model, sharded in zip(models, (True, False))]
    settings = dict(lr=0.01, weight_decay=WEIGHT_DECAY, clip_grad=CLIP_GRAD, log_num_zeros_in_grad=True)
    chain = ChainedOptimizer([get_megatron_optimizer(OptimizerConfig(use_distributed_optimizer=sharded, **settings),
                                                     [chunk]) for chunk, sharded in zip(chunks, (True, False))])
    for step in range(3):
        for chunk in chunks:
            chunk.zero_grad_buffer()
        chain.zero_grad()
        _backward(chunks, step, 2, rank, world_size).backward()
        finalize_model_grads(chunks)
        update_successful, grad_norm, num_zeros = chain.step()
        expected_norm, expected_zeros = _reference_step(references, reference_optimizer, step, 2 * world_size)
        assert update_successful and num_zeros == expected_zeros
        assert grad_norm == pytest.approx(expected_norm, rel=1e-5)
    for model, reference in zip(models, references, strict=True):
        for param, expected in zip(model.parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(param, expected, atol=1e-6, rtol=1e-5)
    return True


@pytest.mark.parametrize("world_size", [3])
def test_chain_of_distributed_and_plain_optimizers_matches_adamw(world_size):
    assert all(run_on_ranks(world_size, _data_parallel_chain_matches_adamw))
