"""Megatron-Core's small helpers under their upstream names: the model config behind wrappers, process-group
rank and size that tolerate a missing group, the tensor-parallel group to use when none is given, and the
sharded-tensor helpers for checkpoint entries of one tensor-parallel partition or of a replicated tensor.

The sharded tensors are `ShardedLogicalTensor`s (see `dist_checkpointing.logical_tensor`): a rank's piece of
the logical (unsplit) tensor, which the torch_dist format saves and loads at any tensor-parallel size.
"""

import torch
import torch.distributed as dist

__all__ = [
    "divide",
    "ensure_divisibility",
    "get_attr_wrapped_model",
    "get_batch_on_this_cp_rank",
    "get_model_config",
    "get_model_type",
    "get_pg_rank",
    "get_pg_size",
    "get_thd_batch_on_this_cp_rank",
    "get_tensor_model_parallel_group_if_none",
    "make_sharded_tensor_for_checkpoint",
    "make_tp_sharded_tensor_for_checkpoint",
    "init_method_normal",
    "scaled_init_method_normal",
    "StragglerDetector",
    "unwrap_model",
]



def ensure_divisibility(numerator, denominator):
    """Raise ValueError unless `denominator` divides `numerator`."""
    if denominator <= 0 or numerator % denominator != 0:
        raise ValueError(f"{numerator} is not divisible by {denominator}")


def divide(numerator, denominator):
    """`numerator / denominator` as an int; ValueError when the division is not exact."""
    ensure_divisibility(numerator, denominator)
    return numerator // denominator


def init_method_normal(sigma):
    """Initialiser drawing from N(0, sigma^2)."""
    from megatron.core.transformer.init_methods import init_method_normal as normal

    return normal(sigma)


def scaled_init_method_normal(sigma, num_layers, multiplier=2.0):
    """Initialiser drawing from N(0, (sigma / sqrt(multiplier * num_layers))^2), for the projections that write
    into the residual stream."""
    import math

    from megatron.core.transformer.init_methods import NormalInit

    return NormalInit(sigma / math.sqrt(multiplier * num_layers))


def get_model_config(model):
    """The config of `model` (found through DDP / FSDP / Float16Module wrappers via `.module`), or None."""
    from megatron.core.pipeline_parallel.model_access import get_model_config as config_through_wrappers

    return config_through_wrappers(model)


def _default_wrapper_classes():
    """The data-parallel wrappers, and Float16Module once its module is loaded (looked up without importing it:
    no instance can exist before)."""
    import sys

    from megatron.core.distributed.data_parallel_base import DataParallelWrapper

    module = sys.modules.get("megatron.core.transformer.module")
    return (DataParallelWrapper,) + ((module.Float16Module,) if module is not None else ())


def unwrap_model(model, module_instances=None):
    """`model` without its wrappers (`.module` of each instance of `module_instances`; by default the
    data-parallel wrappers (DDP, Megatron-FSDP, FSDP2) and Float16Module). A list of chunks gives a list."""
    if isinstance(model, (list, tuple)):
        return [unwrap_model(chunk, module_instances) for chunk in model]
    from megatron.core.distributed.data_parallel_base import unwrap_model as unwrap_data_parallel

    instances = tuple(module_instances) if module_instances is not None else _default_wrapper_classes()
    while True:
        if module_instances is None:
            model = unwrap_data_parallel(model)
        if not isinstance(model, instances):
            return model
        model = model.module


def get_attr_wrapped_model(model, attr, allow_none=True, return_model_obj=False):
    """`attr` of the first module (through `.module` wrappers) that has it, or that module itself with
    `return_model_obj=True`. With `allow_none=False` a None attribute counts as missing."""
    if isinstance(model, (list, tuple)):
        raise RuntimeError(f"get_attr_wrapped_model was given a list of model chunks; pass one chunk (model[i]) "
                           f"to read {attr!r} from")
    while True:
        has_attr = hasattr(model, attr) and (allow_none or getattr(model, attr) is not None)
        if has_attr:
            return model if return_model_obj else getattr(model, attr)
        if not hasattr(model, "module"):
            raise RuntimeError(f"{type(model).__name__} and the modules it wraps have no attribute {attr!r}")
        model = model.module


def get_model_type(model):
    """`model_type` of the wrapped model (`ModelType.encoder_or_decoder` for GPT)."""
    return get_attr_wrapped_model(model, "model_type")


def get_batch_on_this_cp_rank(batch, cp_group=None):
    """This context-parallel rank's share of a micro-batch dict (each `[b, s]` tensor cut to the rank's two
    sequence chunks, as the causal load balancing expects), updated in place and returned; `cp_group` defaults
    to parallel_state's context-parallel group."""
    from megatron.core.transformer.context_parallel.sequence_split import get_batch_on_this_cp_rank as cut

    return cut(batch, cp_group=cp_group)


def get_thd_batch_on_this_cp_rank(batch, cu_seqlens, cu_seqlens_padded=None, max_seqlen=None, cp_size=None,
                                  cp_rank=None):
    """(batch, packed_seq_params): a packed micro-batch cut to this context-parallel rank's rows of upstream's
    THD split (see `megatron.core.packed_sequences.get_thd_batch_on_this_cp_rank`)."""
    from megatron.core.packed_sequences import get_thd_batch_on_this_cp_rank as cut

    return cut(batch, cu_seqlens, cu_seqlens_padded, max_seqlen, cp_size, cp_rank)


def get_pg_size(group=None) -> int:
    """The size of `group`; 1 when torch.distributed is not initialised or no group is given."""
    if group is None or not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group)


def get_pg_rank(group=None) -> int:
    """This process's rank in `group`; 0 when torch.distributed is not initialised or no group is given."""
    if group is None or not (dist.is_available() and dist.is_initialized()):
        return 0
    return dist.get_rank(group)


def get_tensor_model_parallel_group_if_none(tp_group=None, is_expert=False, check_initialized=True):
    """`tp_group`, or the tensor-parallel group of this rank (expert layers use the same group here: expert
    tensor parallelism equals tensor parallelism). Raises when none is given and the groups are not built and
    `check_initialized` asks for them."""
    if tp_group is not None:
        return tp_group
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        if check_initialized:
            raise RuntimeError(
                "no tensor-parallel group given and the model-parallel groups are not initialised: call "
                "parallel_state.initialize_model_parallel() first or pass tp_group"
            )
        return None
    return parallel_state.get_tensor_model_parallel_group()


def _tensor_parallel_rank_and_size():
    from megatron.core.dist_checkpointing.logical_names import current_tensor_parallel_rank

    return current_tensor_parallel_rank()


def _check_no_prepended_offsets(key, prepend_offsets):
    if prepend_offsets:
        raise NotImplementedError(
            f"{key}: prepended sharded offsets (stacked layers) are not used here: layers are named by their "
            "global index in the logical checkpoint instead"
        )


def make_tp_sharded_tensor_for_checkpoint(tensor: torch.Tensor, key: str, tp_axis: int = 0, replica_id=None,
                                          prepend_offsets=(), **kwargs):
    """This rank's tensor-parallel partition `tensor` (split along `tp_axis` in contiguous partitions) as its
    piece of the logical tensor. `replica_id` is accepted for the upstream signature: replicas offer identical
    pieces, which the torch_dist writer stores once."""
    from megatron.core.dist_checkpointing.logical_tensor import ShardedLogicalTensor

    _check_no_prepended_offsets(key, prepend_offsets)
    rank, size = _tensor_parallel_rank_and_size().of(tensor)[:2]  # an expert's tensor: the expert TP position
    if tensor.dim() == 0:
        raise ValueError(f"{key}: a 0-dimensional tensor has no axis {tp_axis} to shard over tensor parallelism")
    axis = tp_axis % tensor.dim()
    global_shape = list(tensor.shape)
    global_shape[axis] *= size
    offsets = [0] * tensor.dim()
    offsets[axis] = rank * tensor.shape[axis]
    return ShardedLogicalTensor(global_shape, [(offsets, tensor)], dtype=tensor.dtype)


def make_sharded_tensor_for_checkpoint(tensor: torch.Tensor, key: str, prepend_offsets=(), replica_id=None,
                                       **kwargs):
    """A tensor every tensor-parallel rank holds whole (replicated) as the logical tensor."""
    from megatron.core.dist_checkpointing.logical_tensor import ShardedLogicalTensor

    _check_no_prepended_offsets(key, prepend_offsets)
    return ShardedLogicalTensor.from_local(tensor)


class StragglerDetector:
    """Upstream's straggler detector, as a context manager that measures nothing: straggler detection is not done
    here (it reads GPU clocks and utilisation through NVML; `--log-straggler` is refused at validation for the same
    reason). Scripts written against upstream keep working: `stimer = StragglerDetector()`, `with stimer:`,
    `with stimer(bdata=True):`, `stimer.configure(...)` (with `enabled=False`) and `stimer.report(...)` (returns
    False: nothing was reported). `--timing-log-option minmax` / `all` shows the slowest rank's timers instead."""

    def __init__(self):
        self.configured = False

    @property
    def enabled(self):
        return False

    def configure(self, world, rank, mmcnt=1, amp=3.0, port=65535, prefill=1024, enabled=False):
        if enabled:
            raise ValueError("StragglerDetector.configure(enabled=True): straggler detection is not available here "
                             "(as --log-straggler); configure it with enabled=False, or use --timing-log-option "
                             "minmax|all to see the slowest rank's timers")
        self.configured = True

    def report(self, total_flops=0.0, log_interval=0):
        return False

    def __call__(self, bdata=False):
        return self

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        return False
