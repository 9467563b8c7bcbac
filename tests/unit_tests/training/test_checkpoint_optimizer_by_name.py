"""Torch-format checkpoints: the optimizer state is matched to the parameters by the names the checkpoint
records, whatever the order or grouping of this run's parameters."""

import contextlib
import io

import torch

from megatron.training import checkpointing
from tests.unit_tests.multiprocess_harness import run_on_ranks
from tests.unit_tests.training.torch_format_checkpoints import Scheduler, checkpoint_args


class TwoLayers(torch.nn.Module):
    def __init__(self, second_first):
        super().__init__()
        if second_first:  # the same names, built in the other order: named_parameters() lists `second` first
            self.second = torch.nn.Linear(4, 4)
            self.first = torch.nn.Linear(4, 4)
        else:
            self.first = torch.nn.Linear(4, 4)
            self.second = torch.nn.Linear(4, 4)

    def forward(self, inputs):
        return self.second(self.first(inputs))


def _optimizer(model, **kwargs):
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    return get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=0.1, weight_decay=0.1), [model], **kwargs)


def _resume_elsewhere_ordered_and_grouped(root):
    """{name: whether its loaded exp_avg is the saved one}, the groups' wd_mult, the load's line, for a run that
    lists the parameters in another order and, then, one that groups them otherwise."""
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel()
    args = checkpoint_args(root)
    torch.manual_seed(0)
    model = TwoLayers(second_first=False)
    optimizer = _optimizer(model)
    model(torch.randn(3, 4)).pow(2).sum().backward()
    optimizer.step()
    saved = {name: optimizer.optimizer.state[param]["exp_avg"].clone() for name, param in model.named_parameters()}
    checkpointing.save_checkpoint(1, model, optimizer, Scheduler(), args)

    results = []
    for kwargs in ({}, {"no_weight_decay_cond": lambda name, param: False}):  # the second: one group, not two
        resumed_model = TwoLayers(second_first=True)
        resumed = _optimizer(resumed_model, **kwargs)
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            checkpointing.load_checkpoint(resumed_model, resumed, Scheduler(), args)
        same = {name: torch.equal(resumed.optimizer.state[param]["exp_avg"], saved[name])
                for name, param in resumed_model.named_parameters()}
        results.append((same, [group["wd_mult"] for group in resumed.param_groups], printed.getvalue()))
    return results


def test_torch_format_optimizer_state_loads_by_parameter_name(tmp_path):
    reordered, regrouped = run_on_ranks(1, _resume_elsewhere_ordered_and_grouped, str(tmp_path))[0]
    every = {"first.weight": True, "first.bias": True, "second.weight": True, "second.bias": True}
    assert reordered[0] == every
    assert reordered[1] == [1.0, 0.0]
    assert "optimizer, scheduler" in reordered[2]
    assert regrouped[0] == every
    assert regrouped[1] == [1.0]  # this run's grouping and settings: the biases are weight-decayed now
    assert ("optimizer (state matched by parameter name; param group(s) 0 grouped otherwise in the checkpoint "
            "(--decoupled-lr, --no-weight-decay-cond-type") in regrouped[2]
