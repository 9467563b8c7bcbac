"""Expert parameters under DDP, the distributed optimizer and FSDP2: reduced (and sharded) over the expert
data-parallel group, counted once in the gradient norm and the zero count. Two ranks at EP1 (experts replicated,
expert-DP 2) and EP2 (each rank its own experts, expert-DP 1) must both train like one process holding every
expert. (Megatron-FSDP at EP2: tests/unit_tests/distributed/fsdp/test_expert_parallel.py, on these runs.)"""

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.distributed.torch_fully_sharded_data_parallel import TorchFSDP2
from megatron.core.model_parallel_config import ModelParallelConfig
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.training.training_log import format_memory_line, memory_usage
from tests.unit_tests.distributed.expert_toy_model import (
    ToyMoELayer,
    ToyMoEModel,
    mse_loss,
    named_parameters_by_global_name,
    toy_batch,
)
from tests.unit_tests.multiprocess_harness import run_on_ranks

LR, WEIGHT_DECAY, CLIP_GRAD, SAMPLES_PER_RANK, STEPS, WORLD = 0.02, 0.1, 0.5, 6, 3, 2


def _optimizer_config(use_distributed_optimizer):
    return OptimizerConfig(lr=LR, weight_decay=WEIGHT_DECAY, clip_grad=CLIP_GRAD,
                           use_distributed_optimizer=use_distributed_optimizer, log_num_zeros_in_grad=True)


WRAPPERS = ("ddp", "distributed_optimizer", "fsdp2")
# Megatron-FSDP settings (DistributedDataParallelConfig fields) by wrapper name, for the Megatron-FSDP expert tests
MEGATRON_FSDP_WRAPPERS = {
    "megatron_fsdp_z1": {"data_parallel_sharding_strategy": "optim"},
    "megatron_fsdp_z2": {"data_parallel_sharding_strategy": "optim_grads"},
    "megatron_fsdp_z3": {"data_parallel_sharding_strategy": "optim_grads_params"},
    "megatron_fsdp_z3_average": {"data_parallel_sharding_strategy": "optim_grads_params",
                                 "average_in_collective": True},
    # HFSDP: with num_distributed_optimizer_instances > 1, the optimizer side split across the instances too
    "megatron_fsdp_z3_hfsdp": {"data_parallel_sharding_strategy": "optim_grads_params",
                               "outer_dp_sharding_strategy": "optim"},
}


class TrainingRun:
    """The toy MoE model on this rank at `expert_model_parallel_size`, wrapped in `wrapper` (one of `WRAPPERS`),
    with its optimizer. Megatron-FSDP wrappers (HSDP / HFSDP) and the distributed optimizer take
    `num_distributed_optimizer_instances`."""

    def __init__(self, expert_model_parallel_size, wrapper, num_distributed_optimizer_instances=1):
        parallel_state.initialize_model_parallel(expert_model_parallel_size=expert_model_parallel_size,
                                                 num_distributed_optimizer_instances=num_distributed_optimizer_instances)
        self.model = ToyMoEModel(ep_group=parallel_state.get_expert_model_parallel_group())
        config = ModelParallelConfig(expert_model_parallel_size=expert_model_parallel_size)
        use_distributed_optimizer = wrapper == "distributed_optimizer"
        if wrapper == "fsdp2":
            ddp_config = DistributedDataParallelConfig(use_torch_fsdp2=True)
            self.ddp = TorchFSDP2(config, ddp_config, self.model, fsdp_unit_modules=(ToyMoELayer,))
        elif wrapper in MEGATRON_FSDP_WRAPPERS:
            from megatron.core.distributed.fsdp.mcore_fsdp_adapter import MegatronFSDPAdapter

            ddp_config = DistributedDataParallelConfig(
                use_megatron_fsdp=True, overlap_grad_reduce=True, overlap_param_gather=True,
                num_distributed_optimizer_instances=num_distributed_optimizer_instances,
                **MEGATRON_FSDP_WRAPPERS[wrapper])
            self.ddp = MegatronFSDPAdapter(config, ddp_config, self.model, fsdp_unit_modules=(ToyMoELayer,))
        else:
            ddp_config = DistributedDataParallelConfig(
                use_distributed_optimizer=use_distributed_optimizer, overlap_grad_reduce=True,
                overlap_param_gather=use_distributed_optimizer, bucket_size=150,
                num_distributed_optimizer_instances=num_distributed_optimizer_instances)
            self.ddp = DistributedDataParallel(config, ddp_config, self.model)
        self.optimizer = get_megatron_optimizer(_optimizer_config(use_distributed_optimizer), [self.ddp])

    def train(self, steps):
        """[(loss averaged over ranks, grad norm, zero count)] of `steps`: each step's global batch of
        `SAMPLES_PER_RANK * WORLD` samples split evenly over however many ranks there are."""
        rank, world = dist.get_rank(), dist.get_world_size()
        per_rank = SAMPLES_PER_RANK * WORLD // world
        history = []
        for step in steps:
            inputs, targets = toy_batch(step, SAMPLES_PER_RANK * WORLD)
            local = slice(rank * per_rank, (rank + 1) * per_rank)
            self.ddp.zero_grad_buffer()
            self.optimizer.zero_grad()
            loss = mse_loss(self.ddp, inputs[local], targets[local])
            loss.backward()
            finalize_model_grads([self.ddp])
            update_successful, grad_norm, num_zeros = self.optimizer.step()
            assert update_successful
            mean_loss = loss.detach().clone()
            dist.all_reduce(mean_loss)
            history.append((mean_loss.item() / world, grad_norm, num_zeros))
        return history

    def global_parameters(self):
        """{name with global expert indices: weights} of the whole model, assembled from every rank."""
        self.ddp.finish_param_sync()
        params = {name: full_tensor(param).detach().clone()
                  for name, param in named_parameters_by_global_name(self.model).items()}
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, params)
        merged = {}
        for rank_params in everyone:
            merged.update(rank_params)
        return merged


def full_tensor(tensor):
    """A DTensor (FSDP2) gathered over its mesh; a plain tensor itself."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def _train_on_ranks(expert_model_parallel_size, wrapper):
    run = TrainingRun(expert_model_parallel_size, wrapper)
    expert_data_parallel_size = WORLD // expert_model_parallel_size
    if wrapper == "fsdp2":
        assert [unit.experts if hasattr(unit, "experts") else unit for unit in run.ddp.expert_units] == [
            run.model.mlp.experts]
        assert run.ddp.expert_mesh.size() == expert_data_parallel_size
    else:
        expert_groups = run.ddp.expert_groups
        assert [buffer.groups for buffer in run.ddp.buffers].count(expert_groups) == 1
        assert dist.get_world_size(expert_groups.data_parallel_group) == expert_data_parallel_size
    history = run.train(range(STEPS))
    memory = memory_usage([run.ddp], run.optimizer, torch.device("cpu"))
    expert_memory = {key: value for key, value in memory.items() if key.startswith("expert_")}
    assert "experts: params" in format_memory_line(dist.get_rank(), memory)
    return history, run.global_parameters(), expert_memory


def _reference():
    model = ToyMoEModel()
    decay = [param for param in model.parameters() if param.dim() >= 2]
    no_decay = [param for param in model.parameters() if param.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": WEIGHT_DECAY},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=LR)
    history = []
    for step in range(STEPS):
        inputs, targets = toy_batch(step, SAMPLES_PER_RANK * WORLD)
        optimizer.zero_grad()
        loss = mse_loss(model, inputs, targets)
        loss.backward()
        # An expert that no token chose has a zero gradient in the DDP buffers (and is still weight-decayed).
        for param in model.parameters():
            if param.grad is None:
                param.grad = torch.zeros_like(param)
        num_zeros = sum(int((param.grad == 0).sum()) for param in model.parameters())
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP_GRAD).item()
        optimizer.step()
        history.append((loss.item(), grad_norm, num_zeros))
    return history, {name: param.detach() for name, param in named_parameters_by_global_name(model).items()}


_REFERENCE = []


def uninterrupted_reference():
    """One process, every expert, the whole batch: torch AdamW with the same weight-decay rule and clipping.
    Returns (history, {name: final weights}); computed once per test session."""
    if not _REFERENCE:
        _REFERENCE.append(_reference())
    return _REFERENCE[0]


@pytest.fixture(scope="module")
def reference():
    return uninterrupted_reference()


@pytest.mark.parametrize("wrapper", WRAPPERS)
@pytest.mark.parametrize("expert_model_parallel_size", [1, 2], ids=["ep1", "ep2"])
def test_expert_parallel_training_equals_one_process(reference, expert_model_parallel_size, wrapper):
    expected_history, expected_params = reference
    results = run_on_ranks(WORLD, _train_on_ranks, expert_model_parallel_size, wrapper)
    history, params, _ = results[0]
    _check_expert_memory([memory for _, _, memory in results], expected_params, expert_model_parallel_size, wrapper)
    assert any(norm > CLIP_GRAD for _, norm, _ in expected_history)  # clipping is exercised
    assert any(zeros > 0 for _, _, zeros in expected_history)  # experts without tokens: zero gradients
    for (loss, norm, zeros), (expected_loss, expected_norm, expected_zeros) in zip(history, expected_history,
                                                                                  strict=True):
        assert loss == pytest.approx(expected_loss, rel=1e-5)
        assert norm == pytest.approx(expected_norm, rel=1e-5)
        assert zeros == expected_zeros
    assert sorted(params) == sorted(expected_params)
    for name, expected in expected_params.items():
        torch.testing.assert_close(params[name], expected, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


def _check_expert_memory(memory_per_rank, all_params, expert_model_parallel_size, wrapper):
    """The memory line's expert bytes against the sharding theory: a rank holds 1/EP of the experts' fp32 weights
    and gradients (FSDP2: also 1/expert-DP), and Adam's two moments of what it steps (the distributed optimizer:
    of its shards, which it steps in place in the fp32 weights; exact over the expert data-parallel ranks together)."""
    expert_bytes = 4 * sum(param.numel() for name, param in all_params.items() if ".local_experts." in name)
    expert_data_parallel_size = WORLD // expert_model_parallel_size
    local = expert_bytes // expert_model_parallel_size
    sharded = local // expert_data_parallel_size if wrapper == "fsdp2" else local
    for memory in memory_per_rank:
        assert memory["expert_params_bytes"] == sharded
        assert memory["expert_grads_bytes"] == sharded
        if wrapper != "distributed_optimizer":
            assert memory["expert_optimizer_state_bytes"] == 2 * sharded
    if wrapper == "distributed_optimizer":  # shards of uneven buckets: exact over each expert data-parallel group
        total = sum(memory["expert_optimizer_state_bytes"] for memory in memory_per_rank)
        assert total == 2 * local * expert_model_parallel_size


def _megatron_fsdp_hybrid_error_at_ep2():
    """Two instances cannot split the expert data-parallel group of one rank (EP2 on two ranks)."""
    from megatron.core.distributed.fsdp.mcore_fsdp_adapter import MegatronFSDPAdapter

    parallel_state.initialize_model_parallel(expert_model_parallel_size=2, num_distributed_optimizer_instances=2)
    model = ToyMoEModel(ep_group=parallel_state.get_expert_model_parallel_group())
    with pytest.raises(ValueError) as error:
        MegatronFSDPAdapter(ModelParallelConfig(expert_model_parallel_size=2),
                            DistributedDataParallelConfig(use_megatron_fsdp=True, num_distributed_optimizer_instances=2),
                            model)
    return str(error.value)


def _hybrid_distributed_optimizer_error_at_ep2():
    """The same under DDP's distributed optimizer."""
    parallel_state.initialize_model_parallel(expert_model_parallel_size=2, num_distributed_optimizer_instances=2)
    model = ToyMoEModel(ep_group=parallel_state.get_expert_model_parallel_group())
    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=True, num_distributed_optimizer_instances=2)
    with pytest.raises(ValueError) as error:
        DistributedDataParallel(ModelParallelConfig(expert_model_parallel_size=2), ddp_config, model)
    return str(error.value)


def test_refusals_name_the_flags():
    for error_at_ep2 in (_megatron_fsdp_hybrid_error_at_ep2, _hybrid_distributed_optimizer_error_at_ep2):
        message = run_on_ranks(WORLD, error_at_ep2)[0]
        assert "--num-distributed-optimizer-instances 2 does not divide the expert data-parallel size 1" in message
        assert "--expert-model-parallel-size" in message


def _weight_hash_check(expert_model_parallel_size, perturb_expert):
    from types import SimpleNamespace

    from megatron.training.run_control import check_weight_hashes

    run = TrainingRun(expert_model_parallel_size, "ddp")
    if perturb_expert and dist.get_rank() == 1:
        with torch.no_grad():
            run.model.mlp.experts.local_experts[0].linear_fc1.weight[0, 0] += 1e-6
    try:
        return check_weight_hashes([run.ddp], 1, SimpleNamespace(device=torch.device("cpu")))
    except RuntimeError as error:
        return str(error)


def test_weight_hash_check_compares_experts_over_expert_data_parallel_ranks():
    # EP2: the ranks hold different experts, which is no mismatch; EP1: a replica that drifted is named.
    assert run_on_ranks(WORLD, _weight_hash_check, 2, False) == [True, True]
    messages = run_on_ranks(WORLD, _weight_hash_check, 1, True)
    assert all("mlp.experts.local_experts.0.linear_fc1.weight" in message for message in messages)


def _reduced_gradients(expert_model_parallel_size, use_distributed_optimizer):
    """{global name: reduced main_grad} of this rank after one backward under DDP with average_in_collective."""
    parallel_state.initialize_model_parallel(expert_model_parallel_size=expert_model_parallel_size)
    model = ToyMoEModel(ep_group=parallel_state.get_expert_model_parallel_group())
    ddp = DistributedDataParallel(ModelParallelConfig(expert_model_parallel_size=expert_model_parallel_size),
                                  DistributedDataParallelConfig(average_in_collective=True,
                                                                use_distributed_optimizer=use_distributed_optimizer),
                                  model)
    inputs, targets = toy_batch(0, SAMPLES_PER_RANK * WORLD)
    local = slice(dist.get_rank() * SAMPLES_PER_RANK, (dist.get_rank() + 1) * SAMPLES_PER_RANK)
    mse_loss(ddp, inputs[local], targets[local]).backward()
    finalize_model_grads([ddp])
    return {name: param.main_grad.clone() for name, param in named_parameters_by_global_name(model).items()}


@pytest.mark.parametrize("use_distributed_optimizer", [False, True], ids=["ddp", "distributed_optimizer"])
@pytest.mark.parametrize("expert_model_parallel_size", [1, 2], ids=["ep1", "ep2"])
def test_average_in_collective_gives_expert_gradients_the_full_batch_mean(expert_model_parallel_size,
                                                                           use_distributed_optimizer):
    """--ddp-average-in-collective: AVG over the expert data-parallel group (DP / EP ranks) alone would leave expert
    gradients EP times the full-batch mean gradient; they must equal it, like the dense ones."""
    model = ToyMoEModel()
    inputs, targets = toy_batch(0, SAMPLES_PER_RANK * WORLD)
    mse_loss(model, inputs, targets).backward()
    expected = {name: torch.zeros_like(param) if param.grad is None else param.grad
                for name, param in named_parameters_by_global_name(model).items()}
    reduced = {}
    for rank_gradients in run_on_ranks(WORLD, _reduced_gradients, expert_model_parallel_size,
                                       use_distributed_optimizer):
        reduced.update(rank_gradients)
    assert sorted(reduced) == sorted(expected)
    assert any(".local_experts." in name and expected[name].abs().sum() > 0 for name in expected)
    for name, gradient in expected.items():
        torch.testing.assert_close(reduced[name], gradient, rtol=1e-5, atol=1e-7, msg=lambda m: f"{name}: {m}")
