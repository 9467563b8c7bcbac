"""The vocabulary-parallel embedding: the table split along the vocabulary over the tensor-parallel group."""

import torch
import torch.nn.functional as F
from torch.nn.parameter import Parameter

from megatron.core import parallel_state
from megatron.core.tensor_parallel.mappings import (
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)
from megatron.core.tensor_parallel.partitioned_parameters import (
    check_tensor_parallel_group,
    initialize_partition_from_master,
    parameter_device,
    set_tensor_model_parallel_attributes,
    sharded_state_dict_with_axes,
)
from megatron.core.tensor_parallel.utils import VocabUtility


class VocabParallelEmbedding(torch.nn.Module):
    """Embedding table split along the vocabulary: rank r holds rows [r*V/tp, (r+1)*V/tp).

    Each rank looks up the ids in its range (zeros elsewhere) and the results are summed over the
    tensor-parallel group. With `reduce_scatter_embeddings` a `[b, s]` input yields `[s/tp, b, h]`:
    transposed to sequence-first and reduce-scattered along the sequence for sequence parallelism.
    """

    def __init__(self, num_embeddings, embedding_dim, *, init_method, config, reduce_scatter_embeddings=False,
                 tp_group=None):
        super().__init__()
        check_tensor_parallel_group("VocabParallelEmbedding", tp_group)
        self.config = config
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.init_method = init_method
        self.reduce_scatter_embeddings = reduce_scatter_embeddings
        tp_size = parallel_state.get_tensor_model_parallel_world_size()
        if num_embeddings % tp_size != 0:
            raise ValueError(
                f"vocabulary size {num_embeddings} is not divisible by --tensor-model-parallel-size {tp_size}; "
                "pad the vocabulary (--make-vocab-size-divisible-by) to a multiple of it"
            )
        self.num_embeddings_per_partition = num_embeddings // tp_size
        self.vocab_start_index, self.vocab_end_index = VocabUtility.vocab_range_from_global_vocab_size(
            num_embeddings, parallel_state.get_tensor_model_parallel_rank(), tp_size
        )
        self.tensor_model_parallel_size = tp_size
        device = parameter_device(config)
        self.weight = Parameter(
            torch.empty(self.num_embeddings_per_partition, embedding_dim, dtype=config.params_dtype, device=device)
        )
        set_tensor_model_parallel_attributes(self.weight, True, 0, 1)
        self.reset_parameters()

    def reset_parameters(self):
        if self.config.perform_initialization:
            initialize_partition_from_master(
                self.weight, (self.num_embeddings, self.embedding_dim), self.init_method, 0, 1
            )

    def forward(self, input_):
        if self.tensor_model_parallel_size > 1:
            out_of_range = (input_ < self.vocab_start_index) | (input_ >= self.vocab_end_index)
            local_ids = (input_ - self.vocab_start_index).masked_fill(out_of_range, 0)
        else:
            local_ids = input_
        output_parallel = F.embedding(local_ids, self.weight)
        if self.tensor_model_parallel_size > 1:
            output_parallel = output_parallel.masked_fill(out_of_range.unsqueeze(-1), 0.0)
        if self.reduce_scatter_embeddings:
            output_parallel = output_parallel.transpose(0, 1).contiguous()
            return reduce_scatter_to_sequence_parallel_region(output_parallel)
        return reduce_from_tensor_model_parallel_region(output_parallel)

    def extra_repr(self):
        return (
            f"num_embeddings={self.num_embeddings}, embedding_dim={self.embedding_dim}, "
            f"num_embeddings_per_partition={self.num_embeddings_per_partition}"
        )

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        """Checkpoint entries: the weight as this rank's rows (dim 0, the vocabulary) of the logical table."""
        return sharded_state_dict_with_axes(self, prefix, sharded_offsets, {"weight": 0})
