"""`--dataloader-type external`: the provider's iterators are used as they are."""

import argparse

import pytest

from megatron.training.data_iterators import build_data_iterators

ARGS = argparse.Namespace(dataloader_type="external", train_iters=4, global_batch_size=8, eval_interval=2,
                          eval_iters=1)


def test_external_iterators_pass_through():
    train, valid = iter(range(3)), iter("ab")
    requested = []

    def provider(counts):
        requested.append(counts)
        return train, valid, None

    assert build_data_iterators(provider, ARGS) == (train, valid, None)
    assert requested == [[32, 24, 8]]  # the sample counts a provider sizes its data by


def test_external_needs_iterators_not_datasets():
    with pytest.raises(TypeError, match="--dataloader-type external: the datasets provider returned a list for "
                                        "train; .*iter\\(your_loader\\)"):
        build_data_iterators(lambda counts: ([1, 2], None, None), ARGS)


class _Numbers:
    def __init__(self, size):
        self.size = size

    def __len__(self):
        return self.size

    def __getitem__(self, index):
        return index


def test_a_single_pass_over_a_too_short_blend_stops_up_front():
    # Prefixes without weights blend one epoch of each dataset (as upstream): 10 samples cannot last 4 x 8.
    from megatron.core.datasets.blended_dataset import BlendedDataset

    blend = BlendedDataset([_Numbers(5), _Numbers(5)], [5, 5], 10)
    args = argparse.Namespace(**{**vars(ARGS), "dataloader_type": "single"})
    with pytest.raises(ValueError, match="the training blend holds 10 samples .* fewer than the 32 --train-iters"):
        build_data_iterators(lambda counts: (blend, None, None), args)
