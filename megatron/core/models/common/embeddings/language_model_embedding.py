"""Token embedding (vocab-parallel) plus an optional learned absolute position embedding, then dropout.

Output is `[s, b, h]`, or `[s / tp, b, h]` with sequence parallelism, where the embedding is computed on the
whole sequence and each tensor-parallel rank keeps its own slice of it.

Both tables initialise with `config.embedding_init_method` (`--embedding-init-method-std`, else the ordinary
init) and carry `is_embedding_parameter=True`, which the optimizer reads to keep them out of weight decay when
asked to (`get_megatron_optimizer(..., default_skip_embedding_weight_decay=True)`).
"""

import torch
import torch.nn.functional as F

from megatron.core import tensor_parallel
from megatron.core.transformer.init_seeds import (
    build_with_init_seed,
    derive_init_seed,
    reset_children_parameters,
    resolve_base_init_seed,
)
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import initialize_from_cpu_master, parameter_device

POSITION_EMBEDDING_TYPES = ("learned_absolute", "rope", "yarn", "none")


def word_embedding_init_seed(base_seed: int) -> int:
    """Seed of the word embedding's initial weights (also of a tied output layer's copy on the last stage)."""
    return derive_init_seed(base_seed, "embedding.word_embeddings")


def position_embedding_init_seed(base_seed: int) -> int:
    return derive_init_seed(base_seed, "embedding.position_embeddings")


class LearnedPositionEmbedding(torch.nn.Module):
    """A `[max_sequence_length, h]` table, whole on every tensor-parallel rank, initialised by
    `embedding_init_method`."""

    def __init__(self, config: TransformerConfig, max_sequence_length: int):
        super().__init__()
        self.config = config
        self.weight = torch.nn.Parameter(
            torch.empty(
                max_sequence_length, config.hidden_size, device=parameter_device(config), dtype=config.params_dtype
            )
        )
        self.weight.tensor_model_parallel = False
        self.reset_parameters()

    def reset_parameters(self):
        if self.config.perform_initialization:
            initialize_from_cpu_master(self.weight, self.config.embedding_init_method)

    def forward(self, position_ids):
        return F.embedding(position_ids, self.weight)


class LanguageModelEmbedding(torch.nn.Module):
    """Word embeddings split over the vocabulary across tensor-parallel ranks, and position embeddings.

    Args:
        config: the transformer config (hidden size, embedding init method, dropout, sequence parallelism).
        vocab_size: rows of the word embedding (already padded to a multiple of the TP size).
        max_sequence_length: rows of the learned position embedding.
        position_embedding_type: "learned_absolute" adds a learned position embedding here; "rope", "yarn" and
            "none" add nothing (rope and yarn are applied inside attention).
        base_init_seed: the model's base init seed (None: `config.init_seed`, else the default generator's
            seed); the word and position embeddings each draw from their own seed derived from it.
        scatter_to_sequence_parallel: with --sequence-parallel, return this rank's `[s / tp, b, h]` slice (True,
            upstream's default) or the whole `[s, b, h]` for a caller that scatters it itself (False).
    """

    def __init__(
        self,
        config: TransformerConfig,
        vocab_size: int,
        max_sequence_length: int,
        position_embedding_type: str = "learned_absolute",
        base_init_seed=None,
        scatter_to_sequence_parallel: bool = True,
    ):
        super().__init__()
        self.scatter_to_sequence_parallel = scatter_to_sequence_parallel
        if position_embedding_type not in POSITION_EMBEDDING_TYPES:
            raise ValueError(
                f"--position-embedding-type must be one of {POSITION_EMBEDDING_TYPES}, got {position_embedding_type!r}"
            )
        self.config = config
        self.vocab_size = vocab_size
        self.max_sequence_length = max_sequence_length
        self.add_position_embedding = position_embedding_type == "learned_absolute"

        if base_init_seed is None:
            base_init_seed = resolve_base_init_seed(config)
        self.word_embeddings = build_with_init_seed(
            word_embedding_init_seed(base_init_seed),
            lambda: tensor_parallel.VocabParallelEmbedding(
                vocab_size, config.hidden_size, init_method=config.embedding_init_method, config=config
            ),
        )
        self.word_embeddings.weight.is_embedding_parameter = True
        if self.add_position_embedding:
            self.position_embeddings = build_with_init_seed(
                position_embedding_init_seed(base_init_seed),
                lambda: LearnedPositionEmbedding(config, max_sequence_length),
            )
            self.position_embeddings.weight.is_embedding_parameter = True
        self.embedding_dropout = torch.nn.Dropout(config.hidden_dropout)

    def reset_parameters(self):
        """Redraw the word and position embeddings; the same values as at construction."""
        reset_children_parameters(self)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor = None) -> torch.Tensor:
        """`input_ids`, `position_ids`: `[b, s]` -> embeddings `[s, b, h]` (sequence-split when SP is on, unless
        `scatter_to_sequence_parallel` is False)."""
        embeddings = self.word_embeddings(input_ids)
        if self.add_position_embedding:
            if position_ids is None:
                raise ValueError("learned_absolute position embeddings need position_ids")
            seq_len = input_ids.shape[1]
            # A row longer than the table is fine when its positions restart (packed sequences).
            if seq_len > self.max_sequence_length and int(position_ids.max()) >= self.max_sequence_length:
                raise ValueError(
                    f"sequence length {seq_len} exceeds --max-position-embeddings ({self.max_sequence_length})"
                )
            embeddings = embeddings + self.position_embeddings(position_ids)
        embeddings = embeddings.transpose(0, 1).contiguous()  # [b, s, h] -> [s, b, h]

        if self.config.sequence_parallel and self.scatter_to_sequence_parallel:
            embeddings = tensor_parallel.scatter_to_sequence_parallel_region(embeddings)
            # Each rank now holds different tokens, so each needs its own dropout mask.
            with tensor_parallel.get_cuda_rng_tracker().fork():
                return self.embedding_dropout(embeddings)
        return self.embedding_dropout(embeddings)
