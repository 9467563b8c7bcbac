"""Context parallelism: each rank holds 1/N of every sequence (two load-balanced chunks) and attention is made
exact by communication over the context-parallel group.

Files, one job each:
- `sequence_split`: which tokens a rank holds (pure arithmetic) and `get_batch_on_this_cp_rank`;
- `comm_types`: the comm type names, the per-layer `--cp-comm-type` list and the hierarchical sizes' rules;
- `collectives`: the only code that calls torch.distributed (ring exchange, all-gather, reduce-scatter, all-to-all);
- `online_softmax`: attention over one block of keys with its log-sum-exp, the block backward, and the merge;
- `ring_attention` (p2p), `allgather_attention`, `a2a_attention` (Ulysses), `hierarchical_attention`
  (a2a+p2p): one file per comm type;
- `core_attention`: the entry point that dispatches on the comm type;
- `loss`: the loss over the whole sequence from the ranks' partial sums and counts.
"""

from megatron.core.transformer.context_parallel.comm_types import (
    CP_COMM_TYPES,
    comm_type_of_layer,
    normalize_cp_comm_type,
    normalize_cp_comm_types,
    validate_hierarchical_sizes,
)
from megatron.core.transformer.context_parallel.core_attention import context_parallel_attention
from megatron.core.transformer.context_parallel.loss import context_parallel_loss
from megatron.core.transformer.context_parallel.sequence_split import (
    get_batch_on_this_cp_rank,
    local_rows,
    local_token_indices,
)

__all__ = [
    "CP_COMM_TYPES",
    "comm_type_of_layer",
    "context_parallel_attention",
    "context_parallel_loss",
    "get_batch_on_this_cp_rank",
    "local_rows",
    "local_token_indices",
    "normalize_cp_comm_type",
    "normalize_cp_comm_types",
    "validate_hierarchical_sizes",
]
