"""`preproc_state_dict_for_dcp_ckpt` chooses the optimizer state dict's form: name-keyed DTensors (for
torch.distributed.checkpoint) by default, or torch's own index-keyed state dict of this rank's shards, which
loads back exactly at the same data-parallel size. The model's DistributedDataParallelConfig sets the default."""

import copy

import pytest
import torch

from tests.unit_tests.distributed.fsdp import fsdp_test_models as models
from tests.unit_tests.multiprocess_harness import run_on_ranks


def _one_step(model, optimizer, seed):
    import torch.distributed as dist

    inputs, target = (models.local_slice(t, dist.get_rank(), dist.get_world_size())
                      for t in models.make_batches(1, seed=seed)[0])
    optimizer.zero_grad()
    models.loss_fn(model(inputs), target).backward()
    optimizer.step()


def _state_dict_forms():
    import megatron_fsdp
    from megatron_fsdp import DistributedDataParallelConfig, MegatronFSDP

    forms = {}
    for preproc in (True, False):
        module = models.make_model(0)
        config = DistributedDataParallelConfig(data_parallel_sharding_strategy=3,
                                               preproc_state_dict_for_dcp_ckpt=preproc)
        model = MegatronFSDP(module, config, fsdp_unit_modules=[models.Block])
        optimizer = megatron_fsdp.fully_shard_optimizer(
            models.make_optimizer([p for p in module.parameters() if p.requires_grad]))  # form from the config
        _one_step(model, optimizer, seed=1)
        saved = copy.deepcopy(optimizer.state_dict())
        before = _moments(optimizer)
        _one_step(model, optimizer, seed=2)
        moved = _moments(optimizer)
        optimizer.load_state_dict(saved)
        after = _moments(optimizer)
        keys = sorted({type(key).__name__ for key in saved["state"]})
        dtensors = any(hasattr(value, "full_tensor") for state in saved["state"].values() for value in state.values())
        forms[preproc] = {
            "keys": keys,
            "dtensors": dtensors,
            "moments": (len(before), sum(m.numel() for m in before)),
            # The second step changed every (non-empty) moment, so equality after loading is the load's doing.
            "step_moved_all": len(moved) == len(before)
                              and all(a.numel() == 0 or not torch.equal(a, b) for a, b in zip(before, moved)),
            "restored": (len(after), sum(torch.equal(a, b) for a, b in zip(before, after))),
        }
    return forms


def _moments(optimizer):
    """Both Adam moments of every parameter this rank holds state for, flattened, in the optimizer's order."""
    moments = []
    for state in optimizer.state.values():
        for name in ("exp_avg", "exp_avg_sq"):
            value = state[name]
            value = value.to_local() if hasattr(value, "to_local") else value
            moments.append(value.detach().reshape(-1).clone())
    return moments


@pytest.mark.parametrize("world_size", [2])
def test_state_dict_form_follows_preproc_flag(world_size):
    for forms in run_on_ranks(world_size, _state_dict_forms):
        for preproc, (keys, dtensors) in {True: (["str"], True), False: (["int"], False)}.items():
            form = forms[preproc]
            assert (form["keys"], form["dtensors"]) == (keys, dtensors)
            count, elements = form["moments"]
            assert count > 0 and elements > 0 and form["step_moved_all"]
            # As many moments after loading as before, each equal to its saved value.
            assert form["restored"] == (count, count)


def _scalar_parameter_state_moves_between_strategies(pairs, optimizer_name):
    import torch.distributed as dist

    import megatron_fsdp

    def build(strategy, seed):
        torch.manual_seed(seed)
        module = models.ScaledLinear()
        optimizer = (torch.optim.AdamW(module.parameters(), lr=1e-2) if optimizer_name == "adamw"
                     else torch.optim.SGD(module.parameters(), lr=1e-2, momentum=0.9))
        return megatron_fsdp.fully_shard(module, optimizer, zero_dp_strategy=strategy)

    def weights(model):
        return {key: value.full_tensor() if hasattr(value, "full_tensor") else value.clone()
                for key, value in model.state_dict().items()}

    differences = {}
    for saved_at, loaded_at in pairs:
        model, optimizer = build(saved_at, seed=0)
        _one_step(model, optimizer, seed=1)
        model_state, optimizer_state = model.state_dict(), optimizer.state_dict()
        other_model, other_optimizer = build(loaded_at, seed=3)
        other_model.load_state_dict(model_state)
        other_optimizer.load_state_dict(optimizer_state)
        for step_model, step_optimizer in ((model, optimizer), (other_model, other_optimizer)):
            _one_step(step_model, step_optimizer, seed=2)
        expected, loaded = weights(model), weights(other_model)
        differences[(saved_at, loaded_at)] = max((expected[key] - loaded[key]).abs().max().item() for key in expected)
    dist.barrier()
    return differences


@pytest.mark.parametrize("world_size", [2])
def test_zero_dim_parameter_optimizer_state_loads_across_strategies(world_size):
    """A 0-dim parameter's moments saved at one strategy load at another, and the next step is the one the
    saving model takes (they used to be loaded as per-parameter scalars, and the step raised)."""
    adam_pairs = [(3, 3), (0, 1), (1, 0), (2, 3)]
    sgd_pairs = [(1, 1), (3, 0)]
    for optimizer_name, pairs in (("adamw", adam_pairs), ("sgd", sgd_pairs)):
        for differences in run_on_ranks(world_size, _scalar_parameter_state_moves_between_strategies, pairs,
                                        optimizer_name):
            assert differences == {pair: 0.0 for pair in pairs}, optimizer_name
