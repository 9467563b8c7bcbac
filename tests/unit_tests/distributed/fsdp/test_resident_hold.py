"""Under ZeRO-3 a resident group (sharded over one rank: its compute weights are its shard, nothing is freed)
stays gathered and shown through a step's forwards and backwards, and is hidden behind its resting parameter once
the step's last backward is done, instead of being hidden and shown again around every use; a unit whose output
is one tensor hooks the start of its backward through that tensor's own gradient hook. Training is unchanged:
the losses are the one-process reference's."""

import pytest
import torch

from tests.unit_tests.distributed.fsdp import fsdp_test_models as models
from tests.unit_tests.multiprocess_harness import run_on_ranks

NUM_STEPS, MICROBATCHES = 2, 2


def _train_counting_shows_and_hooks():
    import megatron_fsdp
    from torch.distributed.tensor import DTensor

    module = models.make_model(0)
    model, optimizer = megatron_fsdp.fully_shard(module, models.make_optimizer(list(module.parameters())),
                                                 fsdp_unit_modules=[models.Block], zero_dp_strategy=3)
    resting = model.schedule.resting
    shows, hides, multi_hooks = [], [], []
    show, hide = resting.show, resting.hide

    def counted_show(group):
        shows.append(id(group) if id(group) in resting._hidden else None)
        show(group)

    def counted_hide(group):
        hides.append(id(group) if id(group) not in resting._hidden else None)
        hide(group)

    resting.show, resting.hide = counted_show, counted_hide
    register_multi = torch.autograd.graph.register_multi_grad_hook

    def counted_multi(tensors, fn, **kwargs):
        multi_hooks.append(len(tensors))
        return register_multi(tensors, fn, **kwargs)

    torch.autograd.graph.register_multi_grad_hook = counted_multi
    try:
        losses = models.train_sharded(model, optimizer, NUM_STEPS, microbatches=MICROBATCHES)
    finally:
        torch.autograd.graph.register_multi_grad_hook = register_multi
    hidden_between_steps = all(isinstance(param, DTensor) for param in model.module.parameters())
    swaps = lambda records: sum(1 for record in records if record is not None)  # noqa: E731
    return {"losses": losses, "resident": all(group.resident for group in model.groups), "groups": len(model.groups),
            "shows": swaps(shows), "hides": swaps(hides), "multi_hooks": multi_hooks,
            "hidden_between_steps": hidden_between_steps}


@pytest.mark.parametrize("world_size", [1])
def test_resident_groups_are_shown_once_per_step_and_hidden_after_it(world_size):
    reference, _ = models.reference_losses(NUM_STEPS)
    for result in run_on_ranks(world_size, _train_counting_shows_and_hooks):
        assert result["resident"]
        torch.testing.assert_close(result["losses"], reference, rtol=1e-5, atol=0)
        # each step shows each group once (its first forward) and hides it once (the end of the last backward);
        # the last evaluation forward shows them once more and hides them after it
        assert result["shows"] == result["groups"] * (NUM_STEPS + 1), result
        assert result["hides"] == result["groups"] * (NUM_STEPS + 1), result
        assert result["hidden_between_steps"]
        assert result["multi_hooks"] == []  # every unit and the root return one tensor
