"""Train / validation / test data iterators for `pretrain()`: sample counts, datasets, samplers, loaders."""

import torch
import torch.distributed as dist

from megatron.training.validation_sets import build_validation_sets, endless, evaluation_stream


def dataset_sample_counts(args):
    """Samples each split must provide for the whole run (Megatron's train_val_test_num_samples): --train-samples
    when given (with --train-iters, iterations x --global-batch-size); the validation count is None, the whole
    split, with --full-validation."""
    train_samples = getattr(args, "train_samples", None) or args.train_iters * args.global_batch_size
    evaluations = args.train_iters // args.eval_interval + 1
    valid_samples = evaluations * args.eval_iters * args.global_batch_size
    if getattr(args, "full_validation", False) and args.eval_iters > 0:
        valid_samples = None
    test_samples = args.eval_iters * args.global_batch_size
    return [train_samples, valid_samples, test_samples]


def get_train_valid_test_num_samples():
    """Upstream's name: the samples each split must provide (`dataset_sample_counts`) for the parsed arguments."""
    from megatron.training.global_state import get_args

    return dataset_sample_counts(get_args())


def build_train_valid_test_data_iterators(build_train_valid_test_datasets_provider):
    """Upstream's entry point for a script with its own training loop, after `initialize_megatron()` (and a
    checkpoint load): `build_data_iterators` for the parsed arguments. As upstream's, a loaded iteration without a
    recorded `consumed_train_samples` counts `iteration x --global-batch-size` samples as consumed."""
    from megatron.training.global_state import get_args

    args = get_args()
    iteration = getattr(args, "iteration", 0) or 0
    if not getattr(args, "consumed_train_samples", 0) and iteration > 0 and not getattr(args, "train_samples", None):
        args.consumed_train_samples = iteration * args.global_batch_size
    args.consumed_train_samples = getattr(args, "consumed_train_samples", 0) or 0
    return build_data_iterators(build_train_valid_test_datasets_provider, args)


# Upstream's name for the helper that reads a loader pass after pass, without end.
cyclic_iter = endless


def build_data_iterators(train_valid_test_dataset_provider, args):
    """(train, valid, test) iterators for this rank's data-parallel slice; None for a missing split.

    The training iterator starts after `args.consumed_train_samples` (so a resumed run sees the samples an
    uninterrupted run would), the validation iterator after the samples earlier evaluations consumed (from its
    first sample with --skip-train), the test iterator at its first sample; both read their set again when their
    evaluations need more samples than it holds (`evaluation_stream`).
    `--dataloader-type cyclic` reshuffles every epoch; with `external` the provider's three objects are the
    iterators, passed through as they are (they decide where a resumed run starts). With --full-validation or
    --multiple-validation-sets the validation element is a list of `ValidationSet` (validation_sets.py). Every
    sample of a GPT dataset, and every batch of any dataset, has its token ids checked against
    `args.padded_vocab_size` (`limit_token_ids`, `TokenIdCheckedLoader`).
    """
    from megatron.training.datasets.data_samplers import build_pretraining_data_loader, loader_settings_from_args
    from megatron.training.datasets.gpt_dataset_config import check_datasets_follow_flags

    dataloader_type = getattr(args, "dataloader_type", "single")
    sample_counts = dataset_sample_counts(args)
    datasets = train_valid_test_dataset_provider(sample_counts)
    if dataloader_type == "external":
        return _external_iterators(datasets)
    _check_tensor_parallel_ranks_have_the_same_splits(datasets, args)
    check_datasets_follow_flags(datasets, args)
    train_dataset, valid_dataset, test_dataset = datasets
    _limit_token_ids(datasets, args)
    _check_unweighted_blend_is_long_enough(train_dataset, sample_counts[0], dataloader_type)
    settings = loader_settings_from_args(args)

    def loader(dataset, consumed_samples, dataloader_type=dataloader_type):
        if dataset is None or len(dataset) == 0:
            return None
        return TokenIdCheckedLoader(build_pretraining_data_loader(
            dataset, consumed_samples, **{**settings, "dataloader_type": dataloader_type}), args)

    # A resumed run's evaluations continue after the samples earlier ones took; a --skip-train evaluation starts at
    # the first validation sample whatever iteration it loaded, as upstream's.
    iteration = 0 if getattr(args, "skip_train", False) else getattr(args, "iteration", 0)
    consumed_valid_samples = (iteration // args.eval_interval) * args.eval_iters * args.global_batch_size
    train_loader = None
    if _samples_left(train_dataset, args.consumed_train_samples, dataloader_type):
        train_loader = loader(train_dataset, args.consumed_train_samples)
    test = None
    if test_dataset is not None and len(test_dataset) > 0:
        test = evaluation_stream(test_dataset, loader, 0, dataloader_type, name="test set")
    if getattr(args, "full_validation", False) or getattr(args, "multiple_validation_sets", False):
        valid = build_validation_sets(valid_dataset, loader, consumed_valid_samples, args)
    else:
        valid = None
        if valid_dataset is not None and len(valid_dataset) > 0:
            valid = evaluation_stream(valid_dataset, loader, consumed_valid_samples, dataloader_type)
    if train_loader is None:
        return None, valid, test
    # A cyclic loader's every pass is the rest of one epoch (as upstream's sampler): passes follow one another.
    return (endless(train_loader) if dataloader_type == "cyclic" else iter(train_loader)), valid, test


class TokenIdCheckedLoader:
    """A data loader whose batches have their token ids checked against the model's vocabulary
    (`check_token_ids`, one max and one min per batch), so a run on data preprocessed with another tokenizer, or
    with a corrupt document anywhere, stops naming the dataset and the flags instead of failing inside the
    embedding. Otherwise the loader itself."""

    def __init__(self, loader, args):
        self.loader = loader
        self.args = args

    def __iter__(self):
        return self._checking(iter(self.loader))

    def _checking(self, batches):
        for batch in batches:
            check_token_ids(batch, self.loader.dataset, self.args)
            yield batch

    def __len__(self):
        return len(self.loader)

    def __getattr__(self, name):
        if name == "loader":  # not set yet (an unpickled copy)
            raise AttributeError(name)
        return getattr(self.loader, name)


def check_token_ids(batch, dataset, args):
    """Raise, naming the dataset prefix and the tokenizer flags, when a batch of `dataset` (a dict with `tokens`
    and `labels`) holds a token id the model's embedding has no row for (outside `[0, args.padded_vocab_size)`)."""
    vocab_rows = getattr(args, "padded_vocab_size", None)
    if vocab_rows is None or not isinstance(batch, dict) or "tokens" not in batch:
        return
    token_ids = [batch[key] for key in ("tokens", "labels") if key in batch and batch[key].numel()]
    if not token_ids:
        return
    largest, smallest = max(int(ids.max()) for ids in token_ids), min(int(ids.min()) for ids in token_ids)
    if largest < vocab_rows and smallest >= 0:
        return
    out_of_range = torch.stack([((ids >= vocab_rows) | (ids < 0)).reshape(len(ids), -1).any(dim=1)
                                for ids in token_ids]).any(0)
    token_id = largest if largest >= vocab_rows else smallest
    raise ValueError(f"a batch read from {_dataset_names(dataset, batch, out_of_range)} holds token id {token_id}, "
                     f"{_outside_vocabulary(vocab_rows, args)}")


def _outside_vocabulary(vocab_rows, args):
    """What a token id outside the model's vocabulary of `vocab_rows` ids means, and what to check."""
    tokenizer = " ".join(f"{flag} {getattr(args, name)}" for flag, name in (
        ("--tokenizer-type", "tokenizer_type"), ("--vocab-size", "vocab_size"),
        ("--tokenizer-model", "tokenizer_model"), ("--vocab-file", "vocab_file"))
        if getattr(args, name, None) is not None)
    return (f"outside the model's vocabulary of {vocab_rows} ids (the padded vocabulary size of this run's tokenizer"
            f"{': ' + tokenizer if tokenizer else ''}), so the data was likely preprocessed with another tokenizer "
            "(or the file is corrupt). Check --tokenizer-type, --vocab-size and --tokenizer-model / --vocab-file "
            "against the ones tools/preprocess_data.py was given: the data must be preprocessed with the tokenizer "
            "the run trains with (preprocess it again, or train with its tokenizer)")


def _limit_token_ids(datasets, args):
    """Every sample of the GPT datasets checked against the model's vocabulary, an error naming its document."""
    from megatron.core.datasets.gpt_dataset import limit_token_ids

    vocab_rows = getattr(args, "padded_vocab_size", None)
    if vocab_rows is not None:
        limit_token_ids(list(datasets), vocab_rows, _outside_vocabulary(vocab_rows, args))


def _dataset_names(dataset, batch, out_of_range):
    """The prefixes of the datasets whose samples of `batch` are `out_of_range` (a blend's, by their `dataset_id`)."""
    datasets = [dataset]
    if hasattr(dataset, "datasets") and "dataset_id" in batch:
        datasets = [dataset.datasets[int(index)] for index in batch["dataset_id"][out_of_range].unique()]
    prefixes = [getattr(getattr(part, "indexed_dataset", None), "path_prefix", None) for part in datasets]
    if all(prefixes):
        return f"dataset {', '.join(prefixes)}" if len(prefixes) == 1 else f"datasets {', '.join(prefixes)}"
    return f"a {type(dataset).__name__}"


def _check_unweighted_blend_is_long_enough(train_dataset, train_samples, dataloader_type):
    """A blend given without weights holds one epoch of each of its datasets at most, as upstream's; a single pass
    over it (upstream would run out of data mid-run) that cannot last the run stops here, up front."""
    from megatron.core.datasets.blended_dataset import BlendedDataset

    if dataloader_type != "single" or not isinstance(train_dataset, BlendedDataset) or train_samples is None:
        return
    if len(train_dataset) < train_samples:
        raise ValueError(f"the training blend holds {len(train_dataset)} samples (prefixes given without weights "
                         f"blend one epoch of each dataset), fewer than the {train_samples} --train-iters x "
                         "--global-batch-size (or --train-samples) needs: give weights (--data-path 0.5 A 0.5 B), "
                         "which repeat the datasets as needed, use --dataloader-type cyclic, or train fewer samples")


def _check_tensor_parallel_ranks_have_the_same_splits(datasets, args):
    """Raise on every rank of a tensor-parallel group in which some ranks got a split from the provider and others
    did not.

    Every rank reads its own batches here (`get_batch_on_this_tp_rank` broadcasts nothing), where upstream's
    broadcasts them from tensor-parallel rank 0: a provider written for that, passing upstream's
    is_dataset_built_on_rank to BlendedMegatronDatasetBuilder, leaves the other tensor-parallel ranks with None,
    which would fail at their first batch. (A middle pipeline stage without data is left alone: upstream's
    get_batch does not read there.) One all-gather over the tensor-parallel group, at start-up."""
    from megatron.core import parallel_state

    size = parallel_state.get_tensor_model_parallel_world_size()
    if size == 1 or not (dist.is_available() and dist.is_initialized()):
        return
    built = torch.tensor([dataset is not None for dataset in datasets], dtype=torch.int32,
                         device=getattr(args, "device", None) or "cpu")
    per_rank = [torch.zeros_like(built) for _ in range(size)]
    dist.all_gather(per_rank, built, group=parallel_state.get_tensor_model_parallel_group())
    per_rank = torch.stack(per_rank).cpu()
    for split, name in enumerate(("train", "validation", "test")):
        if per_rank[:, split].any() and not per_rank[:, split].all():
            without = per_rank[:, split].eq(0).nonzero().flatten().tolist()
            raise ValueError(
                f"the datasets provider built no {name} dataset on tensor-parallel rank(s) {without} of {size}, "
                "while the others have one. Every rank reads its own batches here (upstream broadcasts them from "
                "tensor-parallel rank 0, so its is_dataset_built_on_rank builds them there only): build the "
                "datasets on every rank, e.g. BlendedMegatronDatasetBuilder(cls, sizes, lambda: True, "
                "config).build() (pretrain_gpt.py's provider does)"
            )


def _samples_left(train_dataset, consumed_samples, dataloader_type):
    """Whether training has samples left to read. A training split that holds exactly the samples --train-iters
    (or --train-samples) asks for has been consumed by a finished run launched again (a requeued job): it gets no
    training iterator, trains no iteration and goes on to the evaluation after the last one, as upstream (a split
    built for whole epochs holds more, and the run trains nothing either, since its iterations are done)."""
    if train_dataset is None or dataloader_type == "cyclic" or consumed_samples < len(train_dataset) or \
            len(train_dataset) == 0:
        return True
    if dist.get_rank() == 0:
        print(f"all {len(train_dataset)} training samples were consumed before this launch: no training data is "
              "read", flush=True)
    return False


def _external_iterators(iterators):
    """--dataloader-type external: the provider returns (train, valid, test) iterators (or None) itself."""
    for name, iterator in zip(("train", "valid", "test"), iterators):
        if iterator is not None and not hasattr(iterator, "__next__"):
            raise TypeError(f"--dataloader-type external: the datasets provider returned a {type(iterator).__name__} "
                            f"for {name}; with external it must return iterators (e.g. iter(your_loader)), or use "
                            "--dataloader-type single or cyclic for datasets")
    return tuple(iterators)
