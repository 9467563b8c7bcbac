"""Batch samplers and the DataLoader used by pretraining.

A global micro-batch is `micro_batch_size * data_parallel_size` consecutive sample indices; data-parallel
rank r reads the r-th contiguous slice of it. Resuming from `consumed_samples` (a multiple of the global
micro-batch, as the training loop counts it) continues exactly where the interrupted run stopped.
"""

import functools
import signal

import torch

from megatron.core.datasets.utils import Split


def _ignore_in_worker(signal_number, worker_id):
    """`worker_init_fn`: the worker ignores `signal_number`. torch's workers die on a SIGTERM that does not come
    from their parent; launchers (torchrun, SLURM) signal every process of the job, so without this the rank that
    catches the signal to save a checkpoint (--exit-signal-handler) fails on its dead workers instead. The
    workers still end with their loader, or on their own once the rank is gone."""
    del worker_id
    signal.signal(signal_number, signal.SIG_IGN)


def _check_batch_layout(micro_batch_size, data_parallel_rank, data_parallel_size):
    if micro_batch_size <= 0:
        raise ValueError(f"--micro-batch-size must be positive (got {micro_batch_size})")
    if data_parallel_size <= 0 or not 0 <= data_parallel_rank < data_parallel_size:
        raise ValueError(f"data-parallel rank {data_parallel_rank} is not in a group of size {data_parallel_size}")


class MegatronPretrainingSampler:
    """Yields this rank's list of `micro_batch_size` indices for each global micro-batch, in order."""

    def __init__(
        self, total_samples, consumed_samples, micro_batch_size, data_parallel_rank, data_parallel_size, drop_last=True
    ):
        if total_samples <= 0:
            raise ValueError(f"no samples to iterate (total_samples={total_samples})")
        if not 0 <= consumed_samples < total_samples:
            raise ValueError(f"consumed_samples {consumed_samples} must be in [0, total_samples={total_samples})")
        _check_batch_layout(micro_batch_size, data_parallel_rank, data_parallel_size)
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


class MegatronPretrainingRandomSampler:
    """`--dataloader-type cyclic`: epochs over the dataset, each in a new random order, as upstream's. Each
    iteration yields the rest of the epoch `consumed_samples` is in and advances `consumed_samples` past it, so the
    next iteration (the training iterator's next pass over the loader) reads the next epoch.

    With `E = total - total % (micro_batch_size x data_parallel_size)` samples an epoch, `consumed_samples` fixes the
    epoch `consumed // E` and the point reached in it; epoch e's order is `torch.randperm` from a generator seeded
    with e (not with `--seed`). With `data_sharding` (the default; `--no-data-sharding` turns it off) rank r owns
    the contiguous bucket `[r * B, (r + 1) * B)` of `B = E / data_parallel_size` samples and reads its own
    permutation of it; without, every rank reads its every data_parallel_size-th entry of one permutation of the
    first `total - total % micro_batch_size` samples. A rank's micro-batches are consecutive runs of its entries.
    The order depends on `consumed_samples` only, so a resumed run continues exactly (also mid-epoch).
    """

    def __init__(self, dataset, total_samples, consumed_samples, micro_batch_size, data_parallel_rank,
                 data_parallel_size, data_sharding=True):
        _check_batch_layout(micro_batch_size, data_parallel_rank, data_parallel_size)
        self.dataset = dataset
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.data_parallel_rank = data_parallel_rank
        self.data_parallel_size = data_parallel_size
        self.data_sharding = data_sharding
        self.global_micro_batch_size = micro_batch_size * data_parallel_size
        self.samples_per_epoch = total_samples - total_samples % self.global_micro_batch_size
        if self.samples_per_epoch <= 0:
            raise ValueError(f"--dataloader-type cyclic: the dataset's {total_samples} samples do not fill one global "
                             f"micro-batch of {micro_batch_size} x {data_parallel_size} data-parallel ranks")
        if consumed_samples % self.global_micro_batch_size:
            raise ValueError(f"--dataloader-type cyclic: consumed_samples {consumed_samples} is not a multiple of the "
                             f"global micro-batch {micro_batch_size} x {data_parallel_size}")

    def __len__(self):
        return self.total_samples

    def rank_order(self, epoch, done_in_epoch):
        """This rank's sample indices for the rest of `epoch`, after `done_in_epoch` samples of it were read."""
        generator = torch.Generator().manual_seed(epoch)
        if self.data_sharding:
            bucket_size = self.samples_per_epoch // self.data_parallel_size
            bucket_start = self.data_parallel_rank * bucket_size
            permutation = torch.randperm(bucket_size, generator=generator).tolist()
            return [bucket_start + index for index in permutation[done_in_epoch // self.data_parallel_size:]]
        usable = self.total_samples - self.total_samples % self.micro_batch_size
        permutation = torch.randperm(usable, generator=generator).tolist()
        return permutation[done_in_epoch:][self.data_parallel_rank::self.data_parallel_size]

    def __iter__(self):
        epoch, done_in_epoch = divmod(self.consumed_samples, self.samples_per_epoch)
        order = self.rank_order(epoch, done_in_epoch)
        for start in range(0, len(order) - self.micro_batch_size + 1, self.micro_batch_size):
            self.consumed_samples += self.global_micro_batch_size
            yield order[start : start + self.micro_batch_size]


def loader_settings_from_args(args):
    """The keyword arguments of `build_pretraining_data_loader` that the command line and the data-parallel group
    give: --micro-batch-size, this rank's place in its data-parallel group, --num-workers, --dataloader-type,
    --seed, --no-data-sharding and the signal --exit-signal-handler catches (the loader's workers outlive it)."""
    from megatron.core import parallel_state

    caught_signal = (signal.Signals[getattr(args, "exit_signal", "SIGTERM")]
                     if getattr(args, "exit_signal_handler", False) else None)
    return dict(micro_batch_size=args.micro_batch_size,
                data_parallel_rank=parallel_state.get_data_parallel_rank(),
                data_parallel_size=parallel_state.get_data_parallel_world_size(),
                num_workers=args.num_workers, dataloader_type=getattr(args, "dataloader_type", "single"),
                seed=args.seed, data_sharding=getattr(args, "data_sharding", True), worker_ignored_signal=caught_signal)


def build_pretraining_data_loader(
    dataset, consumed_samples, micro_batch_size=None, data_parallel_rank=None, data_parallel_size=None,
    num_workers=0, dataloader_type="single", seed=0, data_sharding=True, worker_ignored_signal=None,
):
    """A DataLoader yielding batch dicts of `[micro_batch_size, seq_length]` tensors for this DP rank:
    in the dataset's order (`single`) or in a new random order every epoch (`cyclic`, with `data_sharding` as
    `--no-data-sharding` leaves it; each pass over the loader is the rest of one epoch, as upstream's); `external`
    returns `dataset` itself, as upstream's. `seed` seeds the workers, not the order. `worker_ignored_signal`: a
    signal the worker processes ignore (the one --exit-signal-handler catches in the rank).

    Upstream's form, `build_pretraining_data_loader(dataset, consumed_samples)`, takes every setting from the
    parsed arguments (`get_args()`, after `initialize_megatron`) and the data-parallel group, and reads a
    validation split from its start with --full-validation, as upstream's."""
    if dataset is None:
        return None
    if micro_batch_size is None:
        if data_parallel_rank is not None or data_parallel_size is not None:
            raise TypeError("build_pretraining_data_loader: give micro_batch_size with data_parallel_rank and "
                            "data_parallel_size, or none of them to take all three from the parsed arguments")
        from megatron.training.global_state import get_args

        args = get_args()
        if getattr(args, "full_validation", False) and getattr(dataset, "split", None) is Split.valid:
            consumed_samples = 0
        return build_pretraining_data_loader(dataset, consumed_samples, **loader_settings_from_args(args))
    if data_parallel_rank is None or data_parallel_size is None:
        raise TypeError("build_pretraining_data_loader: micro_batch_size needs data_parallel_rank and "
                        "data_parallel_size too")
    if dataloader_type == "external":
        return dataset
    if dataloader_type not in ("single", "cyclic"):
        raise ValueError(f"--dataloader-type {dataloader_type}: choose single, cyclic or external")
    if dataloader_type == "cyclic":
        sampler = MegatronPretrainingRandomSampler(dataset, len(dataset), consumed_samples, micro_batch_size,
                                                   data_parallel_rank, data_parallel_size, data_sharding)
    else:
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
        # Each iter() draws the workers' base seed from this generator, not from torch's global one: building or
        # restarting an iterator leaves the dropout stream alone, so a resumed run draws the masks of the
        # uninterrupted one.
        generator=torch.Generator().manual_seed(seed),
        worker_init_fn=(functools.partial(_ignore_in_worker, worker_ignored_signal)
                        if worker_ignored_signal is not None and num_workers > 0 else None),
    )
