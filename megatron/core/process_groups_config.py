"""`ProcessGroupCollection`: the process groups a module or the optimizer communicates over, passed explicitly.

Megatron-Core's modules take an optional `pg_collection` instead of reading `parallel_state`'s globals. It holds
only the groups it was given: an attribute that was not set is absent (`hasattr` is False), so a caller can tell
"not provided" from a group. `use_mpu_process_groups(required_pgs=[...])` fills it from `parallel_state`.
"""

import dataclasses
from functools import partial

from megatron.core import parallel_state


@dataclasses.dataclass(init=False, repr=False, eq=False)
class ProcessGroupCollection:
    """Named process groups (Megatron-Core's attribute names); pass any subset as keywords."""

    tp: object = dataclasses.field(init=False)  # tensor model parallel
    pp: object = dataclasses.field(init=False)  # pipeline model parallel
    mp: object = dataclasses.field(init=False)  # tensor x pipeline model parallel
    embd: object = dataclasses.field(init=False)  # first and last pipeline stage (tied embeddings)
    pos_embd: object = dataclasses.field(init=False)  # the stage holding position embeddings
    cp: object = dataclasses.field(init=False)  # context parallel
    tp_cp: object = dataclasses.field(init=False)
    hcp: object = dataclasses.field(init=False)  # hierarchical context-parallel groups (a list), inner to outer
    ep: object = dataclasses.field(init=False)  # expert model parallel
    expt_tp: object = dataclasses.field(init=False)  # expert tensor parallel
    tp_ep: object = dataclasses.field(init=False)  # expert tensor x expert model parallel
    tp_ep_pp: object = dataclasses.field(init=False)
    tp_dp_cp: object = dataclasses.field(init=False)  # every rank of a pipeline stage
    dp: object = dataclasses.field(init=False)
    dp_cp: object = dataclasses.field(init=False)  # data parallel with context parallel (gradient reduction)
    expt_dp: object = dataclasses.field(init=False)  # expert data parallel
    intra_dp_cp: object = dataclasses.field(init=False)  # dp_cp within one distributed-optimizer instance
    intra_expt_dp: object = dataclasses.field(init=False)  # expt_dp within one distributed-optimizer instance
    inter_dist_opt: object = dataclasses.field(init=False)  # across distributed-optimizer instances
    intra_dist_opt: object = dataclasses.field(init=False)  # every rank of one distributed-optimizer instance

    def __init__(self, **groups):
        unknown = sorted(set(groups) - _field_names())
        if unknown:
            raise ValueError(f"ProcessGroupCollection: unknown process group names {unknown}; "
                             f"known names are {sorted(_field_names())}")
        for name, group in groups.items():
            setattr(self, name, group)

    def __repr__(self):
        present = [name for name in sorted(_field_names()) if hasattr(self, name)]
        return f"ProcessGroupCollection({', '.join(present)})"

    @classmethod
    def use_mpu_process_groups(cls, required_pgs=None):
        """A collection of `parallel_state`'s groups (after `initialize_model_parallel`): those named in
        `required_pgs`, or all of them. Groups this rank has none of (e.g. the embedding group of a middle pipeline
        stage, `hcp` without hierarchical sizes) are None."""
        if isinstance(required_pgs, str):
            raise ValueError(f"use_mpu_process_groups(required_pgs={required_pgs!r}): pass a list of names")
        names = sorted(_field_names()) if required_pgs is None else list(required_pgs)
        unknown = [name for name in names if name not in _field_names()]
        if unknown:
            raise ValueError(f"use_mpu_process_groups: unknown process group names {unknown}; "
                             f"known names are {sorted(_field_names())}")
        if not parallel_state.model_parallel_is_initialized():
            raise RuntimeError("use_mpu_process_groups: the model-parallel groups are not initialised; call "
                               "parallel_state.initialize_model_parallel() first")
        getters = _mpu_getters()
        return cls(**{name: getters[name]() for name in names})


def _field_names():
    return {field.name for field in dataclasses.fields(ProcessGroupCollection)}


def _mpu_getters():
    ps = parallel_state
    return {
        "tp": ps.get_tensor_model_parallel_group,
        "pp": ps.get_pipeline_model_parallel_group,
        "mp": ps.get_model_parallel_group,
        "embd": partial(ps.get_embedding_group, check_initialized=False),
        "pos_embd": partial(ps.get_position_embedding_group, check_initialized=False),
        "cp": ps.get_context_parallel_group,
        "tp_cp": ps.get_tensor_and_context_parallel_group,
        "hcp": partial(ps.get_hierarchical_context_parallel_groups, check_initialized=False),
        "ep": ps.get_expert_model_parallel_group,
        "expt_tp": ps.get_expert_tensor_parallel_group,
        "tp_ep": ps.get_expert_tensor_and_model_parallel_group,
        "tp_ep_pp": ps.get_expert_tensor_model_pipeline_parallel_group,
        "tp_dp_cp": partial(ps.get_tensor_and_data_parallel_group, with_context_parallel=True),
        "dp": ps.get_data_parallel_group,
        "dp_cp": partial(ps.get_data_parallel_group, with_context_parallel=True),
        "expt_dp": ps.get_expert_data_parallel_group,
        "intra_dp_cp": partial(ps.get_data_parallel_group, with_context_parallel=True, partial_data_parallel=True),
        "intra_expt_dp": partial(ps.get_expert_data_parallel_group, partial_expert_data_parallel=True),
        "inter_dist_opt": ps.get_inter_distributed_optimizer_instance_group,
        "intra_dist_opt": ps.get_intra_distributed_optimizer_instance_group,
    }
