"""Process groups for tensor, pipeline, context, expert and data parallelism, and the device mesh.

Three files, read top-down:
- `rank_layout.py`: pure arithmetic (no processes). `generate_rank_groups` lays the world's ranks out on a grid
  whose axes follow `order` and returns, for every kind of group, the list of rank lists; `device_mesh_layout`
  gives a stage's mesh as nested lists.
- `process_groups.py`: `initialize_model_parallel` / `destroy_model_parallel` create and destroy one process
  group per rank list (and the device mesh on them) and hold the groups this rank belongs to. It takes
  Megatron-Core's parameters in Megatron-Core's positional order; an option this implementation cannot honour
  (SHARP, ...) raises a ValueError that names it rather than being ignored.
- this module: Megatron-Core's named getters over those groups (`get_tensor_model_parallel_group`, ...). Every
  name of the other two that callers use is importable from here too, so `parallel_state.X` keeps working.

Expert parallelism uses its own grid over the same ranks: within a pipeline stage the tp*cp*dp ranks are
re-read as etp x ep x expert-dp (`expert_tensor_parallel_size`, default tp; context parallelism folded into
expert data parallelism).
"""

import torch
import torch.distributed as dist

from megatron.core.process_groups import (  # noqa: F401  (re-exported: parallel_state's public face)
    belongs_to as _belongs_to,
    destroy_model_parallel as _destroy_process_groups,
    get_device_mesh,
    get_num_distributed_optimizer_instances,
    get_virtual_pipeline_rank as _get_virtual_pipeline_rank,
    get_virtual_pipeline_world_size as _get_virtual_pipeline_world_size,
    gloo_group_named as _gloo_group_named,
    group_named as _group,
    initialize_model_parallel,
    model_parallel_is_initialized,
    rank_in as _rank_in,
    ranks_of as _ranks,
    reject_unsupported_options,
    set_virtual_pipeline_rank as _set_virtual_pipeline_rank,
    set_virtual_pipeline_world_size as _set_virtual_pipeline_world_size,
)
from megatron.core.rank_layout import (  # noqa: F401  (re-exported)
    DEFAULT_ORDER,
    DEVICE_MESH_DIM_NAMES,
    TP_PP_DP_ORDER,
    RankGenerator,
    RankGrid,
    device_mesh_layout,
    generate_rank_groups,
    parse_order,
    validate_parallel_sizes,
)

# Upstream's setters (`set_tensor_model_parallel_world_size`, ...) override what the getters below return until
# `destroy_model_parallel()`: conversion tools use them to build one shard of a model in a single process.
_OVERRIDES = {}


def _override_or(key, value_of_groups):
    """The value set by upstream's setter for `key`, else `value_of_groups()`."""
    value = _OVERRIDES.get(key)
    return value_of_groups() if value is None else value


def _set_override(key, value, what):
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
        raise ValueError(f"set_{what}({value!r}): expected a non-negative int, or None to clear it")
    _OVERRIDES[key] = value


def _group_if(name, check_initialized):
    """This rank's group of kind `name`; with `check_initialized=False`, None instead of an error when the groups
    are not initialised or this rank belongs to none of that kind (upstream's getters' escape hatch)."""
    if not check_initialized and not _belongs_to(name):
        return None
    return _group(name)


def destroy_model_parallel():
    """Destroy the model-parallel groups, clear the values of upstream's setters and the global memory buffer."""
    global _GLOBAL_MEMORY_BUFFER
    _destroy_process_groups()
    _OVERRIDES.clear()
    _GLOBAL_MEMORY_BUFFER = None


# Tensor model parallel
def get_tensor_model_parallel_group(check_initialized=True):
    return _group_if("tp", check_initialized)


def get_tensor_model_parallel_rank():
    return _override_or("tp-rank", lambda: _rank_in("tp") if model_parallel_is_initialized() else 0)


def get_tensor_model_parallel_world_size():
    return _override_or("tp-size", lambda: len(_ranks("tp")) if model_parallel_is_initialized() else 1)


def set_tensor_model_parallel_world_size(world_size):
    _set_override("tp-size", world_size, "tensor_model_parallel_world_size")


def set_tensor_model_parallel_rank(rank):
    _set_override("tp-rank", rank, "tensor_model_parallel_rank")


def get_tensor_model_parallel_src_rank():
    """Global rank of tensor-parallel rank 0 in this rank's group."""
    return _ranks("tp")[0]


def get_tensor_model_parallel_global_ranks():
    return list(_ranks("tp"))


# Pipeline model parallel
def get_pipeline_model_parallel_group(check_initialized=True):
    return _group_if("pp", check_initialized)


def get_pipeline_model_parallel_rank():
    return _override_or("pp-rank", lambda: _rank_in("pp") if model_parallel_is_initialized() else 0)


def get_pipeline_model_parallel_world_size():
    return _override_or("pp-size", lambda: len(_ranks("pp")) if model_parallel_is_initialized() else 1)


def set_pipeline_model_parallel_world_size(world_size):
    _set_override("pp-size", world_size, "pipeline_model_parallel_world_size")


def set_pipeline_model_parallel_rank(rank):
    _set_override("pp-rank", rank, "pipeline_model_parallel_rank")


def _virtual_rank_in_effect(ignore_virtual):
    """The model chunk to judge a stage by: None when virtual stages are ignored, absent, or no chunk is current."""
    if ignore_virtual or get_virtual_pipeline_model_parallel_world_size() is None:
        return None
    return get_virtual_pipeline_model_parallel_rank()


def is_pipeline_first_stage(ignore_virtual=False, vp_stage=None):
    """True on the first pipeline stage.

    With an interleaved pipeline (virtual stages) the first stage is model chunk 0 of pipeline rank 0: the chunk
    is `vp_stage`, else the current virtual rank (set while a chunk is built or run). With `ignore_virtual`, or
    when no chunk is current (the virtual rank is None), only the pipeline rank counts.
    """
    if get_pipeline_model_parallel_rank() != 0:
        return False
    chunk = vp_stage if vp_stage is not None and not ignore_virtual else _virtual_rank_in_effect(ignore_virtual)
    return chunk is None or chunk == 0


def is_pipeline_last_stage(ignore_virtual=False, vp_stage=None):
    """True on the last pipeline stage: the last model chunk of the last pipeline rank (see
    `is_pipeline_first_stage` for `ignore_virtual` and `vp_stage`)."""
    if get_pipeline_model_parallel_rank() != get_pipeline_model_parallel_world_size() - 1:
        return False
    chunk = vp_stage if vp_stage is not None and not ignore_virtual else _virtual_rank_in_effect(ignore_virtual)
    return chunk is None or chunk == get_virtual_pipeline_model_parallel_world_size() - 1


def get_virtual_pipeline_model_parallel_world_size():
    """Model chunks per pipeline rank of an interleaved pipeline; None without interleaving."""
    return _get_virtual_pipeline_world_size()


def set_virtual_pipeline_model_parallel_world_size(world_size):
    _set_virtual_pipeline_world_size(world_size)


def get_virtual_pipeline_model_parallel_rank():
    """The model chunk being built or run on this rank; None outside model construction and the schedule."""
    return _get_virtual_pipeline_rank()


def set_virtual_pipeline_model_parallel_rank(rank):
    _set_virtual_pipeline_rank(rank)


def get_pipeline_model_parallel_first_rank():
    return _ranks("pp")[0]


def get_pipeline_model_parallel_last_rank():
    return _ranks("pp")[-1]


def get_pipeline_model_parallel_next_rank():
    """Global rank of the next stage (wrapping around from the last stage to the first)."""
    ranks = _ranks("pp")
    return ranks[(_rank_in("pp") + 1) % len(ranks)]


def get_pipeline_model_parallel_prev_rank():
    ranks = _ranks("pp")
    return ranks[(_rank_in("pp") - 1) % len(ranks)]


# Data parallel
def _data_parallel_name(with_context_parallel, partial_data_parallel):
    if partial_data_parallel:
        if not with_context_parallel:
            raise ValueError("partial_data_parallel=True needs with_context_parallel=True (the inner dp-cp group)")
        return "inner-dp-cp"
    return "dp-cp" if with_context_parallel else "dp"


def get_data_parallel_group(with_context_parallel=False, partial_data_parallel=False):
    """Ranks with equal tp/pp (and cp unless `with_context_parallel`) coordinates.

    `partial_data_parallel` selects the inner group of hybrid sharding (one distributed-optimizer instance).
    """
    return _group(_data_parallel_name(with_context_parallel, partial_data_parallel))


def get_data_parallel_rank(with_context_parallel=False, partial_data_parallel=False):
    if not model_parallel_is_initialized():
        return 0
    return _rank_in(_data_parallel_name(with_context_parallel, partial_data_parallel))


def get_data_parallel_world_size(with_context_parallel=False, partial_data_parallel=False):
    if not model_parallel_is_initialized():
        return 1
    return len(_ranks(_data_parallel_name(with_context_parallel, partial_data_parallel)))


def get_data_parallel_global_ranks(with_context_parallel=False):
    return list(_ranks("dp-cp" if with_context_parallel else "dp"))


def get_data_parallel_src_rank(with_context_parallel=False):
    return _ranks("dp-cp" if with_context_parallel else "dp")[0]


def get_data_parallel_group_gloo(with_context_parallel=False, partial_data_parallel=False):
    """The gloo twin of `get_data_parallel_group(...)` (needs `create_gloo_process_groups=True`)."""
    return _gloo_group_named(_data_parallel_name(with_context_parallel, partial_data_parallel))


def get_inner_data_parallel_group():
    """Hybrid sharding: the DP*CP/N consecutive data-parallel (with context) ranks of this instance."""
    return _group("inner-dp-cp")


def get_outer_data_parallel_group():
    """Hybrid sharding: the N ranks at this rank's position across the distributed-optimizer instances."""
    return _group("outer-dp-cp")


def get_intra_distributed_optimizer_instance_group(check_initialized=True):
    """Every rank of this rank's distributed-optimizer instance (`num_distributed_optimizer_instances`): the whole
    world with one instance."""
    if not model_parallel_is_initialized():
        if check_initialized:
            raise RuntimeError("distributed-optimizer instance groups are not initialised; call "
                               "initialize_model_parallel() first")
        return None
    if get_num_distributed_optimizer_instances() == 1:
        return dist.group.WORLD
    _expert_data_parallel_name(partial_expert_data_parallel=True)  # explains an instance count that cannot split
    return _group("dist-opt-instance")


def get_inter_distributed_optimizer_instance_group(check_initialized=True):
    """The ranks at this rank's position across the distributed-optimizer instances (one rank per instance: the
    outer data-parallel group of hybrid sharding)."""
    if not model_parallel_is_initialized() and not check_initialized:
        return None
    return get_outer_data_parallel_group()


# Context parallel
def get_context_parallel_group(check_initialized=True):
    return _group_if("cp", check_initialized)


def get_context_parallel_rank():
    return _rank_in("cp") if model_parallel_is_initialized() else 0


def get_context_parallel_world_size():
    return len(_ranks("cp")) if model_parallel_is_initialized() else 1


def get_context_parallel_global_ranks():
    return list(_ranks("cp"))


def get_hierarchical_context_parallel_groups(check_initialized=True):
    """The context-parallel sub-groups of `--hierarchical-context-parallel-sizes`, inner to outer (for a2a+p2p:
    [all-to-all group, p2p ring group]); None when the sizes were not given and `check_initialized` is False."""
    groups = []
    while _belongs_to(f"hierarchical-cp-{len(groups)}"):
        groups.append(_group(f"hierarchical-cp-{len(groups)}"))
    if not groups:
        if check_initialized:
            raise RuntimeError("hierarchical context-parallel groups are not initialised; pass "
                               "hierarchical_context_parallel_sizes to initialize_model_parallel()")
        return None
    return groups


def get_tensor_and_context_parallel_group(check_initialized=True):
    return _group_if("tp-cp", check_initialized)


def get_tensor_and_data_parallel_group(check_initialized=True, with_context_parallel=False):
    """The tensor-parallel x data-parallel ranks of this rank's pipeline stage that share its context-parallel
    position; `with_context_parallel`: every rank of the stage (TP x DP x CP). Upstream's positional order."""
    return _group_if("tp-dp-cp" if with_context_parallel else "tp-dp", check_initialized)


def get_amax_reduction_group(with_context_parallel=False, tp_only_amax_red=False):
    """The ranks that reduce FP8 amaxes together so they quantize a shared tensor with one scale.

    Every rank of a pipeline stage holds shards (TP) or replicas (DP, CP) of the same layers, so under delayed
    scaling the amaxes are reduced over the stage's TP x DP (x CP with `with_context_parallel`, as FP8
    training uses it) ranks; `tp_only_amax_red` narrows it to the tensor-parallel group (shards agree, replicas
    may not). Megatron-Core's getter; Transformer Engine's autocast takes it as `fp8_group`.
    """
    if tp_only_amax_red:
        return get_tensor_model_parallel_group()
    return get_tensor_and_data_parallel_group(with_context_parallel=with_context_parallel)


# Expert parallel
def get_expert_model_parallel_group(check_initialized=True):
    return _group_if("ep", check_initialized)


def get_expert_model_parallel_rank():
    return _override_or("ep-rank", lambda: _rank_in("ep") if model_parallel_is_initialized() else 0)


def get_expert_model_parallel_world_size():
    return _override_or("ep-size", lambda: len(_ranks("ep")) if model_parallel_is_initialized() else 1)


def set_expert_model_parallel_world_size(world_size):
    _set_override("ep-size", world_size, "expert_model_parallel_world_size")


def set_expert_model_parallel_rank(rank):
    _set_override("ep-rank", rank, "expert_model_parallel_rank")


def _expert_data_parallel_name(partial_expert_data_parallel):
    if not partial_expert_data_parallel:
        return "expt-dp"
    if model_parallel_is_initialized() and not _belongs_to("inner-expt-dp"):
        raise ValueError(
            f"--num-distributed-optimizer-instances {get_num_distributed_optimizer_instances()} does not divide the "
            f"expert data-parallel size {len(_ranks('expt-dp'))} (world / (ETP x EP x PP)): expert parameters cannot "
            "be split into that many instances; choose an instance count that divides it or a smaller "
            "--expert-model-parallel-size"
        )
    return "inner-expt-dp"


def get_expert_data_parallel_group(check_initialized=True, partial_expert_data_parallel=False):
    """The ranks holding the same experts (equal tp/ep/pp coordinates of the expert grid).

    `partial_expert_data_parallel` selects the inner group of hybrid sharding: the expert data-parallel ranks of
    one distributed-optimizer instance (see `get_outer_expert_data_parallel_group` for the ones across them).
    """
    if not check_initialized and not model_parallel_is_initialized():
        return None
    return _group(_expert_data_parallel_name(partial_expert_data_parallel))


def get_expert_data_parallel_group_gloo(partial_expert_data_parallel=False):
    """The gloo twin of `get_expert_data_parallel_group(...)` (needs `create_gloo_process_groups=True`)."""
    return _gloo_group_named(_expert_data_parallel_name(partial_expert_data_parallel))


def get_expert_data_parallel_rank(partial_expert_data_parallel=False):
    if not model_parallel_is_initialized():
        return 0
    return _rank_in(_expert_data_parallel_name(partial_expert_data_parallel))


def get_expert_data_parallel_world_size(partial_expert_data_parallel=False):
    if not model_parallel_is_initialized():
        return 1
    return len(_ranks(_expert_data_parallel_name(partial_expert_data_parallel)))


def get_inner_expert_data_parallel_group():
    """Hybrid sharding: the expert-DP/N consecutive expert data-parallel ranks of this instance."""
    return get_expert_data_parallel_group(partial_expert_data_parallel=True)


def get_outer_expert_data_parallel_group():
    """Hybrid sharding: the N expert data-parallel ranks at this rank's position across the distributed-optimizer
    instances (expert gradients are all-reduced over them, as dense ones over `get_outer_data_parallel_group`)."""
    _expert_data_parallel_name(partial_expert_data_parallel=True)
    return _group("outer-expt-dp")


def get_expert_tensor_and_model_parallel_group(check_initialized=True):
    """The expert tensor-parallel x expert-parallel ranks (ETP x EP) of this rank's pipeline stage and expert
    data-parallel position: together they hold every expert once (the token dispatchers' group)."""
    return _group_if("tp-ep", check_initialized)


def get_expert_tensor_and_model_parallel_world_size():
    return len(_ranks("tp-ep")) if model_parallel_is_initialized() else 1


def get_expert_tensor_and_model_parallel_rank():
    return _rank_in("tp-ep") if model_parallel_is_initialized() else 0


def get_expert_tensor_model_pipeline_parallel_group(check_initialized=True):
    """ETP x EP x PP: the ranks that together hold every expert of the model once."""
    return _group_if("tp-ep-pp", check_initialized)


# Expert tensor parallelism: the experts' linears split over `--expert-tensor-parallel-size` ranks (the
# tensor-parallel group itself when that equals the tensor-parallel size).
def get_expert_tensor_parallel_group(check_initialized=True):
    return _group_if("etp", check_initialized)


def get_expert_tensor_parallel_rank():
    return _override_or("etp-rank", lambda: _rank_in("etp") if model_parallel_is_initialized() else 0)


def get_expert_tensor_parallel_world_size():
    return _override_or("etp-size", lambda: len(_ranks("etp")) if model_parallel_is_initialized() else 1)


def set_expert_tensor_parallel_world_size(world_size):
    _set_override("etp-size", world_size, "expert_tensor_parallel_world_size")


def set_expert_tensor_parallel_rank(rank):
    _set_override("etp-rank", rank, "expert_tensor_parallel_rank")


# Model parallel, embedding (the device mesh: process_groups.get_device_mesh)
def get_model_parallel_group(check_initialized=True):
    """Tensor x pipeline model-parallel group."""
    return _group_if("mp", check_initialized)


def get_embedding_group(check_initialized=True):
    """First and last pipeline stage ranks of this rank's pipeline (only the one rank when PP == 1)."""
    return _group_if("embedding", check_initialized)


def get_embedding_global_ranks():
    return list(_ranks("embedding"))


def is_rank_in_embedding_group(ignore_virtual=True, vp_stage=None):
    """Whether this rank is in an embedding group. Without `ignore_virtual`, as upstream, the group's first rank
    counts only on the first (virtual) stage and its last rank only on the last (see `is_pipeline_first_stage`
    for `vp_stage`)."""
    if not _belongs_to("embedding"):
        return False
    if ignore_virtual:
        return True
    position = _rank_in("embedding")
    if position == 0:
        return is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)
    if position == len(_ranks("embedding")) - 1:
        return is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)
    return True


def is_initialized():
    """Upstream's check that the model-parallel groups exist (same as `model_parallel_is_initialized`)."""
    return model_parallel_is_initialized()


def get_position_embedding_group(check_initialized=True):
    """The ranks of this rank's pipeline that hold position embeddings (the first stage by default)."""
    return _group_if("position-embedding", check_initialized)


def is_rank_in_position_embedding_group():
    return _belongs_to("position-embedding")


# Upstream's scratch-memory pool, for tensors reused across calls (e.g. the output of an all-gather).
_GLOBAL_MEMORY_BUFFER = None


class GlobalMemoryBuffer:
    """Named, reusable flat buffers on the current device; `get_tensor` returns a view of the needed size."""

    def __init__(self):
        self.buffer = {}

    def get_tensor(self, tensor_shape, dtype, name, mem_alloc_context=None):
        if mem_alloc_context is not None:
            raise ValueError("GlobalMemoryBuffer.get_tensor(mem_alloc_context=...) is not supported here; pass None")
        from megatron.core.device_utils import get_current_device

        numel = 1
        for size in tensor_shape:
            numel *= size
        key = (name, dtype)
        if key not in self.buffer or self.buffer[key].numel() < numel:
            self.buffer[key] = torch.empty(numel, dtype=dtype, device=get_current_device(), requires_grad=False)
        return self.buffer[key][:numel].view(*tensor_shape)


def get_global_memory_buffer():
    """The process-wide `GlobalMemoryBuffer` (created on first use after `initialize_model_parallel`)."""
    global _GLOBAL_MEMORY_BUFFER
    if not model_parallel_is_initialized():
        raise RuntimeError("global memory buffer is not initialised; call initialize_model_parallel() first")
    if _GLOBAL_MEMORY_BUFFER is None:
        _GLOBAL_MEMORY_BUFFER = GlobalMemoryBuffer()
    return _GLOBAL_MEMORY_BUFFER


def destroy_global_memory_buffer():
    global _GLOBAL_MEMORY_BUFFER
    _GLOBAL_MEMORY_BUFFER = None
