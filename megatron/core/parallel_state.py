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

from megatron.core.process_groups import (  # noqa: F401  (re-exported: parallel_state's public face)
    belongs_to as _belongs_to,
    destroy_model_parallel,
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
    RankGrid,
    device_mesh_layout,
    generate_rank_groups,
    parse_order,
    validate_parallel_sizes,
)


# Tensor model parallel
def get_tensor_model_parallel_group():
    return _group("tp")


def get_tensor_model_parallel_rank():
    return _rank_in("tp") if model_parallel_is_initialized() else 0


def get_tensor_model_parallel_world_size():
    return len(_ranks("tp")) if model_parallel_is_initialized() else 1


def get_tensor_model_parallel_src_rank():
    """Global rank of tensor-parallel rank 0 in this rank's group."""
    return _ranks("tp")[0]


def get_tensor_model_parallel_global_ranks():
    return list(_ranks("tp"))


# Pipeline model parallel
def get_pipeline_model_parallel_group():
    return _group("pp")


def get_pipeline_model_parallel_rank():
    return _rank_in("pp") if model_parallel_is_initialized() else 0


def get_pipeline_model_parallel_world_size():
    return len(_ranks("pp")) if model_parallel_is_initialized() else 1


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


# Context parallel
def get_context_parallel_group():
    return _group("cp")


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


def get_tensor_and_context_parallel_group():
    return _group("tp-cp")


def get_tensor_and_data_parallel_group(with_context_parallel=False):
    """The tensor-parallel x data-parallel ranks of this rank's pipeline stage that share its context-parallel
    position; `with_context_parallel`: every rank of the stage (TP x DP x CP)."""
    return _group("tp-dp-cp" if with_context_parallel else "tp-dp")


def get_amax_reduction_group(with_context_parallel=False, tp_only_amax_red=False):
    """The ranks that reduce FP8 amaxes together so they quantize a shared tensor with one scale.

    Every rank of a pipeline stage holds shards (TP) or replicas (DP, CP) of the same layers, so under delayed
    scaling the amaxes are reduced over the stage's TP x DP (x CP with `with_context_parallel`, as FP8
    training uses it) ranks; `tp_only_amax_red` narrows it to the tensor-parallel group (shards agree, replicas
    may not). Megatron-Core's getter; Transformer Engine's autocast takes it as `fp8_group`.
    """
    if tp_only_amax_red:
        return get_tensor_model_parallel_group()
    return get_tensor_and_data_parallel_group(with_context_parallel)


# Expert parallel
def get_expert_model_parallel_group():
    return _group("ep")


def get_expert_model_parallel_rank():
    return _rank_in("ep") if model_parallel_is_initialized() else 0


def get_expert_model_parallel_world_size():
    return len(_ranks("ep")) if model_parallel_is_initialized() else 1


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


def get_expert_data_parallel_group(partial_expert_data_parallel=False):
    """The ranks holding the same experts (equal tp/ep/pp coordinates of the expert grid).

    `partial_expert_data_parallel` selects the inner group of hybrid sharding: the expert data-parallel ranks of
    one distributed-optimizer instance (see `get_outer_expert_data_parallel_group` for the ones across them).
    """
    return _group(_expert_data_parallel_name(partial_expert_data_parallel))


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


def get_expert_tensor_and_model_parallel_group():
    """The expert tensor-parallel x expert-parallel ranks (ETP x EP) of this rank's pipeline stage and expert
    data-parallel position: together they hold every expert once (the token dispatchers' group)."""
    return _group("tp-ep")


def get_expert_tensor_and_model_parallel_world_size():
    return len(_ranks("tp-ep")) if model_parallel_is_initialized() else 1


def get_expert_tensor_and_model_parallel_rank():
    return _rank_in("tp-ep") if model_parallel_is_initialized() else 0


def get_expert_tensor_model_pipeline_parallel_group():
    """ETP x EP x PP: the ranks that together hold every expert of the model once."""
    return _group("tp-ep-pp")


# Expert tensor parallelism: the experts' linears split over `--expert-tensor-parallel-size` ranks (the
# tensor-parallel group itself when that equals the tensor-parallel size).
def get_expert_tensor_parallel_group():
    return _group("etp")


def get_expert_tensor_parallel_rank():
    return _rank_in("etp") if model_parallel_is_initialized() else 0


def get_expert_tensor_parallel_world_size():
    return len(_ranks("etp")) if model_parallel_is_initialized() else 1


# Model parallel, embedding (the device mesh: process_groups.get_device_mesh)
def get_model_parallel_group():
    """Tensor x pipeline model-parallel group."""
    return _group("mp")


def get_embedding_group():
    """First and last pipeline stage ranks of this rank's pipeline (only the one rank when PP == 1)."""
    return _group("embedding")


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


def get_position_embedding_group():
    """The ranks of this rank's pipeline that hold position embeddings (the first stage by default)."""
    return _group("position-embedding")


def is_rank_in_position_embedding_group():
    return _belongs_to("position-embedding")
