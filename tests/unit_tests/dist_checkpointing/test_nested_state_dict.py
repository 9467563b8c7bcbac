"""`dist_checkpointing.save` / `load` with the nested state dicts training loops of their own build
(`{"model0": ..., "model1": ..., "iteration": 10, ...}`): on two ranks, a GPT split over two pipeline ranks with
two virtual stages each, and a Megatron-FSDP ZeRO-3 chunk, round-trip exactly with the common state; the
tensors keep their logical names, so the interleaved checkpoint loads into the whole model in one process."""

import pytest
import torch

from megatron.core import dist_checkpointing
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.transformer.transformer_config import TransformerConfig
from tests.unit_tests.multiprocess_harness import run_on_ranks

NUM_LAYERS, CHUNKS = 4, 2


def _gpt(seed, pipeline_size=1, chunks=None):
    from megatron.core import parallel_state

    torch.manual_seed(seed)
    config = TransformerConfig(num_layers=NUM_LAYERS, hidden_size=8, num_attention_heads=2, init_seed=seed,
                               pipeline_model_parallel_size=pipeline_size,
                               virtual_pipeline_model_parallel_size=chunks)
    staged = parallel_state.model_parallel_is_initialized()
    return GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=16,
                    max_sequence_length=8, pre_process=not staged or parallel_state.is_pipeline_first_stage(),
                    post_process=not staged or parallel_state.is_pipeline_last_stage())


def _interleaved_chunks(seed):
    from megatron.core import parallel_state

    chunks = []
    for index in range(CHUNKS):
        parallel_state.set_virtual_pipeline_model_parallel_rank(index)
        chunks.append(_gpt(seed, 2, CHUNKS))
    parallel_state.set_virtual_pipeline_model_parallel_rank(None)
    return chunks


def _weights(chunk):
    return {name: value.pieces[0][1].detach().clone() for name, value in chunk.sharded_state_dict().items()}


def _interleaved_round_trip(directory):
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=2,
                                             virtual_pipeline_model_parallel_size=CHUNKS)
    rank = torch.distributed.get_rank()
    saved = _interleaved_chunks(seed=1)
    dist_checkpointing.save({"model0": saved[0].sharded_state_dict(), "model1": saved[1].sharded_state_dict(),
                             "iteration": 10, "rng_state": [f"rank {rank}"], "args": {"lr": 0.5},
                             "optimizer": {"param_groups": [{"lr": 0.5, "step": 3}]}}, directory)
    target = _interleaved_chunks(seed=2)
    state = dist_checkpointing.load({"model0": target[0].sharded_state_dict(),
                                     "model1": target[1].sharded_state_dict(), "iteration": None,
                                     "rng_state": None, "args": None}, directory, strict="raise_all")
    for index, chunk in enumerate(target):
        chunk.load_state_dict(state[f"model{index}"])
    restored = [_weights(chunk) for chunk in target]
    expected = [_weights(chunk) for chunk in saved]
    equal = all(set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a) for a, b in zip(restored, expected))
    common = {key: state[key] for key in ("iteration", "rng_state", "args")}
    return equal, common, sorted(set(state)), {**expected[0], **expected[1]}


@pytest.mark.parametrize("world_size", [2])
def test_interleaved_pipeline_round_trip_and_load_into_the_whole_model(tmp_path, world_size):
    directory = str(tmp_path / "ckpt")
    results = run_on_ranks(world_size, _interleaved_round_trip, directory)
    saved_weights = {}
    for equal, common, keys, weights in results:
        assert equal
        assert common == {"iteration": 10, "rng_state": ["rank 0"], "args": {"lr": 0.5}}  # the first rank's
        assert keys == ["args", "iteration", "model0", "model1", "rng_state"]
        saved_weights.update(weights)
    assert {f"decoder.layers.{i}.mlp.linear_fc1.weight" for i in range(NUM_LAYERS)} <= set(saved_weights)
    assert dist_checkpointing.load_common_state_dict(directory)["optimizer"] == {
        "param_groups": [{"lr": 0.5, "step": 3}]}
    assert dist_checkpointing.load_common_state_dict(directory)["model1"] == {}

    whole = _gpt(seed=3)  # one stage, one process: the same logical tensors
    state = dist_checkpointing.load({"model": whole.sharded_state_dict()}, directory, strict="raise_all")
    whole.load_state_dict(state["model"])
    restored = _weights(whole)
    assert set(restored) == set(saved_weights)
    assert all(torch.equal(restored[key], saved_weights[key]) for key in saved_weights)


def _megatron_fsdp_round_trip(directory):
    from tests.unit_tests.distributed.test_mcore_fsdp_adapter import _build, _full_weights, _layout, _wrap

    saved = _wrap(_build(_layout()), "optim_grads_params")
    dist_checkpointing.save({"model": saved.sharded_state_dict(), "iteration": 7,
                             "checkpoint_version": 3.0}, directory)
    target = _wrap(_build(_layout()), "optim_grads_params")
    target.load_state_dict({name: torch.zeros_like(value.pieces[0][1]) if value.pieces else value
                            for name, value in target.sharded_state_dict().items()})
    zeroed = all(not weight.any() for weight in _full_weights(target).values())
    state = dist_checkpointing.load({"model": target.sharded_state_dict(), "iteration": 0}, directory,
                                    strict="raise_all")
    target.load_state_dict(state["model"])
    expected, restored = _full_weights(saved), _full_weights(target)
    equal = set(expected) == set(restored) and all(torch.equal(expected[k], restored[k]) for k in expected)
    return zeroed, equal, state["iteration"]


@pytest.mark.parametrize("world_size", [2])
def test_megatron_fsdp_round_trip(tmp_path, world_size):
    for zeroed, equal, iteration in run_on_ranks(world_size, _megatron_fsdp_round_trip, str(tmp_path / "ckpt")):
        assert zeroed and equal and iteration == 7


def _torch_optimizer_state(optimizer):
    torch_optimizer = optimizer.optimizer
    return [{key: value.clone() for key, value in torch_optimizer.state[param].items()}
            for group in torch_optimizer.param_groups for param in group["params"]]


def _own_loop_loads_pretrain_checkpoint(root):
    """A checkpoint pretrain_gpt saves (tensors under `model.<logical name>`, the optimizer's objects at the top)
    loaded with upstream's own-loop calls: {weights equal, moments equal, moments not zero, loaded step}."""
    from megatron.training.dist_checkpoint import save_dist_checkpoint
    from tests.unit_tests.dist_checkpointing.pretrain_helpers import TrainingState

    state = TrainingState(f"--use-distributed-optimizer --ckpt-format torch_dist --save {root}")
    state.train_steps(2)
    save_dist_checkpoint(2, state.model, state.optimizer, state.scheduler, state.args)
    saved_weights = {name: param.detach().clone() for name, param in state.model[0].module.named_parameters()}
    saved_moments = _torch_optimizer_state(state.optimizer)
    state.close()

    state = TrainingState("--use-distributed-optimizer --seed 7")  # other weights: the load must replace them
    chunk, optimizer = state.model[0], state.optimizer
    model_sd = chunk.sharded_state_dict()
    loaded = dist_checkpointing.load({"model": model_sd,
                                      "optimizer": optimizer.sharded_state_dict(model_sd, is_loading=True)},
                                     f"{root}/iter_0000002")
    chunk.load_state_dict(loaded["model"])
    optimizer.load_state_dict(loaded["optimizer"])
    weights = {name: param.detach() for name, param in chunk.module.named_parameters()}
    moments = _torch_optimizer_state(optimizer)
    result = {
        "weights": set(weights) == set(saved_weights) and all(
            torch.equal(weights[name], saved_weights[name]) for name in weights),
        "moments": len(moments) == len(saved_moments) and all(
            mine.keys() == saved.keys() and all(torch.equal(mine[key], saved[key]) for key in mine)
            for mine, saved in zip(moments, saved_moments)),
        "moments_nonzero": all(state_["exp_avg"].abs().sum() > 0 for state_ in moments),
        "step": loaded["optimizer"]["optimizer.step"],
    }
    state.close()
    return result


@pytest.mark.parametrize("world_size", [2])
def test_own_loop_loads_a_pretrain_gpt_checkpoint(tmp_path, world_size):
    for result in run_on_ranks(world_size, _own_loop_loads_pretrain_checkpoint, str(tmp_path / "ckpt")):
        assert result == {"weights": True, "moments": True, "moments_nonzero": True, "step": 2.0}
