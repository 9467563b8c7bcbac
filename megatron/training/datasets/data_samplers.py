"""Batch samplers and the DataLoader used by pretraining.

A global micro-batch is `micro_batch_size * data_parallel_size` consecutive sample indices; data-parallel
rank r reads the r-th contiguous slice of it. Resuming from `consumed_samples` (a multiple of the global
micro-batch, as the training loop counts it) continues exactly where the interrupted run stopped.
"""

import torch


class MegatronPretrainingSampler:
    """Yields this rank's list of `micro_batch_size` indices for each global micro-batch, in order."""

    def __init__(
        self, total_samples, consumed_samples, micro_batch_size, data_parallel_rank, data_parallel_size, drop_last=True
    ):
        if total_samples <= 0:
            raise ValueError(f"no samples to iterate (total_samples={total_samples})")
        if not 0 <= consumed_samples < total_samples:
            raise ValueError(f"consumed_samples {consumed_samples} must be in [0, total_samples={total_samples})")
        if micro_batch_size <= 0:
            raise ValueError(f"--micro-batch-size must be positive (got {micro_batch_size})")
        if data_parallel_size <= 0 or not 0 <= data_parallel_rank < data_parallel_size:
            raise ValueError(f"data-parallel rank {data_parallel_rank} is not in a group of size {data_parallel_size}")
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.data_parallel_rank = data_parallel_rank
        self.data_parallel_size = data_parallel_size
        self.global_micro_batch_size = micro_batch_size * data_parallel_size
        self.drop_last = drop_last

    def __len__(self):
        return self.total_samples

    def _slice_for_rank(self, global_batch):
        start = self.data_parallel_rank * self.micro_batch_size
        return global_batch[start : start + self.micro_batch_size]

    def __iter__(self):
        global_batch = []
        for index in range(self.consumed_samples, self.total_samples):
            global_batch.append(index)
            if len(global_batch) == self.global_micro_batch_size:
                yield self._slice_for_rank(global_batch)
                global_batch = []
        # A last, partial global batch is still split by rank when the caller keeps it.
        if global_batch and not self.drop_last:
            rank_slice = self._slice_for_rank(global_batch)
            if rank_slice:
                yield rank_slice


def build_pretraining_data_loader(
    dataset, consumed_samples, micro_batch_size, data_parallel_rank, data_parallel_size, num_workers=0
):
    """A DataLoader yielding batch dicts of `[micro_batch_size, seq_length]` tensors for this DP rank."""
    if dataset is None:
        return None
    sampler = MegatronPretrainingSampler(
        total_samples=len(dataset),
        consumed_samples=consumed_samples,
        micro_batch_size=micro_batch_size,
        data_parallel_rank=data_parallel_rank,
        data_parallel_size=data_parallel_size,
    )
    return torch.utils.data.DataLoader(
        dataset,
        batch_sampler=sampler,
        num_workers=num_workers,
        pin_memory=False,
        persistent_workers=num_workers > 0,
    )
