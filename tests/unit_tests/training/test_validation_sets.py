"""--full-validation and --multiple-validation-sets in `pretrain()`, on one rank, with small on-disk datasets.

Full validation evaluates every complete global batch of the validation set (counted here from the documents
written), the same samples at every evaluation, with the loss of an --eval-iters run over as many batches;
multiple validation sets give one loss per set (its own log line and metrics record), each equal to the loss of
a run with that set alone as --valid-data-path.
"""

import contextlib
import io
import json

import pytest

from megatron.core.datasets.gpt_indices import samples_in_tokens
from tests.unit_tests.datasets.gpt_test_data import VOCAB_SIZE, write_documents
from tests.unit_tests.multiprocess_harness import run_on_ranks

SEQ, MICRO, GLOBAL = 16, 2, 4
TINY_GPT = (
    f"--num-layers 1 --hidden-size 16 --num-attention-heads 2 --seq-length {SEQ} --micro-batch-size {MICRO} "
    f"--global-batch-size {GLOBAL} --lr 1e-3 --tokenizer-type NullTokenizer --vocab-size {VOCAB_SIZE} "
    "--make-vocab-size-divisible-by 4 --hidden-dropout 0 --attention-dropout 0 --num-workers 0 --log-interval 1 "
    "--ckpt-format torch"
)


def _write_datasets(workdir):
    """Prefixes of the training set and of validation sets b and c, and the samples each validation set holds."""
    prefixes, sizes = {}, {}
    for seed, (name, num_documents) in enumerate((("a", 60), ("b", 13), ("c", 9))):
        prefixes[name] = f"{workdir}/{name}_text_document"
        documents = write_documents(prefixes[name], num_documents, seed=seed)
        sizes[name] = samples_in_tokens(sum(len(document) for document in documents), SEQ)
    return prefixes, sizes


def _pretrain(workdir, name, flags):
    """One run; returns (metrics records of evaluations, printed evaluation lines, tokens of each evaluated
    microbatch in order)."""
    import pretrain_gpt
    from megatron.core.enums import ModelType
    from megatron.training.training import pretrain

    evaluated = []

    def forward_step(data_iterator, model):
        if model.training:
            return pretrain_gpt.forward_step(data_iterator, model)
        batch = next(data_iterator)
        evaluated.append(batch["tokens"].clone())
        return pretrain_gpt.forward_step(iter([batch]), model)

    metrics_file = f"{workdir}/{name}.jsonl"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        pretrain(pretrain_gpt.train_valid_test_datasets_provider, pretrain_gpt.model_provider,
                 ModelType.encoder_or_decoder, forward_step,
                 argv=f"{TINY_GPT} {flags} --metrics-file {metrics_file}".split())
    records = [json.loads(line) for line in open(metrics_file)]
    lines = [line for line in printed.getvalue().splitlines() if " loss at iteration " in line]
    evaluations = [record for record in records if record["split"] != "train"]
    # (the evaluations during training, the lines, the batches, the evaluations after the last iteration or of
    # --skip-train)
    return ([record for record in evaluations if "when" not in record], lines, evaluated,
            [record for record in evaluations if "when" in record])


def _full_validation_runs(workdir):
    prefixes, sizes = _write_datasets(workdir)
    data = f"--train-data-path {prefixes['a']} --valid-data-path {prefixes['b']}"
    batches = sizes["b"] // GLOBAL
    return {
        "sizes": sizes,
        "trained": _pretrain(workdir, "trained", f"{data} --full-validation --train-iters 2 --eval-interval 1 "
                             "--eval-iters 1"),
        "full": _pretrain(workdir, "full", f"{data} --full-validation --skip-train --train-iters 2"),
        # One evaluation's worth of samples (--eval-interval past --train-iters): the first `batches` global
        # batches of the same one-epoch dataset, i.e. the samples full validation evaluates.
        "eval_iters": _pretrain(workdir, "eval_iters", f"{data} --skip-train --train-iters 2 --eval-interval 3 "
                                f"--eval-iters {batches}"),
    }


def test_full_validation_evaluates_every_complete_global_batch(tmp_path):
    runs = run_on_ranks(1, _full_validation_runs, str(tmp_path))[0]
    size = runs["sizes"]["b"]
    assert size % GLOBAL, "the set should end with a partial global batch, which is left out"
    microbatches = (size // GLOBAL) * (GLOBAL // MICRO)

    records, lines, evaluated, (at_the_end,) = runs["trained"]
    assert [record["iteration"] for record in records] == [1, 2]
    assert len(evaluated) == 3 * microbatches  # iterations 1 and 2, and after the last iteration
    first, second, third = (evaluated[i * microbatches:(i + 1) * microbatches] for i in range(3))
    assert all((a == b).all() and (a == c).all() for a, b, c in zip(first, second, third))  # the same samples
    assert len({tuple(tokens.flatten().tolist()) for tokens in first}) == microbatches  # no sample twice
    assert [line.split(" | ")[0] for line in lines] == ["validation loss at iteration 1",
                                                        "validation loss at iteration 2",
                                                        "validation loss at iteration 2 on validation set"]
    # The same samples and the same model as iteration 2's evaluation: the same loss.
    assert (at_the_end["iteration"], at_the_end["when"]) == (2, "on validation set")
    assert at_the_end["lm loss"] == records[1]["lm loss"]

    # --skip-train evaluations are logged "on validation set", as upstream (records with "when").
    _, _, full_evaluated, (full,) = runs["full"]
    _, _, eval_iters_evaluated, (by_eval_iters,) = runs["eval_iters"]
    assert len(full_evaluated) == len(eval_iters_evaluated) == microbatches
    assert all((a == b).all() for a, b in zip(full_evaluated, eval_iters_evaluated))
    assert full["lm loss"] == pytest.approx(by_eval_iters["lm loss"], rel=1e-12)
    assert "validation-set" not in full


def _multiple_validation_sets_runs(workdir):
    prefixes, _ = _write_datasets(workdir)
    common = f"--train-data-path {prefixes['a']} --train-iters 1 --eval-interval 1 --eval-iters 2"
    return {
        "both": _pretrain(workdir, "both", f"{common} --valid-data-path {prefixes['b']} {prefixes['c']} "
                          "--multiple-validation-sets"),
        "b": _pretrain(workdir, "b", f"{common} --valid-data-path {prefixes['b']}"),
        "c": _pretrain(workdir, "c", f"{common} --valid-data-path {prefixes['c']}"),
        "both_full": _pretrain(workdir, "both_full", f"{common} --valid-data-path {prefixes['b']} {prefixes['c']} "
                               "--multiple-validation-sets --full-validation --skip-train"),
        "c_full": _pretrain(workdir, "c_full", f"{common} --valid-data-path {prefixes['c']} --full-validation "
                            "--skip-train"),
    }


def test_multiple_validation_sets_give_each_set_its_own_loss(tmp_path):
    runs = run_on_ranks(1, _multiple_validation_sets_runs, str(tmp_path))[0]
    records, lines, _, ends = runs["both"]
    assert [(record["iteration"], record["split"], record["validation-set"]) for record in records] == [
        (1, "validation", "b_text_document"), (1, "validation", "c_text_document")]
    assert [line.split(" | ")[0] for line in lines] == [
        "validation (b_text_document) loss at iteration 1", "validation (c_text_document) loss at iteration 1",
        "validation (b_text_document) loss at iteration 1 on validation set",
        "validation (c_text_document) loss at iteration 1 on validation set"]
    for record, end in zip(records, ends):
        (alone,), _, _, (alone_end,) = runs[record["validation-set"][0]]
        assert record["lm loss"] == pytest.approx(alone["lm loss"], rel=1e-12)
        assert end["validation-set"] == record["validation-set"]
        assert end["lm loss"] == pytest.approx(alone_end["lm loss"], rel=1e-12)
    assert records[0]["lm loss"] != records[1]["lm loss"]

    # With --full-validation as well: each set is evaluated whole, as it would be alone.
    _, _, _, full_records = runs["both_full"]
    _, _, _, (c_alone,) = runs["c_full"]
    assert [record["validation-set"] for record in full_records] == ["b_text_document", "c_text_document"]
    assert full_records[1]["lm loss"] == pytest.approx(c_alone["lm loss"], rel=1e-12)
