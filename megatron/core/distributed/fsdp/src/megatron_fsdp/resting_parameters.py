"""What the module shows for sharded (strategy 3) parameters between steps: Shard(0) DTensors of this rank's rows.

Under `optim_grads_params` a group's gathered weights are released once the step's backward is done, and the
module's parameters (views into the released buffer) would read freed memory. So while a group is at rest
(between steps, or after a forward that no backward will follow) each of its parameters is swapped, in every
module that holds it, for a *resting parameter*: an `nn.Parameter` DTensor on the data-parallel mesh, on the
real device, with the parameter's shape, dtype, requires_grad and attributes, placed `Shard(0)`: its local
tensor is this rank's rows, `layout.chunk_rows(rows, dp_size, dp_rank)` (torch.chunk's split, as torch FSDP2
gives). The row-aligned layout (layout.py) keeps those rows contiguous in the rank's compute shard, so the
local tensor is a view of it, not a copy: it always holds the current weights (the optimizer step writes them
there), costs no memory and no communication. Being a true `Shard(0)` DTensor, every DTensor operation on it
and on tensors derived from it is exact: `full_tensor()`, `redistribute`, `p.detach().clone()`, `p * 2`,
indexing, reductions along a dim, EMA updates, `torch.nn.utils.clip_grad_norm_`, storage inspection.

A 0-dim parameter cannot be sharded: rank 0 holds it, and its resting parameter is placed `Partial()` (sum)
over a view of its slot in the compute shard, which holds the value on rank 0 and the zero padding on the
other ranks, so `full_tensor()` and every DTensor operation still see the real value.

After a backward, `.grad` of a resting parameter is a DTensor of the same kind over this rank's rows of the
reduced gradient (see param_grads.py). The real parameter is put back as soon as its group is gathered.
"""

from typing import Dict, List, Tuple

import torch.nn as nn
from torch.distributed.tensor import DTensor, Partial, Shard

from .dtensor_views import dtensor_over_view, dtensor_parameter


def rows_dtensor(local, like, mesh) -> DTensor:
    """A DTensor of `like`'s shape and stride over `mesh` whose local tensor is `local`, this rank's rows
    (`Shard(0)`), or for a 0-dim `like` its share of the value (`Partial()`)."""
    placement = Shard(0) if like.dim() else Partial()
    return dtensor_over_view(local, mesh, [placement], like.shape, like.stride())


class RestingParameters:
    """Swaps each group's parameters in every owning module between the real ones and their resting DTensors."""

    def __init__(self, groups, owners: Dict[int, List[Tuple[nn.Module, str]]], mesh_of):
        """`mesh_of(group)`: the mesh of the ranks `group` is sharded over (where its resting DTensors live)."""
        self._mesh_of = mesh_of
        self._groups = list(groups)
        self._resting: Dict[int, nn.Parameter] = {}
        for group in self._groups:
            for index, (param, name) in enumerate(zip(group.params, group.names)):
                self._resting[id(param)] = self._make_resting(group, index, param, name)
        self._hidden = set()  # ids of groups whose resting parameters are installed
        # id(group) -> [(owning module's parameter dict, attribute, real parameter, resting parameter)]
        self._slots = {id(group): [(module._parameters, attribute, param, self._resting[id(param)])
                                   for param in group.params for module, attribute in owners.get(id(param), ())]
                       for group in self._groups}

    def _make_resting(self, group, index: int, param: nn.Parameter, name: str) -> nn.Parameter:
        local = group.rows_of_shard(group.compute_shard, index)
        resting = dtensor_parameter(rows_dtensor(local, param, self._mesh_of(group)), param.requires_grad)
        resting.__dict__.update(param.__dict__)  # Megatron attributes (tensor_model_parallel, ...) stay visible
        resting.resting_name = name
        return resting

    def placeholders(self) -> Dict[int, nn.Parameter]:
        """id(real parameter) -> its resting parameter."""
        return dict(self._resting)

    def resting_of(self, param: nn.Parameter) -> nn.Parameter:
        return self._resting[id(param)]

    def hide(self, group):
        if id(group) in self._hidden:
            return
        for parameters, attribute, _, resting in self._slots[id(group)]:
            parameters[attribute] = resting
        self._hidden.add(id(group))

    def show(self, group):
        if id(group) not in self._hidden:
            return
        for parameters, attribute, real, _ in self._slots[id(group)]:
            parameters[attribute] = real
        self._hidden.discard(id(group))
