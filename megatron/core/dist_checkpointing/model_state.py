"""The logical state of model chunks wrapped by Megatron DDP or FSDP2 (or not wrapped): each parameter and
tensor buffer under its logical name (see `logical_names`), as this rank's box(es) of it (`logical_tensor`).

Megatron-FSDP chunks are handled by `fsdp_state`; `wrappers` picks one per chunk.
"""

from typing import Optional

import torch

from megatron.core.dist_checkpointing.logical_names import (  # noqa: F401  (re-exported names)
    TIED_EMBEDDING_NAME,
    Placement,
    TensorParallelRank,
    current_tensor_parallel_rank,
    layer_offset_of,
    logical_name,
    parameter_placements,
    placement_of,
)
from megatron.core.dist_checkpointing.logical_tensor import ShardedLogicalTensor
from megatron.core.distributed.data_parallel_base import unwrap_model  # noqa: F401  (re-exported)


def local_piece(placement: Placement, tensor: torch.Tensor) -> ShardedLogicalTensor:
    """This rank's TP partition `tensor` (plain, or a DTensor sharded over data-parallel ranks, as FSDP2 holds
    it) as its box(es) of the logical tensor."""
    return ShardedLogicalTensor.from_local(tensor, placement.global_shape, placement.offsets(tuple(tensor.shape)))


def model_sharded_state_dict(model_chunks, for_saving: bool, tp: Optional[TensorParallelRank] = None):
    """{logical name: ShardedLogicalTensor} of the model chunks' state (parameters and tensor buffers).

    The pieces are the live tensors (views of the parameters), so loading into this dict loads the model.
    For saving, tied copies that another stage saves are left out.
    """
    tp = tp or current_tensor_parallel_rank()
    state = {}
    for chunk in model_chunks:
        module = unwrap_model(chunk)
        offset = layer_offset_of(module)
        params = dict(module.named_parameters(remove_duplicate=False))
        for name, value in module.state_dict(keep_vars=True).items():
            if not torch.is_tensor(value):
                continue
            placement = placement_of(name, value, offset, tp, params.get(name))
            if for_saving and not placement.saved_here:
                continue
            state[placement.logical_name] = local_piece(placement, value.detach())
    return state
