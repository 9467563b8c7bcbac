"""Which parameters train is fixed when a model is wrapped: wrapping gives gradient buffers and main weights to
the groups of trainable parameters only, and the optimizer steps every trainable one each step (with a zero
gradient when none arrived). A parameter frozen afterwards would keep moving (Adam's momentum, weight decay; under
strategy 3 its gathered weights still require grad), and one unfrozen afterwards has no buffer for its gradient,
so the first forward after such a change stops with an error naming the parameter and saying what to do."""

from typing import List, Tuple

import torch


def trainability_at_wrap(groups, resting=None) -> List[Tuple[str, torch.nn.Parameter, bool]]:
    """(name, parameter, trainable) of every parameter of `groups` (ParamGroups), as wrapped; under strategy 3
    also of each one's resting parameter (`resting`, a RestingParameters), which the module shows between steps."""
    placeholders = resting.placeholders() if resting is not None else {}
    entries = []
    for group in groups:
        for name, param in zip(group.names, group.params):
            entries.append((name, param, group.trainable))
            if id(param) in placeholders:
                entries.append((name, placeholders[id(param)], group.trainable))
    return entries


def refuse_trainability_changes(entries) -> None:
    """Raise if a parameter's `requires_grad` differs from the one it had when it was wrapped."""
    for name, param, was_trainable in entries:
        if param.requires_grad == was_trainable:
            continue
        if was_trainable:
            raise ValueError(
                f"parameter '{name}' was frozen (requires_grad=False) after the model was wrapped; Megatron-FSDP "
                "fixes which parameters train when it wraps, and its optimizer would keep moving this one (momentum, "
                "weight decay). Freeze it before fully_shard / fully_shard_model, or, to stop training it "
                "mid-run, keep requires_grad=True and put it in a param group of its own whose 'lr' you set to 0")
        raise ValueError(
            f"parameter '{name}' was unfrozen (requires_grad=True) after the model was wrapped; Megatron-FSDP gives "
            "gradient buffers and main weights only to the parameters that require grad when it wraps. To train it "
            "later, wrap it with requires_grad=True, leave it out of the optimizer, and add it with "
            "optimizer.add_param_group(...) when it should start training")
