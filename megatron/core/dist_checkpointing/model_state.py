"""Where each local tensor sits in the logical model: its full name and shape, and which box of it this rank holds.

The logical model is the unsplit, single-rank GPTModel: a layer is named by its global index
(`decoder.layers.{offset + i}` on a pipeline stage whose first layer is `offset`), and a tensor-parallel
parameter (`tensor_model_parallel`, split along `partition_dim` in contiguous partitions) has the full shape,
its partition being the box at `tp_rank * local_size` along that dim. The layers' fused layouts (QKV per head,
SwiGLU's gate/up rows interleaved per unit; see attention.py and mlp.py) do not depend on the TP size, so a
contiguous partition of the full tensor is exactly what a TP rank holds. The output-layer copy of a tied word
embedding on a later pipeline stage is the logical `embedding.word_embeddings.weight`: loaded there, saved
from the first stage only.
"""

import re
from typing import Dict, NamedTuple, Optional, Tuple

import torch

from megatron.core.dist_checkpointing.logical_tensor import ShardedLogicalTensor, dtensor_pieces

TIED_EMBEDDING_NAME = "embedding.word_embeddings.weight"
_LAYER_INDEX = re.compile(r"(^|\.)layers\.(\d+)\.")
WRAPPER_CLASS_NAMES = {"DistributedDataParallel", "Float16Module", "FullyShardedDataParallel",
                       "TorchFullyShardedDataParallel", "MegatronFSDP"}


class TensorParallelRank(NamedTuple):
    rank: int
    size: int


class Placement(NamedTuple):
    """Where a local tensor of `local_shape` sits in the logical tensor `logical_name` of `global_shape`."""

    logical_name: str
    global_shape: Tuple[int, ...]
    partition_dim: Optional[int]
    partition_index: int
    saved_here: bool  # False for a tied copy whose logical tensor another stage saves

    def offsets(self, local_shape) -> Tuple[int, ...]:
        """Offsets of this rank's partition (of `local_shape`) in the logical tensor."""
        offsets = [0] * len(local_shape)
        if self.partition_dim is not None:
            offsets[self.partition_dim] = self.partition_index * local_shape[self.partition_dim]
        return tuple(offsets)


def unwrap_model(module):
    """Strip DDP / FSDP / mixed-precision wrappers, returning the module that defines parameter names."""
    while type(module).__name__ in WRAPPER_CLASS_NAMES and hasattr(module, "module"):
        module = module.module
    return module


def layer_offset_of(module) -> int:
    """The global index of this pipeline stage's first transformer layer (0 when the model has no decoder)."""
    decoder = getattr(module, "decoder", None)
    return int(getattr(decoder, "layer_offset", 0) or 0)


def logical_name(local_name: str, layer_offset: int) -> str:
    """`decoder.layers.{i}.x` of a stage whose first layer is `layer_offset` -> `decoder.layers.{offset+i}.x`."""
    if layer_offset == 0:
        return local_name
    return _LAYER_INDEX.sub(lambda m: f"{m.group(1)}layers.{int(m.group(2)) + layer_offset}.", local_name, count=1)


def current_tensor_parallel_rank() -> TensorParallelRank:
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return TensorParallelRank(0, 1)
    return TensorParallelRank(parallel_state.get_tensor_model_parallel_rank(),
                              parallel_state.get_tensor_model_parallel_world_size())


def placement_of(name: str, tensor: torch.Tensor, layer_offset: int, tp: TensorParallelRank,
                 param: Optional[torch.nn.Parameter] = None) -> Placement:
    """The placement of local tensor `tensor` named `name` in its module (`param` carries the TP attributes)."""
    source = tensor if param is None else param
    shape = list(tensor.shape)
    partition_dim = None
    if tp.size > 1 and getattr(source, "tensor_model_parallel", False):
        partition_dim = source.partition_dim % tensor.dim()
        if getattr(source, "partition_stride", 1) != 1:
            raise NotImplementedError(
                f"'{name}' has partition_stride {source.partition_stride}: strided tensor-parallel partitions are "
                "not one box of the logical tensor; build the layer with stride 1 to checkpoint it")
        shape[partition_dim] *= tp.size
    if getattr(source, "shared", False) and getattr(source, "shared_embedding", False):
        return Placement(TIED_EMBEDDING_NAME, tuple(shape), partition_dim, tp.rank, saved_here=False)
    return Placement(logical_name(name, layer_offset), tuple(shape), partition_dim, tp.rank, saved_here=True)


def parameter_placements(module, tp: Optional[TensorParallelRank] = None) -> Dict[torch.nn.Parameter, Placement]:
    """Placement of every parameter of an unwrapped model chunk, keyed by the parameter object."""
    tp = tp or current_tensor_parallel_rank()
    offset = layer_offset_of(module)
    return {param: placement_of(name, param, offset, tp)
            for name, param in module.named_parameters(remove_duplicate=True)}


def local_piece(placement: Placement, tensor: torch.Tensor) -> ShardedLogicalTensor:
    """This rank's TP partition `tensor` (plain, or a DTensor sharded over data-parallel ranks, as FSDP2 holds
    it) as its box(es) of the logical tensor."""
    piece = dtensor_pieces(tensor, placement.offsets(tuple(tensor.shape)))
    return ShardedLogicalTensor(placement.global_shape, [piece], dtype=tensor.dtype)


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
