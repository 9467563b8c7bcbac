"""pretrain(process_non_loss_data_func=..., non_loss_data_func=...): as upstream, each evaluation runs one more
global batch through the schedule with collect_non_loss_data=True and hands the last stage's per-microbatch
`loss_func(output, non_loss_data=True)` results, as they are, to the hook on the last rank with the iteration and
the TensorBoard writer; `non_loss_data_func(model)` replaces that batch."""

import argparse
import contextlib
import io

import pytest
import torch

from tests.unit_tests.datasets.gpt_test_data import VOCAB_SIZE, write_documents
from tests.unit_tests.multiprocess_harness import run_on_ranks

TINY_GPT = (
    "--num-layers 2 --hidden-size 32 --num-attention-heads 2 --seq-length 16 --micro-batch-size 2 "
    "--global-batch-size 4 --lr 1e-3 --mock-data --vocab-size 127 --make-vocab-size-divisible-by 64 "
    "--hidden-dropout 0 --attention-dropout 0 --num-workers 0 --log-interval 1 --train-iters 4 --eval-interval 2 "
    "--eval-iters 1"
)


def _pretrain_with_non_loss_data_hook(tensorboard_dir, extra_flags):
    import pretrain_gpt
    from megatron.core import parallel_state
    from megatron.core.enums import ModelType
    from megatron.training import training

    rank = torch.distributed.get_rank()
    returned = []  # what loss_func returned for non_loss_data=True on this rank, in order
    recomputation_errors = []
    hook_calls = []

    def forward_step(data_iterator, model):
        batch = pretrain_gpt.get_batch(data_iterator)
        output = model(batch["tokens"], batch["position_ids"], attention_mask=batch.get("attention_mask"),
                       labels=batch["labels"])
        loss = pretrain_gpt.loss_func

        def loss_func(output_tensor, non_loss_data=False):
            if not non_loss_data:
                return loss(batch["loss_mask"], output_tensor)
            assert not torch.is_grad_enabled() and not model.training  # evaluation: no gradients, eval mode
            if parallel_state.get_pipeline_model_parallel_world_size() == 1:
                # The whole model is here: the data is this microbatch's per-token loss, not reduced.
                again = model(batch["tokens"], batch["position_ids"], attention_mask=batch.get("attention_mask"),
                              labels=batch["labels"])
                recomputation_errors.append((again - output_tensor).abs().max().item())
            data = {"per_token_loss": output_tensor, "tokens": batch["tokens"]}
            returned.append(data)
            return data

        return output, loss_func

    def process_non_loss_data(collected, iteration, writer):
        hook_calls.append({
            "iteration": iteration,
            "same_objects": [id(item) for item in collected] == [id(item) for item in returned[-len(collected):]],
            "shapes": [tuple(item["per_token_loss"].shape) for item in collected],
            "writer_dir": writer.log_dir,
        })

    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        iteration = training.pretrain(
            pretrain_gpt.train_valid_test_datasets_provider, pretrain_gpt.model_provider, ModelType.encoder_or_decoder,
            forward_step, process_non_loss_data_func=process_non_loss_data,
            argv=f"{TINY_GPT} {extra_flags} --tensorboard-dir {tensorboard_dir}".split())
    return {"rank": rank, "iteration": iteration, "returned": len(returned), "hook_calls": hook_calls,
            "recomputation_errors": recomputation_errors,
            "validation_lines": stdout.getvalue().count("validation loss")}


def _expected_hook_calls(tensorboard_dir, num_microbatches):
    # Evaluations at iterations 2 and 4, then the validation and test sets after the last iteration.
    return [{"iteration": iteration, "same_objects": True, "shapes": [(2, 16)] * num_microbatches,
             "writer_dir": tensorboard_dir} for iteration in (2, 4, 4, 4)]


def test_one_rank_hook_receives_the_per_microbatch_outputs(tmp_path):
    (result,) = run_on_ranks(1, _pretrain_with_non_loss_data_hook, str(tmp_path / "tb"), "")
    assert result["iteration"] == 4 and result["validation_lines"] == 4
    assert result["hook_calls"] == _expected_hook_calls(str(tmp_path / "tb"), num_microbatches=2)
    assert result["returned"] == 8 and max(result["recomputation_errors"]) < 1e-6


@pytest.mark.parametrize("world_size", [2])
def test_two_pipeline_stages_hand_the_last_stages_outputs_to_the_last_rank(tmp_path, world_size):
    first, last = run_on_ranks(world_size, _pretrain_with_non_loss_data_hook, str(tmp_path / "tb"),
                               "--pipeline-model-parallel-size 2")
    assert first["iteration"] == last["iteration"] == 4
    assert first["hook_calls"] == [] and first["returned"] == 0  # the first stage computes no loss_func
    assert last["hook_calls"] == _expected_hook_calls(str(tmp_path / "tb"), num_microbatches=2)
    assert last["returned"] == 8


def test_non_loss_data_func_replaces_the_collecting_batch(monkeypatch):
    from megatron.training import evaluation, training
    from megatron.training.non_loss_data import NonLossDataHooks

    schedule_calls = []

    def run_schedule(forward_step_func, data_iterator, model, args, forward_only, collect_non_loss_data=False,
                     num_microbatches=None):
        schedule_calls.append(collect_non_loss_data)
        if collect_non_loss_data:
            return [{"collected": index} for index in range(2)]
        return [{"lm loss": torch.tensor([3.0, 1.0])}]

    monkeypatch.setattr(evaluation, "run_schedule", run_schedule)
    monkeypatch.setattr(evaluation, "reduce_reported_loss", lambda reports, device: training._loss_sums(reports,
                                                                                                        device))
    monkeypatch.setattr(evaluation, "pause_result_validation", lambda: None)
    monkeypatch.setattr(evaluation, "resume_result_validation", lambda mode: None)
    model = [torch.nn.Linear(2, 2)]
    args = argparse.Namespace(eval_iters=2, device=torch.device("cpu"), empty_unused_memory_level=0,
                              global_batch_size=4, micro_batch_size=1, data_parallel_size=2)
    losses, collected = training._evaluate(None, None, model, args, non_loss_data=NonLossDataHooks(
        process_non_loss_data_func=print))
    assert schedule_calls == [False, False, True] and collected == [{"collected": 0}, {"collected": 1}]
    assert torch.equal(losses["lm loss"], torch.tensor([6.0, 2.0], dtype=torch.float64))

    schedule_calls.clear()
    seen_training_mode = []

    def non_loss_data_func(chunks):
        seen_training_mode.append([chunk.training for chunk in chunks])
        return "from the model"

    _, collected = training._evaluate(None, None, model, args, non_loss_data=NonLossDataHooks(
        process_non_loss_data_func=print, non_loss_data_func=non_loss_data_func))
    assert schedule_calls == [False, False] and collected == "from the model" and seen_training_mode == [[False]]
    assert training.evaluate(None, None, model, None, args)["lm loss"].tolist() == [6.0, 2.0]  # losses only
    with pytest.raises(TypeError, match=r"pretrain\(non_loss_data_func=...\) must be a function or None, got str"):
        NonLossDataHooks(non_loss_data_func="plot")


def _pretrain_full_validation_with_hooks(workdir, hooks):
    import pretrain_gpt
    from megatron.core.enums import ModelType
    from megatron.training import training

    built = []

    def model_provider(*args, **kwargs):
        built.append("model")
        return pretrain_gpt.model_provider(*args, **kwargs)

    def non_loss_data_func(model):
        return "from the model"

    hook_functions = {"process": {"process_non_loss_data_func": lambda collected, iteration, writer: None},
                      "both": {"process_non_loss_data_func": lambda collected, iteration, writer: None,
                               "non_loss_data_func": non_loss_data_func}}[hooks]
    data = (f"--train-data-path {workdir}/train_text_document --valid-data-path {workdir}/valid_text_document "
            f"--tokenizer-type NullTokenizer --vocab-size {VOCAB_SIZE} --make-vocab-size-divisible-by 4")
    flags = TINY_GPT.replace("--mock-data --vocab-size 127 --make-vocab-size-divisible-by 64", data)
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            iteration = training.pretrain(pretrain_gpt.train_valid_test_datasets_provider, model_provider,
                                          ModelType.encoder_or_decoder, pretrain_gpt.forward_step,
                                          argv=f"{flags} --full-validation".split(), **hook_functions)
    except ValueError as error:
        return {"error": str(error), "built": built}
    return {"iteration": iteration, "built": built}


def test_full_validation_refuses_a_collecting_batch_before_training(tmp_path):
    """--full-validation reads each validation set to its end, so the collecting batch would have no data: the
    combination stops before the model is built, naming both; with non_loss_data_func (no batch needed) it runs."""
    write_documents(str(tmp_path / "train_text_document"), 40, seed=0)
    write_documents(str(tmp_path / "valid_text_document"), 20, seed=1)
    (refused,) = run_on_ranks(1, _pretrain_full_validation_with_hooks, str(tmp_path), "process")
    assert refused["built"] == []
    assert "pretrain(process_non_loss_data_func=...) cannot be used with --full-validation" in refused["error"]
    assert "non_loss_data_func=" in refused["error"].split("--full-validation", 1)[1]
    (ran,) = run_on_ranks(1, _pretrain_full_validation_with_hooks, str(tmp_path), "both")
    assert ran == {"iteration": 4, "built": ["model"]}
