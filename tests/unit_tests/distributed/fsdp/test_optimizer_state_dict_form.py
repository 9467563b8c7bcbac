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
