"""Expert tensors are checkpointed under their global expert index: a torch_dist checkpoint of model and optimizer
saved at one expert-parallel size (and wrapper) resumes at another exactly like the uninterrupted run."""

import pytest
import torch
import torch.distributed as dist

from megatron.core.dist_checkpointing import serialization, wrappers
from megatron.core.expert_parameters import global_expert_name
from tests.unit_tests.distributed import test_expert_data_parallel as expert_training
from tests.unit_tests.multiprocess_harness import run_on_ranks

SAVE_AFTER = 2


def _save_then_resume(directory, save_layout, load_layout):
    """Train `SAVE_AFTER` steps at `save_layout` (EP size, wrapper), save; rebuild at `load_layout`,
    load, train the remaining steps. Returns the checkpoint's keys and the resumed run's history and weights."""
    from megatron.core import parallel_state

    run = expert_training.TrainingRun(*save_layout)
    run.train(range(SAVE_AFTER))
    chunks = [run.ddp]
    state = {f"model.{name}": value for name, value in wrappers.model_state(chunks, for_saving=True).items()}
    state.update(wrappers.optimizer_state_to_save(run.optimizer, chunks))
    serialization.save(state, directory)
    parallel_state.destroy_model_parallel()

    run = expert_training.TrainingRun(*load_layout)
    chunks = [run.ddp]
    metadata = serialization.read_metadata(directory)
    targets, finish = wrappers.model_load_targets(chunks)
    prefixed = {f"model.{name}": value for name, value in targets.items()}
    mismatch = serialization.key_mismatch(prefixed, metadata, ["model."])
    assert not mismatch.missing and not mismatch.unexpected, mismatch
    serialization.load(prefixed, directory)
    finish({key[len("model."):] for key in prefixed})
    run.optimizer.reload_model_params()
    targets, install = wrappers.optimizer_load_targets(run.optimizer, chunks, list(metadata.state_dict_metadata))
    targets.update({key: None for key in ("optimizer.step", "optimizer.param_groups", "optimizer.grad_scaler")})
    install(serialization.load(targets, directory))
    history = run.train(range(SAVE_AFTER, expert_training.STEPS))
    return sorted(metadata.state_dict_metadata), history, run.global_parameters()


@pytest.mark.parametrize("save_layout, load_layout", [((2, "distributed_optimizer"), (1, "ddp")),
                                                      ((1, "ddp"), (2, "distributed_optimizer")),
                                                      ((2, "fsdp2"), (1, "distributed_optimizer"))],
                         ids=["ep2_distopt_to_ep1_ddp", "ep1_ddp_to_ep2_distopt", "ep2_fsdp2_to_ep1_distopt"])
def test_expert_checkpoint_resumes_at_another_expert_parallel_size(tmp_path, save_layout, load_layout):
    expected_history, expected_params = expert_training.uninterrupted_reference()
    results = run_on_ranks(expert_training.WORLD, _save_then_resume, str(tmp_path / "ckpt"), save_layout,
                           load_layout)
    keys, history, params = results[0]
    experts = {key for key in keys if ".local_experts." in key}
    # Every expert is saved once under its global index, with its Adam moments.
    assert {key for key in experts if key.startswith("model.")} == {
        f"model.{name}" for name in expected_params if ".local_experts." in name}
    assert "optimizer.state.mlp.experts.local_experts.3.linear_fc2.weight.exp_avg_sq" in experts
    for (loss, norm, zeros), (expected_loss, expected_norm, expected_zeros) in zip(
            history, expected_history[SAVE_AFTER:], strict=True):
        assert loss == pytest.approx(expected_loss, rel=1e-5)
        assert norm == pytest.approx(expected_norm, rel=1e-5)
        assert zeros == expected_zeros
    for name, expected in expected_params.items():
        torch.testing.assert_close(params[name], expected, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


def test_global_expert_name_renames_local_index_only_for_expert_parameters():
    expert = torch.nn.Parameter(torch.zeros(1))
    expert.allreduce, expert.expert_global_index = False, 5
    name = "decoder.layers.1.mlp.experts.local_experts.1.linear_fc1.weight"
    assert global_expert_name(name, expert) == "decoder.layers.1.mlp.experts.local_experts.5.linear_fc1.weight"
    dense = torch.nn.Parameter(torch.zeros(1))
    assert global_expert_name(name, dense) == name


ETP_MOE = ("--num-layers 1 --num-experts 4 --moe-router-topk 2 --moe-token-dispatcher-type alltoall "
           "--expert-model-parallel-size 2")
ETP_SAVED = "--tensor-model-parallel-size 2 --sequence-parallel --expert-tensor-parallel-size 1"
ETP_LOADED = {"tp2_etp2": "--tensor-model-parallel-size 2 --sequence-parallel --expert-tensor-parallel-size 2",
              "tp1": "--tensor-model-parallel-size 1"}


def _whole(part, param, group):
    """The whole tensor of `part`, this rank's slice of expert parameter `param` over `group` (its expert
    tensor-parallel ranks): strided partitions interleaved back in order."""
    size = dist.get_world_size(group)
    if size == 1 or not getattr(param, "tensor_model_parallel", False):
        return part.detach().clone()
    parts = [torch.empty_like(part) for _ in range(size)]
    dist.all_gather(parts, part.detach().contiguous(), group=group)
    stride, dim = param.partition_stride, param.partition_dim
    blocks = [piece.chunk(stride, dim=dim) for piece in parts]
    return torch.cat([blocks[rank][index] for index in range(stride) for rank in range(size)], dim=dim)


def _global_experts(state):
    """{global expert name: (whole weights, whole Adam exp_avg)} of the experts of `state`, from every rank."""
    from megatron.core import parallel_state
    from megatron.core.expert_parameters import is_expert_parameter

    group = parallel_state.get_expert_tensor_parallel_group()
    optimizer_state = state.optimizer.optimizer.state
    experts = {}
    for chunk in state.model:
        for name, param in chunk.module.named_parameters():
            if is_expert_parameter(param):
                experts[global_expert_name(name, param)] = (
                    _whole(param, param, group), _whole(optimizer_state[param]["exp_avg"], param, group))
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, experts)
    merged = {}
    for rank_experts in everyone:
        for name, tensors in rank_experts.items():
            if name in merged:  # a replica (expert data-parallel) holds the same values
                assert all(torch.equal(a, b) for a, b in zip(merged[name], tensors)), name
            merged[name] = tensors
    return merged


def _save_at_etp1_then_load(root, loaded_layouts):
    """Save at TP2 / ETP1 / EP2 after one optimizer step; load at each of `loaded_layouts`. Returns the saved
    experts and {layout: loaded experts}."""
    from megatron.training import checkpointing, dist_checkpoint
    from tests.unit_tests.dist_checkpointing.pretrain_helpers import TrainingState

    state = TrainingState(f"--ckpt-format torch_dist --save {root} {ETP_MOE} {ETP_SAVED}")
    state.train_steps(1)
    saved = _global_experts(state)
    checkpointing.save_checkpoint(1, state.model, state.optimizer, state.scheduler, state.args)
    state.close()
    loaded = {}
    for layout in loaded_layouts:
        state = TrainingState(f"--ckpt-format torch_dist --load {root} {ETP_MOE} {ETP_LOADED[layout]}")
        dist_checkpoint.load_dist_checkpoint(state.model, state.optimizer, state.scheduler, state.args, 1)
        loaded[layout] = _global_experts(state)
        state.close()
    return saved, loaded


def test_expert_checkpoint_saved_at_another_expert_tensor_parallel_size_loads_exactly(tmp_path):
    saved, loaded = run_on_ranks(4, _save_at_etp1_then_load, str(tmp_path / "ckpt"), list(ETP_LOADED))[0]
    # 4 experts, each with the weights and biases of fc1 and fc2
    assert len(saved) == 16 and all(exp_avg.abs().sum() > 0 for _, exp_avg in saved.values())
    for layout, experts in loaded.items():
        assert sorted(experts) == sorted(saved), layout
        for name, (weight, exp_avg) in saved.items():
            assert torch.equal(experts[name][0], weight), (layout, name)
            assert torch.equal(experts[name][1], exp_avg), (layout, name)
