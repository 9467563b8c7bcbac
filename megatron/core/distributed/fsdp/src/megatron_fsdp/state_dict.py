"""Model and optimizer state dicts of a MegatronFSDP model as row-sharded DTensors (see uneven_dtensor.py).

The row-aligned layout (layout.py) keeps each rank's rows of every parameter contiguous in its shard, which
is exactly what a state-dict DTensor (`Shard(0)` rows) holds: saving hands out views of those rows and loading
writes the rows into the shard, without communication. Two exceptions gather: HFSDP's optimizer side (main
weights and optimizer state are flat sub-shards of the rows, all-gathered over the outer group), and groups
whose full compute weights are written on load (strategy 0, frozen groups of strategies 1/2). A 0-dim
parameter lives on rank 0 only; its (replicated) value comes from the full weights (model state of strategies
0-2) or from replicas kept on every rank (`refresh_scalar_replicas`, `refresh_optimizer_scalar_replicas`), so
that `model.state_dict()` and `optimizer.state_dict()` issue no collective; stale replicas are summed over the
data-parallel group again.

Each group's rows are those of its shard ranks (`group.topology`): expert groups' DTensors live on the expert
data-parallel mesh, so an expert tensor's rows are spread over the ranks holding that expert.

With tensor parallelism a parameter's rows are those of this rank's TP partition, and its DTensor has the full,
unpartitioned shape (see uneven_dtensor.py); loading cuts full values down to the partition first.

The work is split by job: `state_dict_rows` (a group's rows of each parameter, to and from shards and DTensors),
`model_state_dict` (the model's state dict and its 0-dim replicas) and `optimizer_state_dict` (the optimizer's).
This module keeps their names importable from one place.
"""

from .model_state_dict import (
    gather_rows_written_through_state_dict,
    load_model_state_dict,
    model_state_dict,
    module_state_keys,
    refresh_scalar_replicas,
)
from .optimizer_state_dict import (
    MAIN_PARAM_KEY,
    SCALED_STATE_KEYS,
    load_optimizer_state_dict,
    optimizer_state_dict,
    refresh_optimizer_scalar_replicas,
    refuse_unloaded_optimizer_state_writes,
)
from .state_dict_rows import CHECKPOINT_WRAPPER_PREFIX, _full_flat, state_dict_name

__all__ = [
    "CHECKPOINT_WRAPPER_PREFIX",
    "MAIN_PARAM_KEY",
    "SCALED_STATE_KEYS",
    "_full_flat",
    "gather_rows_written_through_state_dict",
    "load_model_state_dict",
    "load_optimizer_state_dict",
    "model_state_dict",
    "module_state_keys",
    "optimizer_state_dict",
    "refresh_optimizer_scalar_replicas",
    "refresh_scalar_replicas",
    "refuse_unloaded_optimizer_state_writes",
    "state_dict_name",
]
