"""Which saved optimizer param group, and which saved parameter state, belongs to which of this run's.

A param group is identified by what put its parameters in it (`get_param_groups`, `muon_param_groups`): weight
decay or not (`wd_mult`), the learning-rate multiplier (`lr_mult`), a decoupled learning rate (a `max_lr` of its
own, `--decoupled-lr`) and Muon (`use_muon`, `qkv_split`). The flags of a resumed run can regroup parameters, so
a saved group is matched to the current group of the same identity, never by position alone, and a checkpoint
that records the parameters' names (the torch format's `optimizer_param_names`) has its per-parameter state
matched by name. Where neither matches, loading raises an error naming the group and the flags.
"""

GROUPING_FLAGS = ("--decoupled-lr, --no-weight-decay-cond-type, --embedding-init-method-std, "
                  "--muon-split-qkv / --muon-no-split-qkv")


class ParamGroupMismatchError(ValueError):
    """The saved optimizer state cannot be matched to this run's parameter groups: the message names them."""


def group_identity(group):
    """What put a group's parameters together; None for a group built without `get_param_groups`' keys."""
    if "wd_mult" not in group and "use_muon" not in group:
        return None
    return (group.get("wd_mult"), group.get("lr_mult"), "max_lr" in group, bool(group.get("use_muon", False)),
            group.get("qkv_split"))


def describe_group(group):
    identity = group_identity(group)
    size = f"{len(group['params'])} parameters"
    if identity is None:
        return size
    wd_mult, lr_mult, decoupled, muon, qkv_split = identity
    words = ["weight-decayed" if wd_mult else "no weight decay", f"lr_mult {lr_mult}"]
    if decoupled:
        words.append("decoupled learning rate")
    if muon:
        words.append("Muon" + (f", fused QKV rows {qkv_split}" if qkv_split is not None else ""))
    return f"{', '.join(words)}; {size}"


def hyperparameters(group):
    return {key: value for key, value in group.items() if key != "params"}


def saved_group_for_each(current_groups, saved_groups):
    """[index into `saved_groups` of the group with each current group's identity, or None when it has none].
    Groups without identities (or with repeated ones) match by position when the counts agree."""
    current = [group_identity(group) for group in current_groups]
    saved = [group_identity(group) for group in saved_groups]
    identified = None not in current + saved and len(set(current)) == len(current) and len(set(saved)) == len(saved)
    if not identified:
        if len(saved_groups) != len(current_groups):
            return [None] * len(current_groups)
        return list(range(len(current_groups)))
    index_of = {identity: index for index, identity in enumerate(saved)}
    return [index_of.get(identity) for identity in current]


def _mismatch_advice():
    return (f"the parameter grouping changed since the save ({GROUPING_FLAGS}, or the model's parameters): resume "
            "with the flags it was saved with, or from a --ckpt-format torch_dist checkpoint (its state is matched "
            "by parameter name), or pass --no-load-optim to start the optimizer state afresh")


def check_groups_match(current_groups, saved_groups):
    """Raise `ParamGroupMismatchError` unless each saved group, position by position, has the current group's
    identity and size: the torch optimizers' own loading matches the state to the parameters by position."""
    if len(saved_groups) != len(current_groups):
        raise ParamGroupMismatchError(
            f"the checkpoint's optimizer has {len(saved_groups)} param groups ("
            f"{' | '.join(describe_group(group) for group in saved_groups)}) but this run's has {len(current_groups)} "
            f"({' | '.join(describe_group(group) for group in current_groups)}); {_mismatch_advice()}")
    for index, (current, saved) in enumerate(zip(current_groups, saved_groups)):
        identities = group_identity(current), group_identity(saved)
        if len(current["params"]) != len(saved["params"]) or (None not in identities and len(set(identities)) > 1):
            raise ParamGroupMismatchError(
                f"optimizer param group {index} of the checkpoint ({describe_group(saved)}) is not this run's "
                f"param group {index} ({describe_group(current)}); {_mismatch_advice()}")


def reorder_by_name(state_dict, saved_names, current_names, current_groups, current_params):
    """A Megatron optimizer's torch-style `state_dict` (`{"optimizer": torch state dict, ...}`, saved when the
    optimizer's parameters were `saved_names`, in its order) laid out for this run's optimizer, whose parameters
    are `current_params` named `current_names`, grouped as `current_groups`: each parameter's state (and
    fp32 main copy) by name. A group keeps the saved hyperparameters when it holds exactly the parameters of one
    saved group, else this run's. Returns (state dict, [the current groups whose hyperparameters are this run's]).
    """
    torch_state = state_dict["optimizer"]
    saved_groups = torch_state["param_groups"]
    saved_ids = [param_id for group in saved_groups for param_id in group["params"]]
    if len(saved_ids) != len(saved_names):
        raise ParamGroupMismatchError(
            f"the checkpoint names {len(saved_names)} optimizer parameters but its optimizer state holds "
            f"{len(saved_ids)}; {_mismatch_advice()}")
    saved_position = {name: position for position, name in enumerate(saved_names)}
    saved_group_of = [index for index, group in enumerate(saved_groups) for _ in group["params"]]
    missing = [name for name in current_names if name not in saved_position]
    if missing:
        shown = ", ".join(str(name) for name in missing[:4]) + (", ..." if len(missing) > 4 else "")
        raise ParamGroupMismatchError(
            f"the checkpoint's optimizer state has no state for {len(missing)} of this run's parameters ({shown}); "
            f"{_mismatch_advice()}")
    saved_main = state_dict.get("fp32_main_params")
    state, groups, main, regrouped = {}, [], [], []
    position = 0
    for group_index, group in enumerate(current_groups):
        params, sources = [], set()
        for _ in group["params"]:
            name, param = current_names[position], current_params[position]
            saved = saved_position[name]
            saved_state = torch_state["state"].get(saved_ids[saved])
            if saved_state is not None:
                for key, value in saved_state.items():
                    if hasattr(value, "shape") and value.dim() > 0 and tuple(value.shape) != tuple(param.shape):
                        raise ParamGroupMismatchError(
                            f"optimizer state {key!r} of parameter {name} has shape {tuple(value.shape)} in the "
                            f"checkpoint but the parameter is {tuple(param.shape)}; {_mismatch_advice()}")
                state[position] = saved_state
            if saved_main is not None:
                main.append(saved_main[saved])
            params.append(position)
            sources.add(saved_group_of[saved])
            position += 1
        source = next(iter(sources)) if len(sources) == 1 else None
        whole = source is not None and len(saved_groups[source]["params"]) == len(params)
        same_identity = whole and group_identity(saved_groups[source]) in (None, group_identity(group))
        if same_identity:
            groups.append({**hyperparameters(saved_groups[source]), "params": params})
        else:
            groups.append({**hyperparameters(group), "params": params})
            if params:
                regrouped.append(group_index)
    reordered = {**state_dict, "optimizer": {**torch_state, "state": state, "param_groups": groups}}
    if saved_main is not None:
        reordered["fp32_main_params"] = main
    return reordered, regrouped
