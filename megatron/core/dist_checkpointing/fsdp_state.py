"""Logical state of Megatron-FSDP model chunks (`--use-megatron-fsdp`, ZeRO-0..3, HSDP / HFSDP).

Megatron-FSDP's own state dicts are already close to the logical format: `state_dict()` gives one DTensor per
parameter with the full (tensor-parallel-unpartitioned) shape, holding this rank's rows; the optimizer's state
dict is keyed by parameter name, with `main_param` for main weights kept in another dtype than the model's.
Here they are renamed to logical names (global layer indices; the tied output-layer copy of a later pipeline
stage is the word embedding), their DTensors become `ShardedLogicalTensor` boxes, and loading goes back
through Megatron-FSDP's `load_state_dict`s, which put the rows into its flat shards.

FSDP2 chunks need none of this: their parameters are DTensors of the TP partition's shape, handled with
Megatron's DDP path in model_state / optimizer_state. Names and keys come from `logical_names`, boxes from
`logical_tensor`.
"""

import sys

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from megatron.core.dist_checkpointing.logical_names import (
    GRAD_SCALER_KEY,
    MAIN_PARAM_KEY,
    PARAM_GROUPS_KEY,
    STEP_KEY,
    TIED_EMBEDDING_NAME,
    layer_offset_of,
    logical_name,
    optimizer_state_keys_of,
    state_key,
)
from megatron.core.dist_checkpointing.logical_tensor import ShardedLogicalTensor
from megatron.core.dist_checkpointing.param_groups import saved_group_for_each
from megatron.core.distributed.data_parallel_base import unwrap_model
from megatron.core.expert_parameters import global_expert_name

PACKAGE_MAIN_PARAM_KEY = "main_param"  # megatron_fsdp.state_dict.MAIN_PARAM_KEY


def _adapter_class():
    """`MegatronFSDPAdapter` when its module is loaded (no chunk can be one otherwise); looked up without importing
    it, since the adapter names its checkpoint entries with this module."""
    adapter_module = sys.modules.get("megatron.core.distributed.fsdp.mcore_fsdp_adapter")
    return getattr(adapter_module, "MegatronFSDPAdapter", None) if adapter_module is not None else None


def is_fsdp_chunk(chunk) -> bool:
    """Whether `chunk` is sharded by Megatron-FSDP: the Megatron-Core adapter, or a bare package wrapper."""
    from megatron.core.distributed.data_parallel_base import _package_wrapper_class

    wrapper_classes = tuple(cls for cls in (_adapter_class(), _package_wrapper_class()) if cls is not None)
    return bool(wrapper_classes) and isinstance(chunk, wrapper_classes)


def _names(chunk):
    """{module key: (logical name, saved by this rank)} for the chunk's parameters."""
    module = unwrap_model(chunk)
    offset = layer_offset_of(module)
    result = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        real = chunk.real_parameter(param) if hasattr(chunk, "real_parameter") else param
        if getattr(real, "shared", False) and getattr(real, "shared_embedding", False):
            result[name] = (TIED_EMBEDDING_NAME, False)
        else:
            result[name] = (logical_name(global_expert_name(name, real), offset), True)
    return result, offset


def logical_names(chunk):
    """state-dict key -> its name in the logical model, for the keys of the chunk's `state_dict()`: global layer
    and expert indices; a later stage's tied output-layer copy is the word embedding."""
    names, offset = _names(chunk)
    return lambda key: names[key][0] if key in names else logical_name(key, offset)


def _as_logical(value):
    if torch.is_tensor(value):  # DTensors included
        return ShardedLogicalTensor.from_local(value)
    return value


def model_state(model_chunks, for_saving):
    state = {}
    for chunk in model_chunks:
        names, offset = _names(chunk)
        for key, value in chunk.state_dict().items():
            name, saved_here = names.get(key, (logical_name(key, offset), True))
            if for_saving and not saved_here:
                continue
            if torch.is_tensor(value):
                state[name] = _as_logical(value)
    return state


def model_load_targets(model_chunks, fp32_names=()):
    """(targets, finish): fill the targets, then `finish()` loads them into the Megatron-FSDP chunks. The weights
    named in `fp32_names` (held in fp32 by the checkpoint) are read into fp32 copies of bf16 / fp16 weights, so
    that loading writes them unrounded into fp32 main weights (the compute weights take them rounded)."""
    targets, loads = {}, []
    for chunk in model_chunks:
        names, offset = _names(chunk)
        template = chunk.state_dict()
        by_key = {}
        for key, value in template.items():
            if not torch.is_tensor(value):
                continue
            name = names.get(key, (logical_name(key, offset), True))[0]
            if name in fp32_names and value.dtype in (torch.bfloat16, torch.float16):
                value = template[key] = value.to(torch.float32)
            targets[name] = _as_logical(value)
            by_key[key] = name
        loads.append((chunk, template, by_key))

    def finish(loaded_names):
        for chunk, template, by_key in loads:
            present = {key: template[key] for key, name in by_key.items() if name in loaded_names}
            chunk.load_state_dict(present, strict=len(present) == len(by_key))

    return targets, finish


def _checked_torch_optimizer(torch_optimizer):
    if not hasattr(torch_optimizer, "_megatron_fsdp_model"):
        raise ValueError("a Megatron-FSDP chunk's optimizer must come from megatron_fsdp.fully_shard_optimizer")
    return torch_optimizer


def _chunk_optimizers(optimizer, model_chunks):
    """[(chunk, its torch optimizer, the index in the optimizer's param groups of each of its groups)], and the
    number of those param groups. A `MegatronFSDPOptimizer` has one torch optimizer per chunk holding parameters
    (a chunk without any, an empty pipeline stage, has none); another optimizer wrapper holds one torch optimizer
    for a single chunk in `.optimizer`."""
    entries = getattr(optimizer, "chunk_optimizers", None)
    if entries is None:
        if len(model_chunks) != 1:
            raise ValueError(f"Megatron-FSDP checkpoints of {len(model_chunks)} model chunks need their "
                             "MegatronFSDPOptimizer (one torch optimizer per chunk)")
        torch_optimizer = _checked_torch_optimizer(optimizer.optimizer)
        count = len(torch_optimizer.param_groups)
        return [(model_chunks[0], torch_optimizer, list(range(count)))], count
    if [id(chunk) for chunk in optimizer.chunks] != [id(chunk) for chunk in model_chunks]:
        raise ValueError("the optimizer steps other model chunks than the ones checkpointed")
    return ([(entry.chunk, _checked_torch_optimizer(entry.optimizer), list(entry.group_indices))
             for entry in entries], optimizer.num_param_groups)


def _name_keyed_state(torch_optimizer):
    state = torch_optimizer.state_dict()
    groups = state["param_groups"]
    if groups and groups[0]["params"] and not isinstance(groups[0]["params"][0], str):
        raise ValueError("Megatron-FSDP optimizer state dict is not keyed by parameter name; build the model with "
                         "preproc_state_dict_for_dcp_ckpt=True")
    return state


def _agreed_step(steps, device):
    local = max(steps) if steps else -1.0
    if dist.is_initialized() and dist.get_world_size() > 1:
        value = torch.tensor([local], dtype=torch.float64, device=device)
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
        local = value.item()
    return None if local < 0 else local


def optimizer_state_to_save(optimizer, model_chunks, include_tied_copies=False):
    """The state of every chunk's optimizer under the logical names of its parameters (global layer numbers),
    so the keys do not depend on how the layers are split into chunks; the param groups' hyper-parameters once
    per group of the optimizer (the first chunk holding that group gives them)."""
    entries, num_groups = _chunk_optimizers(optimizer, model_chunks)
    state, steps = {}, []
    groups = [None] * num_groups
    for chunk, torch_optimizer, group_indices in entries:
        names, offset = _names(chunk)
        saved = _name_keyed_state(torch_optimizer)
        for key, values in saved["state"].items():
            name, saved_here = names.get(key, (logical_name(key, offset), True))
            for state_name, value in values.items():
                if state_name == "step":
                    steps.append(float(value))
                elif isinstance(value, DTensor) and value.dim() > 0 and (saved_here or include_tied_copies):
                    target_name = MAIN_PARAM_KEY if state_name == PACKAGE_MAIN_PARAM_KEY else state_name
                    state[state_key(name, target_name)] = _as_logical(value)
        for index, group in zip(group_indices, saved["param_groups"]):
            if groups[index] is None:
                groups[index] = {k: v for k, v in group.items() if k != "params"}
    state[STEP_KEY] = _agreed_step(steps, model_chunks[0].device)
    state[PARAM_GROUPS_KEY] = [group for group in groups if group is not None]
    state[GRAD_SCALER_KEY] = None if optimizer.grad_scaler is None else optimizer.grad_scaler.state_dict()
    return state


def optimizer_load_targets(optimizer, model_chunks, saved_keys):
    entries, _ = _chunk_optimizers(optimizer, model_chunks)
    targets, loads = {}, []
    for chunk, torch_optimizer, group_indices in entries:
        names, offset = _names(chunk)
        template = _name_keyed_state(torch_optimizer)
        for key, values in template["state"].items():
            name = names.get(key, (logical_name(key, offset), True))[0]
            available = set(optimizer_state_keys_of(name, saved_keys))
            for state_name, value in values.items():
                target_name = MAIN_PARAM_KEY if state_name == PACKAGE_MAIN_PARAM_KEY else state_name
                if isinstance(value, DTensor) and value.dim() > 0 and target_name in available:
                    targets[state_key(name, target_name)] = _as_logical(value)
        loads.append((torch_optimizer, group_indices, names, offset, template))

    def install(loaded):
        step = loaded.get(STEP_KEY)
        saved_groups = loaded.get(PARAM_GROUPS_KEY)
        current_groups = {}  # index in the optimizer's param groups -> the group (its first chunk's)
        for _, group_indices, _, _, template in loads:
            for index, group in zip(group_indices, template["param_groups"]):
                current_groups.setdefault(index, group)
        indices = sorted(current_groups)
        saved_index_of = {} if saved_groups is None else dict(zip(indices, saved_group_for_each(
            [current_groups[index] for index in indices], saved_groups)))
        for torch_optimizer, group_indices, names, offset, template in loads:
            state = {}
            for key, values in template["state"].items():
                name = names.get(key, (logical_name(key, offset), True))[0]
                entry = {}
                for state_name, value in values.items():
                    target_name = MAIN_PARAM_KEY if state_name == PACKAGE_MAIN_PARAM_KEY else state_name
                    if state_key(name, target_name) in targets:
                        entry[state_name] = value  # filled in place through its ShardedLogicalTensor view
                    elif state_name == "step" and step is not None:
                        entry[state_name] = torch.tensor(float(step), dtype=value.dtype, device=value.device) \
                            if torch.is_tensor(value) else step
                if entry:
                    state[key] = entry
            groups = [group if saved_index_of.get(index) is None else {**group, **saved_groups[saved_index_of[index]]}
                      for group, index in zip(template["param_groups"], group_indices)]
            torch_optimizer.load_state_dict({"state": state, "param_groups": groups})
        if optimizer.grad_scaler is not None and loaded.get(GRAD_SCALER_KEY) is not None:
            optimizer.grad_scaler.load_state_dict(loaded[GRAD_SCALER_KEY])
        return [] if saved_groups is None else [index for index in indices if saved_index_of[index] is None]

    return targets, install
