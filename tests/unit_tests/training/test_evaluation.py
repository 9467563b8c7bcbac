"""Evaluation (evaluation.py): every evaluation batch is a full --global-batch-size batch, also during a
--rampup-batch-size ramp, and the validation and test datasets are built for exactly the samples the run's
evaluations read."""

import pytest

from tests.unit_tests.multiprocess_harness import run_on_ranks

# One rank, micro batch 1: a global batch of N samples is N microbatches. The ramp runs batches of 2 until 8
# samples are consumed (iterations 1-4), then of 4 (iteration 5: 12 --train-samples in all).
RAMPUP_RUN = ("--num-layers 1 --hidden-size 16 --num-attention-heads 2 --seq-length 16 --micro-batch-size 1 "
              "--global-batch-size 4 --rampup-batch-size 2 2 8 --train-samples 12 --lr 1e-3 --mock-data "
              "--vocab-size 128 --make-vocab-size-divisible-by 4 --hidden-dropout 0 --attention-dropout 0 "
              "--num-workers 0 --log-interval 1 --eval-interval 2 --eval-iters 3")


def _pretrain_recording_evaluations():
    """(the provider's [train, valid, test] sample counts, the samples each evaluation read in order, the
    global batch size of each training iteration)."""
    import pretrain_gpt
    from megatron.core.enums import ModelType
    from megatron.core.num_microbatches_calculator import get_current_running_global_batch_size
    from megatron.training.training import pretrain

    sample_counts, evaluations, training_calls = [], [], []
    last = {"iterator": None, "training": True}

    def provider(counts):
        sample_counts.append(list(counts))
        return pretrain_gpt.train_valid_test_datasets_provider(counts)

    def forward_step(data_iterator, model):
        if model.training:
            training_calls.append(get_current_running_global_batch_size())
        elif last["training"] or data_iterator is not last["iterator"]:
            evaluations.append(0)  # a new evaluation (or the test set right after the last validation)
        if not model.training:
            evaluations[-1] += 1
        last.update(iterator=data_iterator, training=model.training)
        return pretrain_gpt.forward_step(data_iterator, model)

    pretrain(provider, pretrain_gpt.model_provider, ModelType.encoder_or_decoder, forward_step,
             argv=RAMPUP_RUN.split())
    training_batches = []  # one microbatch of one sample per call: a batch of N samples is N calls
    while training_calls:
        training_batches.append(training_calls[0])
        del training_calls[:training_calls[0]]
    return sample_counts, evaluations, training_batches


def test_evaluations_during_a_batch_size_ramp_read_full_global_batches():
    [(sample_counts, evaluations, training_batches)] = run_on_ranks(1, _pretrain_recording_evaluations)
    assert training_batches == [2, 2, 2, 2, 4]  # the ramp ran
    # Evaluations after iterations 2 and 4 (during the ramp), then the final one of the validation and of the test
    # set after iteration 5: --eval-iters 3 x --global-batch-size 4 samples each.
    assert evaluations == [12] * 4
    # The validation and test datasets hold exactly what the evaluations read: 3 evaluations of the validation
    # set, 1 of the test set.
    assert sample_counts == [[12, sum(evaluations[:3]), evaluations[3]]]


def test_evaluation_num_microbatches_ignores_the_ramp():
    import argparse

    from megatron.training.evaluation import evaluation_num_microbatches

    args = argparse.Namespace(global_batch_size=24, micro_batch_size=2, data_parallel_size=3)
    assert evaluation_num_microbatches(args) == 4


if __name__ == "__main__":
    pytest.main([__file__, "-q"])


def test_skip_train_without_validation_or_test_data_says_nothing_was_evaluated(monkeypatch, capsys):
    import argparse

    from megatron.training import evaluation

    monkeypatch.setattr(evaluation.dist, "get_rank", lambda: 0)
    args = argparse.Namespace(iteration=7, eval_iters=2, skip_train=True, global_batch_size=4)
    # No validation or test iterator (--split 100,0,0): nothing to run, so no model, config or logger is needed.
    assert evaluation.evaluate_without_training(None, None, None, None, None, None, args) == 7
    assert capsys.readouterr().out.splitlines() == [
        "--skip-train: evaluating at iteration 7 without training",
        "WARNING: --skip-train: there is no validation or test data to evaluate (see --split or --valid-data-path / "
        "--test-data-path), so nothing was evaluated"]
