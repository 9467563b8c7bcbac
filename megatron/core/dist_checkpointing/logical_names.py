"""Names in the logical checkpoint: where each local tensor sits in the logical model, and the keys of the
optimizer's state. Pure naming and arithmetic: no tensor data is read or copied here.

The logical model is the unsplit, single-rank GPTModel: a layer is named by its global index
(`decoder.layers.{offset + i}` on a pipeline stage whose first layer is `offset`), and a tensor-parallel
parameter (`tensor_model_parallel`, split along `partition_dim` in contiguous partitions) has the full shape,
its partition being the box at `tp_rank * local_size` along that dim. The layers' fused layouts (QKV per head,
SwiGLU's gate/up rows interleaved per unit; see attention.py and mlp.py) do not depend on the TP size, so a
contiguous partition of the full tensor is exactly what a TP rank holds. The output-layer copy of a tied word
embedding on a later pipeline stage is the logical `embedding.word_embeddings.weight`: loaded there, saved
from the first stage only. A Mixture-of-Experts expert tensor is named by its global expert index
(`...experts.local_experts.{expert_global_index}...`, see `megatron.core.expert_parameters`) and split by the
expert tensor-parallel position (`--expert-tensor-parallel-size`), so a checkpoint loads at any expert-parallel
and expert tensor-parallel size.

Optimizer keys: `optimizer.state.<logical name>.<state key>` (e.g. `exp_avg`, `exp_avg_sq`, and `fp32_param`
for the main weights of a parameter whose model copy is not fp32), `optimizer.step`, `optimizer.param_groups`
and `optimizer.grad_scaler`.
"""

import re
from typing import Dict, List, NamedTuple, Optional, Tuple

import torch

from megatron.core.expert_parameters import global_expert_name

TIED_EMBEDDING_NAME = "embedding.word_embeddings.weight"
# Only the decoder's layers are numbered per stage; other `layers.{i}` (the MTP depths, `mtp.layers.{k}`) are not.
_LAYER_INDEX = re.compile(r"(^|\.)decoder\.layers\.(\d+)\.")


class TensorParallelRank(NamedTuple):
    """This rank's tensor-parallel position; `expert_rank` / `expert_size` the expert tensor-parallel one (which
    splits the experts' tensors), None meaning the same as `rank` / `size`."""

    rank: int
    size: int
    expert_rank: Optional[int] = None
    expert_size: Optional[int] = None

    def of(self, tensor) -> "TensorParallelRank":
        """The position that splits `tensor`: the expert one for an expert's tensor (`allreduce = False`)."""
        if self.expert_size is None or getattr(tensor, "allreduce", True) is not False:
            return self
        return TensorParallelRank(self.expert_rank, self.expert_size)


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


def layer_offset_of(module) -> int:
    """The global index of this pipeline stage's first transformer layer (0 when the model has no decoder)."""
    decoder = getattr(module, "decoder", None)
    return int(getattr(decoder, "layer_offset", 0) or 0)


def logical_name(local_name: str, layer_offset: int) -> str:
    """`decoder.layers.{i}.x` of a stage whose first layer is `layer_offset` -> `decoder.layers.{offset+i}.x`."""
    if layer_offset == 0:
        return local_name
    return _LAYER_INDEX.sub(lambda m: f"{m.group(1)}decoder.layers.{int(m.group(2)) + layer_offset}.", local_name, count=1)


def current_tensor_parallel_rank() -> TensorParallelRank:
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return TensorParallelRank(0, 1)
    return TensorParallelRank(parallel_state.get_tensor_model_parallel_rank(),
                              parallel_state.get_tensor_model_parallel_world_size(),
                              parallel_state.get_expert_tensor_parallel_rank(),
                              parallel_state.get_expert_tensor_parallel_world_size())


def placement_of(name: str, tensor: torch.Tensor, layer_offset: int, tp: TensorParallelRank,
                 param: Optional[torch.nn.Parameter] = None) -> Placement:
    """The placement of local tensor `tensor` named `name` in its module (`param` carries the TP attributes)."""
    source = tensor if param is None else param
    tp = tp.of(source)
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
    name = global_expert_name(name, source)
    return Placement(logical_name(name, layer_offset), tuple(shape), partition_dim, tp.rank, saved_here=True)


def parameter_placements(module, tp: Optional[TensorParallelRank] = None) -> Dict[torch.nn.Parameter, Placement]:
    """Placement of every parameter of an unwrapped model chunk, keyed by the parameter object."""
    tp = tp or current_tensor_parallel_rank()
    offset = layer_offset_of(module)
    return {param: placement_of(name, param, offset, tp)
            for name, param in module.named_parameters(remove_duplicate=True)}


STATE_PREFIX = "optimizer.state."
MAIN_PARAM_KEY = "fp32_param"
STEP_KEY = "optimizer.step"
PARAM_GROUPS_KEY = "optimizer.param_groups"
GRAD_SCALER_KEY = "optimizer.grad_scaler"


def state_key(logical_name: str, key: str) -> str:
    return f"{STATE_PREFIX}{logical_name}.{key}"


def optimizer_state_keys_of(name: str, saved_keys) -> List[str]:
    """The per-parameter state keys (`exp_avg`, ...) the checkpoint has for logical tensor `name`."""
    prefix = f"{STATE_PREFIX}{name}."
    return [key[len(prefix):] for key in saved_keys if key.startswith(prefix) and "." not in key[len(prefix):]]
