"""Upstream logging, profiling and run-control flags in `pretrain()` on 2 ranks, one shared run:

--iterations-to-skip drops a step's batch (drawn, not trained on: no forward, no optimizer step, the weights
unchanged, consumed samples still counted); --profile --use-pytorch-profiler writes a trace of exactly the
profiled steps on each listed rank; the TensorBoard switches choose the scalars, and a fake `wandb` receives the
same ones (equal to the metrics file); --log-progress writes progress.txt. A second run loads the last checkpoint
with --skip-train: it evaluates on the validation and test sets without training.
"""

import glob
import json
import os
import sys
import types

import torch

from tests.unit_tests.multiprocess_harness import run_on_ranks

TINY_GPT = (
    "--num-layers 2 --hidden-size 32 --num-attention-heads 2 --seq-length 16 --micro-batch-size 2 "
    "--global-batch-size 8 --lr 1e-3 --mock-data --vocab-size 127 --make-vocab-size-divisible-by 64 "
    "--hidden-dropout 0 --attention-dropout 0 --num-workers 0 --log-interval 1 --ckpt-format torch"
)
SKIPPED = 1  # completed iterations before the skipped step: the log's iteration 2 is dropped
TRAIN_ITERS = 5


def _fake_wandb():
    """A `wandb` module that records init() and every run.log() call."""
    calls = {"init": [], "log": [], "finished": 0}

    class Run:
        def log(self, values, step=None):
            calls["log"].append((step, dict(values)))

        def finish(self):
            calls["finished"] += 1

    def init(**kwargs):
        calls["init"].append({key: value for key, value in kwargs.items() if key != "config"})
        return Run()

    module = types.ModuleType("wandb")
    module.init = init
    return module, calls


def _train_then_evaluate_only(workdir):
    import pretrain_gpt
    from megatron.core.enums import ModelType
    from megatron.core.rerun_state_machine import get_rerun_state_machine
    from megatron.training import training
    from megatron.training.global_vars import get_args

    wandb, wandb_calls = _fake_wandb()
    sys.modules["wandb"] = wandb
    draws, forwards, weight_sums = [], [], {}
    real_build = training.build_data_iterators

    def counting_data_iterators(provider, args):
        train_iterator, valid_iterator, test_iterator = real_build(provider, args)

        def counted(iterator):
            for batch in iterator:
                draws.append(get_rerun_state_machine().current_iteration)
                yield batch

        return counted(train_iterator), valid_iterator, test_iterator

    def forward_step(data_iterator, model):
        iteration = get_rerun_state_machine().current_iteration
        if model.training:
            forwards.append(iteration)
            weight_sums.setdefault(iteration, _weight_sum(model.state_dict()))
        return pretrain_gpt.forward_step(data_iterator, model)

    def run(argv):
        return training.pretrain(pretrain_gpt.train_valid_test_datasets_provider, pretrain_gpt.model_provider,
                                 ModelType.encoder_or_decoder, forward_step, argv=argv.split())

    training.build_data_iterators = counting_data_iterators
    try:
        trained_to = run(
            f"{TINY_GPT} --train-iters {TRAIN_ITERS} --eval-interval 100 --eval-iters 1 --save {workdir}/ckpt "
            f"--save-interval 1 --tensorboard-dir {workdir}/tb --iterations-to-skip {SKIPPED} --profile "
            "--use-pytorch-profiler --profile-step-start 2 --profile-step-end 4 --profile-ranks 0 1 --log-progress "
            "--log-batch-size-to-tensorboard --log-world-size-to-tensorboard --no-log-loss-scale-to-tensorboard "
            "--wandb-project proj --wandb-exp-name exp")
        train_draws, train_forwards = list(draws), list(forwards)
        skipped_after_training = get_args().skipped_train_samples
        evaluated_at = run(f"{TINY_GPT} --train-iters {TRAIN_ITERS} --eval-iters 1 --save {workdir}/ckpt --load "
                           f"{workdir}/ckpt --skip-train --log-progress --metrics-file {workdir}/skip_train.jsonl "
                           f"--tensorboard-dir {workdir}/tb_skip_train")
        skipped_after_load = get_args().skipped_train_samples
    finally:
        training.build_data_iterators = real_build
        del sys.modules["wandb"]
    return {"trained_to": trained_to, "evaluated_at": evaluated_at, "draws": train_draws,
            "forwards": train_forwards, "evaluate_only_forwards": forwards[len(train_forwards):],
            "weight_sums": weight_sums, "wandb": wandb_calls,
            "skipped_samples": (skipped_after_training, skipped_after_load)}


def _scalars_in_tensorboard(directory):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(directory)
    accumulator.Reload()
    return {tag: {event.step: event.value for event in accumulator.Scalars(tag)}
            for tag in accumulator.Tags()["scalars"]}


def _weight_sum(state_dict):
    return sum(value.double().sum().item() for value in state_dict.values()
               if torch.is_tensor(value) and value.is_floating_point())


def _saved_weight_sum(workdir, iteration):
    state = torch.load(os.path.join(workdir, "ckpt", f"iter_{iteration:07d}", "mp_rank_00", "model_optim_rng.pt"),
                       weights_only=False)
    return state, _weight_sum(state["model"])


def test_skipped_iterations_profiler_scalars_progress_and_skip_train(tmp_path):
    results = run_on_ranks(2, _train_then_evaluate_only, str(tmp_path))
    for rank, result in enumerate(results):
        assert result["trained_to"] == result["evaluated_at"] == TRAIN_ITERS
        # 2 microbatches per rank and step: the skipped step (the log's iteration 2) drew its two and ran none.
        assert result["draws"] == [1, 1, 2, 2, 3, 3, 4, 4, 5, 5]
        assert result["forwards"] == [1, 1, 3, 3, 4, 4, 5, 5]
        # --skip-train ran the validation and the test batch only (forward-only, no training forward).
        assert result["evaluate_only_forwards"] == []
        # The dropped global batch counts as skipped samples, saved with the checkpoint and loaded back.
        assert result["skipped_samples"] == (8, 8)

    # Unchanged weights: the step after the skip starts from the weights saved after iteration 1 (no checkpoint
    # at the skipped iteration 2, as upstream skips everything but the data), and only 4 optimizer steps ran.
    assert sorted(name for name in os.listdir(tmp_path / "ckpt") if name.startswith("iter_")) == [
        "iter_0000001", "iter_0000003", "iter_0000004", "iter_0000005"]
    _, weights_after_1 = _saved_weight_sum(tmp_path, 1)
    assert abs(results[0]["weight_sums"][3] - weights_after_1) < 1e-9 * max(1.0, abs(weights_after_1))
    final_state, _ = _saved_weight_sum(tmp_path, TRAIN_ITERS)
    assert final_state["opt_param_scheduler"]["num_steps"] == 4 * 8  # samples the scheduler stepped over
    assert final_state["consumed_train_samples"] == 40 and final_state["skipped_train_samples"] == 8

    records = [json.loads(line) for line in (tmp_path / "tb" / "metrics.jsonl").read_text().splitlines()]
    metrics = [record for record in records if record["split"] == "train"]
    assert [(record["iteration"], record["consumed-samples"]) for record in metrics] == [
        (1, 8), (3, 24), (4, 32), (5, 40)]
    # After the last iteration, as upstream: one more validation and a test evaluation.
    assert [(record["iteration"], record["split"], record["when"]) for record in records[len(metrics):]] == [
        (TRAIN_ITERS, "validation", "on validation set"), (TRAIN_ITERS, "test", "on test set")]

    # The profiler traced the steps after 2 and 3 completed iterations (the log's 3 and 4), on both ranks.
    for rank in (0, 1):
        traces = glob.glob(str(tmp_path / "tb" / f"rank{rank}.*.pt.trace.json"))
        assert len(traces) == 1, traces
        trace = json.load(open(traces[0]))
        names = {event.get("name") for event in trace["traceEvents"]}
        assert {"iteration 3", "iteration 4"} <= names and not {"iteration 1", "iteration 5"} & names
        assert "aten::mm" in names or "aten::addmm" in names
        assert any(name.startswith("ProfilerStep#") for name in names if name)

    # TensorBoard and W&B received the same scalars; the switches chose them; the values are the metrics file's.
    wandb = results[1]["wandb"]
    assert results[0]["wandb"]["init"] == []  # only the last rank logs
    assert wandb["init"] == [{"dir": str(tmp_path / "ckpt" / "wandb"), "name": "exp", "project": "proj"}]
    assert wandb["finished"] == 1
    sent = {}
    for step, values in wandb["log"]:
        for name, value in values.items():
            sent.setdefault(name, {})[step] = value
    tensorboard = _scalars_in_tensorboard(str(tmp_path / "tb"))
    assert set(sent) == set(tensorboard)
    assert {"lm loss", "learning-rate", "batch-size", "world-size", "grad-norm"} <= set(sent)
    assert "loss-scale" not in sent
    for record in metrics:
        step = record["iteration"]
        assert sent["lm loss"][step] == record["lm loss"]
        assert sent["learning-rate"][step] == record["learning-rate"]
        assert sent["grad-norm"][step] == record["grad norm"]
        assert sent["batch-size"][step] == 8 and sent["world-size"][step] == 2
        assert abs(tensorboard["lm loss"][step] - record["lm loss"]) < 1e-5 * record["lm loss"]
    assert set(sent["lm loss"]) == {1, 3, 4, 5}

    # --skip-train: one validation and one test evaluation at the loaded iteration, no new checkpoint.
    evaluations = [json.loads(line) for line in (tmp_path / "skip_train.jsonl").read_text().splitlines()]
    assert [(record["iteration"], record["split"], record["when"]) for record in evaluations] == [
        (TRAIN_ITERS, "validation", "on validation set"), (TRAIN_ITERS, "test", "on test set")]
    # As upstream, an evaluation-only run writes no evaluation scalars to TensorBoard.
    assert not [tag for tag in _scalars_in_tensorboard(str(tmp_path / "tb_skip_train")) if "validation" in tag
                or "test" in tag]
    assert all(0 < record["lm loss"] < 10 for record in evaluations)

    # progress.txt: both jobs, every checkpoint, consumed tokens and floating-point operations so far.
    lines = [line.split("\t") for line in (tmp_path / "ckpt" / "progress.txt").read_text().splitlines()]
    assert [(fields[3], fields[4]) for fields in lines] == [
        ("Starting job", "Iteration: 0"), ("Saved checkpoint", "Iteration: 1"), ("Saved checkpoint", "Iteration: 3"),
        ("Saved checkpoint", "Iteration: 4"), ("Saved checkpoint", "Iteration: 5"), ("Exiting job", "Iteration: 5"),
        ("Starting job", "Iteration: 5"), ("Exiting job", "Iteration: 5")]
    assert all(fields[2] == "# GPUs: 2" for fields in lines)
    last_save = dict(field.split(": ", 1) for field in lines[4][4:])
    assert last_save["Consumed samples"] == "40"
    assert float(last_save["Tokens (in billions)"]) == 40 * 16 / 1e9
    assert float(last_save["Floating-point operations"]) > 0
    assert last_save["Job throughput"].endswith(" TFLOP/s/GPU")
    assert last_save["Cumulative throughput"].endswith(" TFLOP/s/GPU")  # since the first start (one series)
    assert "Job throughput" not in dict(field.split(": ", 1) for field in lines[0][4:])
