"""The post-training programs' result lines name the number of validation batches in plain English."""

from examples.post_training.model_and_data import global_batches_phrase


def test_one_batch_is_singular_and_others_plural():
    assert global_batches_phrase(1) == "1 global batch"
    assert global_batches_phrase(8) == "8 global batches"
    assert global_batches_phrase(0) == "0 global batches"
