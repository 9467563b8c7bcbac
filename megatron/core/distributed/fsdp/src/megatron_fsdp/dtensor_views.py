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
