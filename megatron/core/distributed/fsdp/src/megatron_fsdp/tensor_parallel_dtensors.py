"""Modules parallelised with torch's own tensor parallelism (`parallelize_module`: `ColwiseParallel`,
`RowwiseParallel`, `SequenceParallel`), whose parameters are DTensors on the tp dim of the mesh.

Megatron-FSDP keeps every parameter as a view into a flat buffer, which a DTensor parameter cannot be (its
shape is the full one, its storage the local tensor's). So before the groups are built each such parameter is
replaced by a plain parameter holding its local tensor, marked the way Megatron-Core marks its own TP
partitions (`tensor_model_parallel`, `partition_dim`, `partition_stride`): a `Shard(d)` parameter is a
partition along `d`, a `Replicate()` one (a `SequenceParallel` norm weight, a `RowwiseParallel` bias) is
TP-replicated. Sharding, reductions, state dicts (TP-full DTensors), `clip_grad_norm_` then treat them as they
treat Megatron-Core TP layers.

While the owning module runs its forward, the module sees a DTensor again: a forward pre-hook puts
`DTensor.from_local(local, tp_mesh, placements)` in its place (differentiable, so gradients reach the local
parameter: a `Partial()` gradient of a replicated parameter is all-reduced over tp on the way, as torch does
for FSDP2), and a forward hook puts the local parameter back. The hooks run inside whatever gathered the
parameter (the unit's or the wrapper's hooks), so they see the gathered weights.
"""

from dataclasses import dataclass
from typing import Dict, List, Tuple

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from . import collectives
from .utils import run_eagerly


@dataclass(frozen=True)
class TensorParallelSpec:
    """What the module's forward needs to rebuild the DTensor from the local parameter."""

    mesh: object
    placements: Tuple
    shape: torch.Size
    stride: Tuple[int, ...]


def localize_tensor_parallel_dtensors(module: nn.Module, topology, init_on_meta: bool) -> Dict[nn.Module, dict]:
    """Replace every DTensor parameter of `module` by a plain parameter of its local tensor (see the module
    docstring); returns {owning module: {attribute: TensorParallelSpec}} for `install_dtensor_forward_hooks`.
    Raises ValueError, naming the parameter, for DTensors this cannot express."""
    specs: Dict[nn.Module, dict] = {}
    replaced: Dict[int, nn.Parameter] = {}
    for module_name, owner in module.named_modules(remove_duplicate=False):
        for attribute, param in list(owner._parameters.items()):
            if not isinstance(param, DTensor):
                continue
            name = f"{module_name}.{attribute}" if module_name else attribute
            if id(param) not in replaced:
                _check_supported(name, param, topology, init_on_meta)
                replaced[id(param)] = _local_parameter(param)
            owner._parameters[attribute] = replaced[id(param)]
            specs.setdefault(owner, {})[attribute] = TensorParallelSpec(
                param.device_mesh, tuple(param.placements), param.shape, param.stride())
    return specs


def install_dtensor_forward_hooks(specs: Dict[nn.Module, dict]) -> List:
    """Forward hooks that show each owning module its DTensor parameters during its forward; returns the handles.
    Register them after the hooks that gather the parameters, so that they wrap the gathered weights."""
    handles = []
    for owner, by_attribute in specs.items():
        installed: Dict[str, Tuple[nn.Parameter, DTensor]] = {}

        def show_dtensors(module, args, by_attribute=by_attribute, installed=installed):
            for attribute, spec in by_attribute.items():
                local = module._parameters[attribute]
                dtensor = DTensor.from_local(local, spec.mesh, spec.placements, run_check=False, shape=spec.shape,
                                             stride=spec.stride)
                module._parameters[attribute] = dtensor
                installed[attribute] = (local, dtensor)

        def restore_locals(module, args, output, installed=installed):
            for attribute, (local, dtensor) in installed.items():
                # a hook that ran inside this forward may have swapped the slot already (a resting parameter)
                if module._parameters[attribute] is dtensor:
                    module._parameters[attribute] = local
            installed.clear()
            return output

        handles.append(owner.register_forward_pre_hook(run_eagerly(show_dtensors)))
        handles.append(owner.register_forward_hook(run_eagerly(restore_locals), prepend=True, always_call=True))
    return handles


def _check_supported(name: str, param: DTensor, topology, init_on_meta: bool):
    mesh = param.device_mesh
    where = f"parameter '{name}' is a DTensor placed {tuple(param.placements)} on mesh dims {mesh.mesh_dim_names}"
    if topology.tp_size == 1:
        raise ValueError(
            f"{where} (torch tensor parallelism, parallelize_module). Megatron-FSDP shards such a model over the "
            "data-parallel dim of the mesh the tensor-parallel one was cut from: pass that mesh and both dims, "
            "e.g. fully_shard(model, optimizer, device_mesh=mesh, dp_shard_dim='dp', tp_dim='tp')")
    if mesh.ndim != 1 or sorted(mesh.mesh.flatten().tolist()) != sorted(collectives.group_ranks(topology.tp_group)):
        raise ValueError(
            f"{where}, which is not the tp dim {topology.tp_dim!r} of device_mesh: Megatron-FSDP shards over the "
            "data-parallel dims itself; parallelize the module over device_mesh[tp_dim] only and pass the model "
            "unsharded")
    placement = param.placements[0]
    if type(placement) is Shard:  # not a subclass such as a strided shard
        if param.shape[placement.dim] % topology.tp_size:
            raise ValueError(f"{where}: its dim {placement.dim} ({param.shape[placement.dim]}) does not split "
                             f"evenly over the {topology.tp_size} tensor-parallel ranks; Megatron-FSDP needs equal "
                             "partitions (pick sizes divisible by the tp size)")
    elif not isinstance(placement, Replicate):
        raise ValueError(f"{where}: only Shard(dim) and Replicate() tensor-parallel parameters are supported")
    if init_on_meta:
        raise ValueError(f"{where}: init_model_with_meta_device=True would initialise its local partition "
                         "without the tensor-parallel random state; build the model on the CPU, or use "
                         "Megatron-Core tensor-parallel layers")


def _local_parameter(param: DTensor) -> nn.Parameter:
    local = nn.Parameter(param.to_local().detach(), requires_grad=param.requires_grad)
    placement = param.placements[0]
    if isinstance(placement, Shard):
        local.tensor_model_parallel = True
        local.partition_dim = placement.dim % param.dim()
        local.partition_stride = 1
    return local
