"""DTensors whose local tensor is a view into a larger flat buffer, made so that they copy and save like any other.

Megatron-FSDP hands out DTensors over views of its flat buffers: state-dict entries (this rank's rows of the
weights), `.grad` of the parameters, resting parameters, `split_dtensor` pieces. torch builds a DTensor's
outer (wrapper) tensor with the local tensor's storage offset but no storage of its own, so for a view that
does not start at its buffer's first element the wrapper reports a non-zero `data_ptr()`. `copy.deepcopy`
and `torch.save` take that as "this tensor has real storage" and try to copy or serialise the wrapper's
(nonexistent) storage: "Attempted to call copy_() on an invalid python storage". A wrapper built with
storage offset 0 around the same local view avoids that path: deepcopy clones it (each buffer once, so views
of one buffer stay views of one copy) and `torch.save` writes the local tensor. Nothing is copied here, and the
local tensor stays the view (in-place changes reach the buffer).
"""

import torch
from torch.distributed.tensor import DTensor


def dtensor_over_view(local: torch.Tensor, mesh, placements, shape, stride) -> DTensor:
    """`DTensor.from_local(local, mesh, placements, run_check=False, shape=shape, stride=stride)`, whose
    outer tensor has storage offset 0 whatever the offset of `local` (see the module docstring)."""
    dtensor = DTensor.from_local(local, mesh, placements, run_check=False, shape=torch.Size(shape), stride=stride)
    if dtensor.storage_offset() == 0:
        return dtensor
    # The wrapper takes dtype, device and storage offset from the tensor it is built on, and shape and stride
    # from the spec: build it on an empty tensor, then give it the real local view.
    wrapper = DTensor(local.new_empty(0), dtensor._spec, requires_grad=dtensor.requires_grad)
    wrapper._local_tensor = dtensor._local_tensor
    return wrapper


def dtensor_parameter(dtensor: DTensor, requires_grad: bool) -> DTensor:
    """`dtensor`, made a parameter in place: what `nn.Parameter(dtensor, requires_grad)` returns, without the
    `detach()` that `nn.Parameter` makes of a tensor subclass. A DTensor's `detach()` goes through DTensor's
    dispatch, whose sharding propagation runs uncached for every shape not seen since the process groups were
    built: 1-2 ms a new shape on a CPU, for nothing, since `dtensor` is a fresh leaf.
    `isinstance(result, nn.Parameter)` holds (the `_is_param` mark is what `nn.Parameter` itself sets on tensor
    subclasses)."""
    if not dtensor.is_leaf:
        raise ValueError("dtensor_parameter needs a leaf DTensor (one built by DTensor.from_local of a tensor "
                         "that does not require grad)")
    dtensor.requires_grad_(requires_grad)
    dtensor._is_param = True
    return dtensor
