"""Tensor parallelism: partitioned layers, the communication mappings between them, RNG streams, loss."""

from megatron.core.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from megatron.core.tensor_parallel.data import broadcast_data
from megatron.core.tensor_parallel.layers import (
    ColumnParallelLinear,
    LinearWithGradAccumulation,
    RowParallelLinear,
    VocabParallelEmbedding,
    copy_tensor_model_parallel_attributes,
    initialize_partition_from_master,
    linear_with_grad_accumulation_and_async_allreduce,
    param_is_not_tensor_parallel_duplicate,
    set_defaults_if_not_set_tensor_model_parallel_attributes,
    set_tensor_model_parallel_attributes,
)
from megatron.core.tensor_parallel.mappings import (
    all_gather_along_first_dim,
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region,
)
from megatron.core.tensor_parallel.random import (
    RNGStatesTracker,
    checkpoint,
    get_cuda_rng_tracker,
    get_data_parallel_rng_tracker_name,
    get_expert_parallel_rng_tracker_name,
    model_parallel_cuda_manual_seed,
)
from megatron.core.tensor_parallel.utils import (
    VocabUtility,
    divide,
    split_tensor_along_last_dim,
    strided_partition,
)

__all__ = [
    "ColumnParallelLinear",
    "LinearWithGradAccumulation",
    "RNGStatesTracker",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "VocabUtility",
    "all_gather_along_first_dim",
    "broadcast_data",
    "checkpoint",
    "copy_tensor_model_parallel_attributes",
    "copy_to_tensor_model_parallel_region",
    "divide",
    "gather_from_sequence_parallel_region",
    "gather_from_tensor_model_parallel_region",
    "get_cuda_rng_tracker",
    "get_data_parallel_rng_tracker_name",
    "get_expert_parallel_rng_tracker_name",
    "initialize_partition_from_master",
    "linear_with_grad_accumulation_and_async_allreduce",
    "model_parallel_cuda_manual_seed",
    "param_is_not_tensor_parallel_duplicate",
    "reduce_from_tensor_model_parallel_region",
    "reduce_scatter_to_sequence_parallel_region",
    "scatter_to_sequence_parallel_region",
    "scatter_to_tensor_model_parallel_region",
    "set_defaults_if_not_set_tensor_model_parallel_attributes",
    "set_tensor_model_parallel_attributes",
    "split_tensor_along_last_dim",
    "strided_partition",
    "vocab_parallel_cross_entropy",
]
