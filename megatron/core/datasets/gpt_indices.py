"""The three index arrays behind a packed GPT dataset (pure numpy, no torch).

- document index: the order in which documents are concatenated, one shuffled copy of the split's
  documents per epoch;
- sample index: `[num_samples + 1, 2]` rows of (position in the document index, token offset) marking where
  sample i starts; sample i runs through the start of sample i + 1 inclusive, i.e. `sequence_length + 1`
  tokens, so consecutive samples share one token (inputs are `[:-1]`, labels `[1:]`);
- shuffle index: the order in which samples are served: every sample of the epochs built, so a dataset holds
  all the samples its epochs make (at least the number asked for), as Megatron-Core's does.

When more than one epoch is needed and the last one is mostly unused, that last epoch is shuffled on its
own, so the served samples are whole earlier epochs plus a sample of the last one, not a blur of all.
"""

import numpy as np

# Below this fraction of a final epoch in use, the final epoch is shuffled separately.
SEPARATE_FINAL_EPOCH_THRESHOLD = 0.8


def samples_in_tokens(num_tokens, sequence_length):
    """How many `sequence_length + 1`-token windows (overlapping by one) fit in `num_tokens` tokens."""
    return max(0, (num_tokens - 1) // sequence_length)


def num_epochs_needed(tokens_per_epoch, sequence_length, num_samples):
    if tokens_per_epoch <= 0:
        raise ValueError("the dataset split has no tokens; check --data-path and --split")
    epochs = 1
    while samples_in_tokens(epochs * tokens_per_epoch, sequence_length) < num_samples:
        epochs += 1
    return epochs


def separate_final_epoch(tokens_per_epoch, sequence_length, num_samples, num_epochs):
    if num_epochs == 1:
        return False
    samples_before_final = samples_in_tokens((num_epochs - 1) * tokens_per_epoch, sequence_length)
    samples_per_epoch = samples_in_tokens(tokens_per_epoch, sequence_length)
    used_of_final = num_samples - samples_before_final
    # Whole samples, as Megatron-Core counts them: with 7 samples an epoch the cut is 5, not 5.6.
    return used_of_final < int(SEPARATE_FINAL_EPOCH_THRESHOLD * samples_per_epoch)


def build_document_index(documents, num_epochs, rng, separate_final):
    """Documents repeated `num_epochs` times and shuffled (the last epoch separately if asked)."""
    documents = np.asarray(documents, dtype=np.int64)
    if separate_final and num_epochs > 1:
        earlier = build_document_index(documents, num_epochs - 1, rng, False)
        final = build_document_index(documents, 1, rng, False)
        return np.concatenate([earlier, final])
    document_index = np.tile(documents, num_epochs)
    rng.shuffle(document_index)
    return document_index


def build_sample_index(lengths_in_order, sequence_length, num_samples):
    """Start (document position, offset) of samples 0..num_samples; `lengths_in_order[k]` is the length of
    the k-th document of the document index."""
    ends = np.cumsum(np.asarray(lengths_in_order, dtype=np.int64))
    total_tokens = int(ends[-1]) if ends.size else 0
    if samples_in_tokens(total_tokens, sequence_length) < num_samples:
        raise ValueError(f"{total_tokens} tokens cannot hold {num_samples} samples of {sequence_length} + 1 tokens")
    starts = np.arange(num_samples + 1, dtype=np.int64) * sequence_length
    positions = np.searchsorted(ends, starts, side="right")  # skips empty documents
    document_starts = ends[positions] - np.asarray(lengths_in_order, dtype=np.int64)[positions]
    sample_index = np.empty((num_samples + 1, 2), dtype=np.int64)
    sample_index[:, 0] = positions
    sample_index[:, 1] = starts - document_starts
    return sample_index


def build_shuffle_index(num_samples, num_samples_before_final, rng):
    """A permutation of range(num_samples); samples from `num_samples_before_final` on are shuffled apart."""
    first = np.arange(min(num_samples_before_final, num_samples), dtype=np.int64)
    rest = np.arange(first.size, num_samples, dtype=np.int64)
    rng.shuffle(first)
    rng.shuffle(rest)
    return np.concatenate([first, rest])


def build_gpt_indices(sequence_lengths, documents, sequence_length, num_samples, seed):
    """{document_index, sample_index, shuffle_index} for at least `num_samples` samples (None: one epoch) drawn
    from `documents` (indices into `sequence_lengths`), with a `RandomState(seed)` driving every shuffle.

    The epochs needed for `num_samples` are built whole: the shuffle index orders every sample they hold, not only
    the first `num_samples` (the dataset's length, and so the epochs of `--dataloader-type cyclic`, are upstream's).
    """
    sequence_lengths = np.asarray(sequence_lengths, dtype=np.int64)
    documents = np.asarray(documents, dtype=np.int64)
    tokens_per_epoch = int(sequence_lengths[documents].sum())
    if num_samples is None:
        num_samples = samples_in_tokens(tokens_per_epoch, sequence_length)
    if num_samples <= 0:
        raise ValueError(
            f"the split's {tokens_per_epoch} tokens do not fill one sample of --seq-length {sequence_length} + 1"
        )
    num_epochs = num_epochs_needed(tokens_per_epoch, sequence_length, num_samples)
    separate = separate_final_epoch(tokens_per_epoch, sequence_length, num_samples, num_epochs)
    rng = np.random.RandomState(seed)
    document_index = build_document_index(documents, num_epochs, rng, separate)
    total_samples = samples_in_tokens(num_epochs * tokens_per_epoch, sequence_length)
    sample_index = build_sample_index(sequence_lengths[document_index], sequence_length, total_samples)
    if separate:
        before_final = samples_in_tokens((num_epochs - 1) * tokens_per_epoch, sequence_length)
    else:
        before_final = total_samples
    shuffle_index = build_shuffle_index(total_samples, before_final, rng)
    return {"document_index": document_index, "sample_index": sample_index, "shuffle_index": shuffle_index}
