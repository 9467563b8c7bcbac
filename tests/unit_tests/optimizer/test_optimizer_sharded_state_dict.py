"""`optimizer.sharded_state_dict(model_sharded_state_dict, is_loading=...)` with `dist_checkpointing.save/load`,
as upstream's own training loops checkpoint the optimizer: a run resumed from it continues bit for bit, under
DDP with the distributed optimizer and under Megatron-FSDP (ZeRO-3), and the distributed optimizer's state loads
into the plain optimizer."""

import pytest
import torch

from tests.unit_tests.multiprocess_harness import run_on_ranks

VOCAB, SEQ, MICRO_BATCH, HIDDEN, HEADS = 32, 8, 2, 16, 2
STEPS_BEFORE_SAVE, STEPS_AFTER_LOAD = 2, 2


def _build(wrapper, seed, optimizer="adam"):
    """A tiny GPT on this rank, wrapped by `wrapper`, and its `optimizer` ("adam", or "sgd" with momentum)."""
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        FullyShardedDataParallel,
    )
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.transformer_config import TransformerConfig

    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel()
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    config = TransformerConfig(num_layers=2, hidden_size=HIDDEN, num_attention_heads=HEADS, hidden_dropout=0.0,
                               attention_dropout=0.0, init_seed=seed)
    model = GPTModel(config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=VOCAB,
                     max_sequence_length=SEQ)
    distributed_optimizer = wrapper != "ddp"
    if wrapper == "megatron_fsdp":
        chunk = FullyShardedDataParallel(config, DistributedDataParallelConfig(
            use_megatron_fsdp=True, use_distributed_optimizer=True,
            data_parallel_sharding_strategy="optim_grads_params"), model)
    else:
        chunk = DistributedDataParallel(
            config, DistributedDataParallelConfig(use_distributed_optimizer=distributed_optimizer), model)
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer=optimizer, lr=1e-2, weight_decay=0.1, clip_grad=1.0, sgd_momentum=0.9,
                        use_distributed_optimizer=distributed_optimizer), [chunk])
    return chunk, optimizer


def _train(chunk, optimizer, steps):
    """Train from step `steps.start` to `steps.stop`; the losses of this rank."""
    from megatron.core import parallel_state
    from megatron.core.distributed import finalize_model_grads

    losses = []
    for step in steps:
        generator = torch.Generator().manual_seed(100 * step + parallel_state.get_data_parallel_rank())
        stream = torch.randint(0, VOCAB, (MICRO_BATCH, SEQ + 1), generator=generator)
        chunk.zero_grad_buffer()
        optimizer.zero_grad()
        per_token = chunk(stream[:, :-1], torch.arange(SEQ).expand(MICRO_BATCH, SEQ), None, labels=stream[:, 1:])
        loss = per_token.mean()
        loss.backward()
        finalize_model_grads([chunk])
        assert optimizer.step()[0]
        losses.append(loss.item())
    return losses


def _weights(chunk):
    if hasattr(chunk, "gathered_parameters"):
        with chunk.gathered_parameters() as model:
            return {name: param.detach().clone() for name, param in model.named_parameters()}
    return {name: param.detach().clone() for name, param in chunk.module.named_parameters()}


def _save(chunk, optimizer, directory, nested=True):
    """Upstream's calls: model and optimizer in one nested dict, or each in a directory of its own."""
    from megatron.core import dist_checkpointing

    model_sd = chunk.sharded_state_dict()
    if nested:
        dist_checkpointing.save({"model": model_sd, "optimizer": optimizer.sharded_state_dict(model_sd)}, directory)
    else:
        dist_checkpointing.save(model_sd, f"{directory}/model")
        dist_checkpointing.save(optimizer.sharded_state_dict(model_sd), f"{directory}/optimizer")


def _load(chunk, optimizer, directory, nested=True):
    from megatron.core import dist_checkpointing

    model_sd = chunk.sharded_state_dict()
    if nested:
        loaded = dist_checkpointing.load(
            {"model": model_sd, "optimizer": optimizer.sharded_state_dict(model_sd, is_loading=True)}, directory)
        chunk.load_state_dict(loaded["model"])
        optimizer.load_state_dict(loaded["optimizer"])
    else:
        chunk.load_state_dict(dist_checkpointing.load(model_sd, f"{directory}/model"))
        optimizer.load_state_dict(dist_checkpointing.load(optimizer.sharded_state_dict(model_sd, is_loading=True),
                                                          f"{directory}/optimizer"))


def _resume_matches_uninterrupted(directory, wrapper, optimizer_name="adam"):
    chunk, optimizer = _build(wrapper, 1, optimizer_name)
    uninterrupted = _train(chunk, optimizer, range(STEPS_BEFORE_SAVE + STEPS_AFTER_LOAD))
    uninterrupted_weights = _weights(chunk)

    chunk, optimizer = _build(wrapper, 1, optimizer_name)
    _train(chunk, optimizer, range(STEPS_BEFORE_SAVE))
    _save(chunk, optimizer, directory)

    chunk, optimizer = _build(wrapper, 2, optimizer_name)  # other weights: the load must replace them
    _load(chunk, optimizer, directory)
    resumed = _train(chunk, optimizer, range(STEPS_BEFORE_SAVE, STEPS_BEFORE_SAVE + STEPS_AFTER_LOAD))
    weights = _weights(chunk)
    same_weights = set(weights) == set(uninterrupted_weights) and all(
        torch.equal(weights[name], uninterrupted_weights[name]) for name in weights)
    return uninterrupted[STEPS_BEFORE_SAVE:], resumed, same_weights


@pytest.mark.parametrize("world_size", [2])
@pytest.mark.parametrize("wrapper", ["ddp_distributed_optimizer", "megatron_fsdp"])
def test_resume_from_sharded_optimizer_state_matches_uninterrupted_run(tmp_path, world_size, wrapper):
    for expected, resumed, same_weights in run_on_ranks(world_size, _resume_matches_uninterrupted,
                                                        str(tmp_path / "ckpt"), wrapper):
        assert resumed == expected
        assert same_weights


@pytest.mark.parametrize("world_size", [2])
@pytest.mark.parametrize("wrapper", ["ddp", "ddp_distributed_optimizer", "megatron_fsdp"])
def test_sgd_momentum_buffer_is_loaded(tmp_path, world_size, wrapper):
    """A fresh SGD has no momentum buffer before its first step: loading must still ask for the saved one."""
    for expected, resumed, same_weights in run_on_ranks(world_size, _resume_matches_uninterrupted,
                                                        str(tmp_path / "ckpt"), wrapper, "sgd"):
        assert resumed == expected
        assert same_weights


def _distributed_state_loads_into_plain_optimizer(directory):
    """{parameter name: (the distributed optimizer's moments gathered, the plain optimizer's after loading)}."""
    chunk, optimizer = _build("ddp_distributed_optimizer", seed=1)
    _train(chunk, optimizer, range(STEPS_BEFORE_SAVE))
    _save(chunk, optimizer, directory, nested=False)
    gathered = optimizer.gathered_state_dict()["param_states"]
    expected = {name: gathered[index] for index, name in enumerate(
        {id(param): name for name, param in chunk.module.named_parameters()}[id(param)]
        for param in optimizer.model_params())}

    plain_chunk, plain = _build("ddp", seed=2)
    _load(plain_chunk, plain, directory, nested=False)
    names = {id(param): name for name, param in plain_chunk.module.named_parameters()}
    loaded = {names[id(param)]: {key: value.clone() for key, value in plain.state[param].items() if key != "step"}
              for param in plain.main_params()}
    steps = {float(plain.state[param]["step"]) for param in plain.main_params()}
    weights_loaded = all(torch.equal(plain_weight, weight) for plain_weight, weight in
                         zip(_weights(plain_chunk).values(), _weights(chunk).values(), strict=True))
    return expected, loaded, steps, weights_loaded


@pytest.mark.parametrize("world_size", [2])
def test_distributed_optimizer_state_loads_into_plain_optimizer(tmp_path, world_size):
    for expected, loaded, steps, weights_loaded in run_on_ranks(
            world_size, _distributed_state_loads_into_plain_optimizer, str(tmp_path / "ckpt")):
        assert weights_loaded
        assert steps == {float(STEPS_BEFORE_SAVE)}
        assert set(loaded) == set(expected)
        for name, moments in loaded.items():
            assert set(moments) == {"exp_avg", "exp_avg_sq"}, name
            for key, value in moments.items():
                assert torch.equal(value, expected[name][key]), (name, key)
                assert value.abs().sum() > 0, (name, key)


def test_torch_style_state_dict_still_loads_and_logical_state_needs_its_targets():
    from megatron.core.optimizer import FP32Optimizer, OptimizerConfig

    param = torch.nn.Parameter(torch.ones(3))
    optimizer = FP32Optimizer(torch.optim.AdamW([param], lr=0.1), OptimizerConfig(lr=0.1), grad_stats_groups=[])
    param.grad = torch.ones(3)
    optimizer.step()
    saved = optimizer.state_dict()
    fresh_param = torch.nn.Parameter(torch.ones(3))
    fresh = FP32Optimizer(torch.optim.AdamW([fresh_param], lr=0.1), OptimizerConfig(lr=0.1), grad_stats_groups=[])
    fresh.load_state_dict(saved)
    assert torch.equal(fresh.state[fresh_param]["exp_avg"], optimizer.state[param]["exp_avg"])
    with pytest.raises(ValueError, match=r"sharded_state_dict\(model_sharded_state_dict, is_loading=True\)"):
        fresh.load_state_dict({"optimizer.step": 1.0})
    with pytest.raises(ValueError, match="model_chunks="):
        fresh.sharded_state_dict({})


def _linear_with_sgd(seed, dampening=0.0):
    from megatron.core.optimizer import FP32Optimizer, OptimizerConfig

    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 3)
    optimizer = FP32Optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, dampening=dampening),
                              OptimizerConfig(optimizer="sgd", lr=0.1), grad_stats_groups=[])
    optimizer.model_chunks = [model]
    return model, optimizer


def _sgd_step(model, optimizer, seed):
    generator = torch.Generator().manual_seed(seed)
    model.zero_grad()
    model(torch.randn(5, 4, generator=generator)).square().sum().backward()
    optimizer.step()


def test_sgd_momentum_buffers_are_asked_for_and_installed_only_where_loaded(tmp_path):
    from megatron.core import dist_checkpointing

    model, optimizer = _linear_with_sgd(seed=1)
    for step in range(2):
        _sgd_step(model, optimizer, step)
    dist_checkpointing.save({"model": model.state_dict(), "optimizer": optimizer.sharded_state_dict()},
                            tmp_path / "after_steps")

    fresh_model, fresh = _linear_with_sgd(seed=2)
    targets = fresh.sharded_state_dict(is_loading=True)
    assert {"optimizer.state.weight.momentum_buffer", "optimizer.state.bias.momentum_buffer"} <= set(targets)
    assert not fresh.optimizer.state  # asking does not create buffers: a fresh first step stays torch's
    fresh.load_state_dict(dist_checkpointing.load({"optimizer": targets}, tmp_path / "after_steps")["optimizer"])
    for name, param in model.named_parameters():
        fresh_param = dict(fresh_model.named_parameters())[name]
        assert torch.equal(fresh.optimizer.state[fresh_param]["momentum_buffer"],
                           optimizer.optimizer.state[param]["momentum_buffer"]), name


def test_sgd_checkpoint_without_momentum_buffers_keeps_the_first_step_rule(tmp_path):
    """Saved before any step: nothing is installed, so the next step sets the buffer to the gradient as a fresh
    SGD does (a zero buffer would give (1 - dampening) * gradient)."""
    from megatron.core import dist_checkpointing

    model, optimizer = _linear_with_sgd(seed=1, dampening=0.5)
    dist_checkpointing.save(optimizer.sharded_state_dict(), tmp_path / "before_steps")
    _sgd_step(model, optimizer, seed=0)

    resumed_model, resumed = _linear_with_sgd(seed=1, dampening=0.5)
    resumed.load_state_dict(dist_checkpointing.load(resumed.sharded_state_dict(is_loading=True),
                                                    tmp_path / "before_steps", strict="log_all"))
    assert not any("momentum_buffer" in state for state in resumed.optimizer.state.values())
    _sgd_step(resumed_model, resumed, seed=0)
    for (name, param), resumed_param in zip(model.named_parameters(), resumed_model.parameters(), strict=True):
        assert torch.equal(resumed_param, param), name
        assert torch.equal(resumed.optimizer.state[resumed_param]["momentum_buffer"], param.grad), name
