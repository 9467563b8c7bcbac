"""The validation sets an evaluation runs over, and which batches each evaluation takes from each.

By default there is one set, the validation split (a blend when it has several datasets): an endless stream of
which every evaluation takes the next --eval-iters global batches.

--multiple-validation-sets makes one set per validation dataset (the provider returns the valid split as a list),
each evaluated and logged on its own under its label: the file name of the dataset's prefix
(`.../b_text_document` -> `b_text_document`), or `<position>:<file name>` when two prefixes share a file name.

--full-validation makes every evaluation a new pass over the whole set, which the datasets provider built at its
natural size (one epoch): all of its complete global batches, in the dataset's order, the same samples each
time. A last partial global batch is left out, as the training data loader drops one: every data-parallel rank
and microbatch must be full for the pipeline schedule.
"""

import dataclasses
import os
from typing import Any, Iterator, Optional

import torch.distributed as dist


def endless(loader):
    """The loader's batches, epoch after epoch, without end."""
    while True:
        yield from loader


def evaluation_stream(dataset, make_loader, consumed_samples, dataloader_type="single", name="validation set"):
    """This rank's batches of an evaluation set (`name`: the validation or the test set) without end, as an
    uninterrupted run reads them, after the `consumed_samples` that earlier evaluations took.

    A `single` loader makes one pass over the complete global micro-batches (micro batch x data-parallel size; a
    partial last one is left out) and the stream starts the next pass from the first sample, so a resumed run starts
    `consumed_samples` modulo one pass into a pass, and a set shorter than its evaluations need is read again instead
    of running out. A `cyclic` loader is endless and places `consumed_samples` in its epochs itself.
    """
    if dataloader_type != "single":
        return endless(make_loader(dataset, consumed_samples))
    loader = make_loader(dataset, 0)
    sampler = loader.batch_sampler
    samples_per_pass = len(dataset) - len(dataset) % sampler.global_micro_batch_size
    if samples_per_pass == 0:
        raise ValueError(f"the {name} holds {len(dataset)} samples, fewer than one micro-batch for every "
                         f"data-parallel rank ({sampler.micro_batch_size} x {sampler.data_parallel_size}): give it "
                         "more data (--split, or the split's own --*-data-path) or use a smaller --micro-batch-size")
    into_pass = consumed_samples % samples_per_pass
    return _passes(loader, make_loader(dataset, into_pass) if into_pass else None)


def _passes(loader, first_pass):
    if first_pass is not None:
        yield from first_pass
        del first_pass  # its worker processes (--num-workers) end with it
    yield from endless(loader)


@dataclasses.dataclass
class ValidationSet:
    """One validation set: `label` None for the single default set (logged as plain "validation").

    Either `stream` (evaluations continue where the previous one stopped) or `loader` (--full-validation: each
    evaluation is a new pass over it) is set.
    """

    label: Optional[str]
    stream: Optional[Iterator] = None
    loader: Any = None

    def next_evaluation(self, eval_iters, global_batch_size):
        """(iterator, number of global batches) of the next evaluation."""
        if self.loader is None:
            return self.stream, eval_iters
        return iter(self.loader), len(self.loader.dataset) // global_batch_size


def as_validation_sets(valid):
    """What `build_data_iterators` returned for validation, as a list of `ValidationSet` (empty: none).

    A plain iterator (the default, or a provider's own under --dataloader-type external) is the one default set.
    """
    if valid is None:
        return []
    if isinstance(valid, list):
        return valid
    return [ValidationSet(None, stream=valid)]


def _source_path(dataset):
    """The prefix of a GPT dataset's indexed files, the JSON-lines file of an SFT dataset, else ""."""
    return (getattr(getattr(dataset, "indexed_dataset", None), "path_prefix", "")
            or getattr(dataset, "dataset_path", "") or "")


def set_labels(datasets):
    """The file name of each dataset's prefix or file (its position when it has none), made unique by position."""
    names = [os.path.basename(_source_path(dataset)) or str(position) for position, dataset in enumerate(datasets)]
    if len(set(names)) < len(names):
        names = [f"{position}:{name}" for position, name in enumerate(names)]
    return names


def build_validation_sets(valid_split, make_loader, consumed_samples, args):
    """[ValidationSet] for --full-validation and --multiple-validation-sets, or None without a validation split.

    `valid_split` is what the datasets provider returned for validation (a list of datasets with
    --multiple-validation-sets); `make_loader(dataset, consumed_samples[, dataloader_type])` builds this
    rank's data loader (of --dataloader-type by default). `consumed_samples` are the samples earlier
    evaluations took from each streamed set.
    """
    if args.multiple_validation_sets and valid_split is not None and not isinstance(valid_split, list):
        raise ValueError("--multiple-validation-sets: the datasets provider returned one validation dataset, not one "
                         "per validation prefix; build its GPTDatasetConfig with megatron.training.datasets."
                         "gpt_dataset_config.gpt_dataset_config_from_args(args, tokenizer)")
    datasets = valid_split if isinstance(valid_split, list) else [valid_split]
    labels = set_labels(datasets) if args.multiple_validation_sets else [None]
    sets = []
    for label, dataset in zip(labels, datasets):
        if dataset is None or len(dataset) == 0:
            continue
        if args.full_validation:
            _report_full_size(label, len(dataset), args.global_batch_size)
            sets.append(ValidationSet(label, loader=make_loader(dataset, 0, "single")))
        else:
            sets.append(ValidationSet(label, stream=evaluation_stream(dataset, make_loader, consumed_samples,
                                                                      getattr(args, "dataloader_type", "single"))))
    return sets or None


def _report_full_size(label, num_samples, global_batch_size):
    name = "the validation set" if label is None else f"validation set {label}"
    if num_samples < global_batch_size:
        raise ValueError(f"--full-validation: {name} holds {num_samples} samples, less than one global batch "
                         f"(--global-batch-size {global_batch_size}); give it more data or a smaller batch")
    if dist.is_initialized() and dist.get_rank() == 0:
        batches, left_out = divmod(num_samples, global_batch_size)
        print(f"--full-validation: {name} holds {num_samples} samples: {batches} global batches of "
              f"{global_batch_size} per evaluation ({left_out} samples of a partial batch left out)", flush=True)
