"""What the module shows for sharded (strategy 3) parameters between steps: DTensors holding this rank's piece.

Under `optim_grads_params` a group's gathered weights are released once the step's backward is done, and the
module's parameters (views into the released buffer) would read freed memory. So while a group is at rest
(between steps, or after a forward that no backward will follow) each of its parameters is swapped, in every
module that holds it, for a *resting parameter*: an `nn.Parameter` DTensor on the data-parallel mesh, on the
real device, with the parameter's shape, dtype, requires_grad and attributes, whose local tensor is a view of
this rank's piece of the parameter in the group's compute shard. It is not a copy: it always holds the current
weights (the optimizer step writes them there), costs no memory and no communication.

After each backward its `.grad` is a DTensor of the same kind viewing this rank's piece of the reduced
gradient, the very storage the optimizer steps with, so in-place changes (`clip_grad_norm_`) reach the step.
`optimizer.zero_grad()` sets it back to None. Under HSDP it is attached by `finish_grad_sync()` (which
`optimizer.step()` runs; call it yourself before clipping), once the outer ranks' gradients are summed in. (Not
attached when the gradients are kept in another dtype than the weights, e.g. fp32 gradients of a bf16 model,
since torch requires `.grad` to match the parameter's dtype, nor under HFSDP, whose reduced gradients are split
once more over the outer ranks.)

The local piece is a *flat* range of the parameter's elements (the flat layout of `layout.py`), not the block of
rows `Shard(0)` would give this rank. Everything that works elementwise or reduces the whole tensor is exact:
norms, sums, EMA updates (`ema.lerp_(p, w)` with `ema = p.detach().clone()`), `torch.nn.utils.clip_grad_norm_`,
`to_local()` and storage inspection. The resting parameters' (and their gradients') own `full_tensor()` is
overridden to assemble the real tensor, and their `redistribute` and checkpoint hooks raise. Beware of tensors
*derived* from them (`p.detach().clone()`, `p * 2`): those are plain DTensors with the same flat local pieces,
whose stock `full_tensor()`, `redistribute` and dim-wise operations (indexing, reductions along a dim) read the
pieces as rows and give wrong values. Use `model.gathered_parameters()` for such reads, or
`model.state_dict()`, whose DTensors are true `Shard(0)` rows. (A layout whose pieces are whole rows would lift
this; `layout.py` cuts groups into equal flat ranges instead, which is what makes gathers a single collective.)
The real parameter is put back as soon as its group is gathered.
"""

import types
from typing import Dict, List, Tuple

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Shard

from . import collectives


def _assemble_full_tensor(flat_dtensor) -> torch.Tensor:
    """`full_tensor()` of a flat-piece DTensor: every rank's piece put at its offset (call on every rank)."""
    local = flat_dtensor.to_local()
    full = torch.empty(flat_dtensor.numel(), dtype=local.dtype, device=local.device)
    pieces = collectives.all_gather_objects((flat_dtensor.flat_offset, local.detach().cpu()),
                                            flat_dtensor.device_mesh.get_group())
    for start, values in pieces:
        full[start:start + values.numel()].copy_(values)
    return full.view(flat_dtensor.shape)


def _refuse(name: str, what: str):
    def refuse(*args, **kwargs):
        raise RuntimeError(f"parameter '{name}' is sharded between steps as a flat piece per rank, which {what} "
                           "cannot describe; read it inside `with model.gathered_parameters():` or save "
                           "model.state_dict() (true Shard(0) rows) instead")

    return refuse


def flat_piece_dtensor(local: torch.Tensor, like: torch.Tensor, mesh) -> DTensor:
    """A DTensor of `like`'s shape whose local tensor is this rank's flat piece `local` (see `describe_flat`)."""
    return DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=like.shape, stride=like.stride())


def describe_flat(dtensor: DTensor, flat_offset: int, name: str) -> DTensor:
    """Mark `dtensor` as holding elements `[flat_offset, flat_offset + local numel)` of the flattened tensor:
    `full_tensor()` then assembles the real tensor; `redistribute` and torch.distributed.checkpoint, which would
    read the piece as rows, raise."""
    dtensor.flat_offset = flat_offset
    dtensor.full_tensor = types.MethodType(_assemble_full_tensor, dtensor)
    dtensor.redistribute = _refuse(name, "redistribute()")
    dtensor.__create_write_items__ = _refuse(name, "torch.distributed.checkpoint")
    dtensor.__create_chunk_list__ = _refuse(name, "torch.distributed.checkpoint")
    return dtensor


class RestingParameters:
    """Swaps each group's parameters in every owning module between the real ones and their resting DTensors."""

    def __init__(self, groups, owners: Dict[int, List[Tuple[nn.Module, str]]], dp_group, device: torch.device,
                 outer_replicas: bool = False):
        """`outer_replicas` (HSDP): the gradients are complete only after `finish_grad_sync` all-reduced them over
        the outer ranks, so they are attached then rather than at the end of backward."""
        from torch.distributed.device_mesh import DeviceMesh

        self._owners = owners
        self._outer_replicas = outer_replicas
        self._mesh = DeviceMesh.from_group(dp_group, device.type)
        self._groups = list(groups)
        self._resting: Dict[int, nn.Parameter] = {}
        for group in self._groups:
            for index, (param, name) in enumerate(zip(group.params, group.names)):
                self._resting[id(param)] = self._make_resting(group, index, param, name)
        self._hidden = set()  # ids of groups whose resting parameters are installed

    def _make_resting(self, group, index: int, param: nn.Parameter, name: str) -> nn.Parameter:
        piece = group.pieces[index]
        local = group.compute_shard[piece.shard_start:piece.shard_end]
        resting = nn.Parameter(flat_piece_dtensor(local, param, self._mesh), requires_grad=param.requires_grad)
        resting.__dict__.update(param.__dict__)  # Megatron attributes (tensor_model_parallel, ...) stay visible
        resting.resting_name = name
        return describe_flat(resting, piece.param_start, name)

    def placeholders(self) -> Dict[int, nn.Parameter]:
        """id(real parameter) -> its resting parameter."""
        return dict(self._resting)

    def hide(self, group):
        if id(group) in self._hidden:
            return
        self._install(group, lambda param: self._resting[id(param)])
        self._hidden.add(id(group))

    def show(self, group):
        if id(group) not in self._hidden:
            return
        self._install(group, lambda param: param)
        self._hidden.discard(id(group))

    def _install(self, group, choose):
        for param in group.params:
            replacement = choose(param)
            for module, attribute in self._owners.get(id(param), ()):
                module._parameters[attribute] = replacement

    # ---- gradients --------------------------------------------------------------------------------------------
    @staticmethod
    def _grads_viewable(group) -> bool:
        return (group.trainable and group.main_grads is not None and not group.outer_sharded
                and not group.main_grads_released and group.main_grads.dtype == group.param_dtype)

    def attach_grads(self, grad_sync_finished: bool):
        """Point each resting parameter's `.grad` at its piece of the reduced gradient (reductions must be done:
        at the end of backward, or under HSDP once `finish_grad_sync` reduced over the outer ranks too)."""
        if self._outer_replicas and not grad_sync_finished:
            return
        for group in self._groups:
            if not self._grads_viewable(group):
                continue
            for index, param in enumerate(group.params):
                piece = group.pieces[index]
                local = group.main_grads[piece.shard_start:piece.shard_end]
                grad = flat_piece_dtensor(local, param, self._mesh)
                self._resting[id(param)].grad = describe_flat(grad, piece.param_start, f"{group.names[index]}.grad")

    def drop_grads(self):
        for resting in self._resting.values():
            resting.grad = None
