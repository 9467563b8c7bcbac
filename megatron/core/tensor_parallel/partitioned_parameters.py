"""Tensor-parallel parameters: the attributes that record how each is split, the group it is split over, and
filling a rank's partition from a full master weight.

Initialisation is independent of the tensor-parallel size: every rank initialises the full master weight
on the CPU in fp32 with `init_method` under the default generator, keeps its own slice and casts it to
`config.params_dtype`. All ranks draw the same random numbers, so their default generators stay in lockstep
and a partition equals the matching slice of a single-rank layer built with the same seed. The layers run the
same code in `reset_parameters()`, which meta-device construction calls after materialising the parameters.
"""

import torch

from megatron.core import parallel_state
from megatron.core.device_utils import get_current_device
from megatron.core.tensor_parallel.utils import strided_partition

_MODEL_PARALLEL_ATTRIBUTE_DEFAULTS = {"tensor_model_parallel": False, "partition_dim": -1, "partition_stride": 1}


def set_tensor_model_parallel_attributes(tensor, is_parallel, dim, stride):
    """Record how `tensor` is partitioned across tensor-parallel ranks."""
    tensor.tensor_model_parallel = is_parallel
    tensor.partition_dim = dim
    tensor.partition_stride = stride


def set_defaults_if_not_set_tensor_model_parallel_attributes(tensor):
    for attribute, value in _MODEL_PARALLEL_ATTRIBUTE_DEFAULTS.items():
        if not hasattr(tensor, attribute):
            setattr(tensor, attribute, value)


def copy_tensor_model_parallel_attributes(destination, source):
    for attribute in _MODEL_PARALLEL_ATTRIBUTE_DEFAULTS:
        if hasattr(source, attribute):
            setattr(destination, attribute, getattr(source, attribute))


def param_is_not_tensor_parallel_duplicate(param):
    """True for partitioned params, and for duplicated ones on tensor-parallel rank 0 (count each once); an
    expert's parameter (`allreduce = False`) is duplicated over the expert tensor-parallel group instead."""
    if getattr(param, "tensor_model_parallel", False):
        return True
    if getattr(param, "allreduce", True) is False:
        return parallel_state.get_expert_tensor_parallel_rank() == 0
    return parallel_state.get_tensor_model_parallel_rank() == 0


def tensor_parallel_rank_and_size(is_expert=False):
    """(rank, size) in the group a linear's weight is split over: the expert tensor-parallel group for an
    expert's linears (`--expert-tensor-parallel-size`), else the tensor-parallel group."""
    if is_expert:
        return parallel_state.get_expert_tensor_parallel_rank(), parallel_state.get_expert_tensor_parallel_world_size()
    return parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_tensor_model_parallel_world_size()


def check_tensor_parallel_group(layer_name, tp_group, is_expert=False):
    """Upstream's `tp_group` keyword: a linear here is split over parallel_state's tensor-parallel group (the
    expert one with `is_expert`), so a group given must have that group's ranks."""
    if tp_group is None:
        return
    import torch.distributed as dist

    if parallel_state.model_parallel_is_initialized():
        kind = "expert tensor-parallel" if is_expert else "tensor-parallel"
        expected = (parallel_state.get_expert_tensor_parallel_group() if is_expert
                    else parallel_state.get_tensor_model_parallel_group())
        expected_ranks = dist.get_process_group_ranks(expected)
    else:
        kind, expected_ranks = "single-rank tensor-parallel (model parallelism is not initialised)", [dist.get_rank()]
    given_ranks = dist.get_process_group_ranks(tp_group)
    if given_ranks != expected_ranks:
        raise ValueError(
            f"{layer_name}(tp_group=...) spans ranks {given_ranks}, but the layer is split over the {kind} group "
            f"of parallel_state (ranks {expected_ranks}): pass tp_group=None, or initialize_model_parallel() with "
            "the tensor-parallel size you want"
        )


def parameter_device(config):
    """Where a layer's parameters are allocated: the meta device, the CPU (`use_cpu_initialization`) or this
    rank's device."""
    if getattr(config, "init_model_with_meta_device", False) or torch.get_default_device().type == "meta":
        return torch.device("meta")
    if getattr(config, "use_cpu_initialization", False):
        return torch.device("cpu")
    return get_current_device()


def initialize_partition_from_master(param, full_shape, init_method, partition_dim, stride=1, is_expert=False):
    """Fill `param` with this rank's slice of a full fp32 CPU weight initialised by `init_method` (split over
    the expert tensor-parallel group with `is_expert`); returns that full weight (None on the meta device)."""
    if param.is_meta:
        return None
    master = torch.empty(full_shape, dtype=torch.float32, device="cpu")
    init_method(master)
    tp_rank, tp_size = tensor_parallel_rank_and_size(is_expert)
    partition = strided_partition(master, tp_size, tp_rank, partition_dim, stride)
    with torch.no_grad():
        param.copy_(partition.to(dtype=param.dtype))
    return master


def zero_parameter(param):
    """Zero `param` in place (nothing for None or a meta-device parameter)."""
    if param is not None and not param.is_meta:
        with torch.no_grad():
            param.zero_()


def sharded_state_dict_with_axes(module, prefix, sharded_offsets, axes):
    """`module`'s checkpoint entries, each parameter named in `axes` ({name: dim}) as this rank's partition of
    the logical tensor along that dim, the others whole."""
    from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

    state = module.state_dict(prefix="", keep_vars=True)
    return make_sharded_tensors_for_checkpoint(state, prefix, {k: v for k, v in axes.items() if k in state},
                                               sharded_offsets)
