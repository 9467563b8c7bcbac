"""The training log line, the throughput/memory numbers and the metrics file the functional tests read."""

import argparse
import json
import math
import re

import pytest
import torch

from megatron.training import training_log


def test_log_line_is_megatrons_format():
    line = training_log.format_log_line(
        iteration=10,
        train_iters=100,
        consumed_samples=320,
        elapsed_ms_per_iteration=123.44,
        learning_rate=1e-4,
        global_batch_size=32,
        losses={"lm loss": 10.3412},
        loss_scale=1.0,
        grad_norm=2.3454,
        num_zeros=0.0,
        skipped_iterations=0,
        nan_iterations=0,
    )
    assert line == (
        "iteration 10/ 100 | consumed samples: 320 | elapsed time per iteration (ms): 123.4 | learning rate: "
        "1.000000E-04 | global batch size: 32 | lm loss: 1.034E+01 | loss scale: 1.0 | grad norm: 2.345 | "
        "num zeros: 0.0 | number of skipped iterations: 0 | number of nan iterations: 0 |"
    )


def test_log_line_fields_follow_upstreams_order_and_formats():
    """Throughput and energy come right after the iteration time, every loss (MoE aux, MTP) with three decimals."""
    line = training_log.format_log_line(
        iteration=4, train_iters=8, consumed_samples=16, elapsed_ms_per_iteration=250.04, learning_rate=3e-4,
        global_batch_size=4, losses={"lm loss": 6.9412345, "load_balancing_loss": 1.00512, "mtp_1 loss": 6.95},
        loss_scale=65536.0, grad_norm=1.5, num_zeros=12.0, skipped_iterations=1, nan_iterations=0,
        params_norm=19.3416, throughput_tflops_per_gpu=123.456, energy=(200.04, 800.16))
    assert line.split(" | ") == [
        "iteration 4/ 8", "consumed samples: 16", "elapsed time per iteration (ms): 250.0",
        "throughput per GPU (TFLOP/s/GPU): 123.5", "energy per GPU (J/iter/GPU): 200.0",
        "power per GPU (W/GPU): 800.2", "learning rate: 3.000000E-04", "global batch size: 4",
        "lm loss: 6.941E+00", "load_balancing_loss: 1.005E+00", "mtp_1 loss: 6.950E+00",
        "loss scale: 65536.0", "grad norm: 1.500", "num zeros: 12.0", "params norm: 19.342",
        "number of skipped iterations: 1", "number of nan iterations: 0 |"]


def test_log_line_leaves_out_unknown_grad_stats():
    line = training_log.format_log_line(3, 5, 6, 1.0, 0.5, 2, {"lm loss": 1.0}, 65536.0, None, None, 1, 0)
    assert "grad norm" not in line and "num zeros" not in line
    assert line.endswith("loss scale: 65536.0 | number of skipped iterations: 1 | number of nan iterations: 0 |")


def _flops_args(**overrides):
    values = dict(hidden_size=64, num_layers=2, seq_length=16, kv_channels=16, num_attention_heads=4, swiglu=False,
                  ffn_hidden_size=256, padded_vocab_size=128)  # fmt: skip
    values.update(overrides)
    return argparse.Namespace(**values)


def test_flops_estimate_counts_every_matmul():
    h, s, f, v, layers, batch = 64, 16, 256, 128, 2, 3
    # Causal attention: the scores and the weighted sum multiply half of the s x s matrix, 2 * s * h in all.
    per_token = layers * (2 * h * 3 * h + 2 * h * h + 2 * s * h + 4 * h * f) + 2 * h * v
    assert training_log.training_flops_per_iteration(_flops_args(), batch) == 3 * per_token * s * batch
    gated = training_log.training_flops_per_iteration(_flops_args(swiglu=True), batch)
    assert gated - training_log.training_flops_per_iteration(_flops_args(), batch) == 3 * layers * 2 * h * f * s * batch
    # Grouped-query attention with 1 key/value head of 16 channels: the QKV projection shrinks from 3h to h + 32.
    grouped = training_log.training_flops_per_iteration(_flops_args(num_query_groups=1), batch)
    flops = training_log.training_flops_per_iteration(_flops_args(), batch)
    assert flops - grouped == 3 * layers * 2 * h * (2 * h - 32) * s * batch


def test_flops_estimate_counts_multi_token_prediction_depths():
    h, s, f, v, batch = 64, 16, 256, 128, 3
    layer = 2 * h * 3 * h + 2 * h * h + 2 * s * h + 4 * h * f
    per_depth = 2 * 3 * h + 2 * (2 * h) * h + layer + 2 * h * v  # 3 norms, projection of [embedding, hidden],
    # one layer, logits
    plain = training_log.training_flops_per_iteration(_flops_args(), batch)
    assert training_log.training_flops_per_iteration(_flops_args(mtp_num_layers=None), batch) == plain
    with_two = training_log.training_flops_per_iteration(_flops_args(mtp_num_layers=2), batch)
    assert with_two - plain == 3 * 2 * per_depth * s * batch


def test_memory_usage_counts_params_grads_and_optimizer_state():
    model = torch.nn.Linear(10, 5)  # 55 fp32 parameters
    optimizer = torch.optim.Adam(model.parameters())
    usage = training_log.memory_usage([model], optimizer, torch.device("cpu"))
    assert (usage["params_bytes"], usage["grads_bytes"], usage["optimizer_state_bytes"]) == (220, 0, 0)
    model(torch.ones(2, 10)).sum().backward()
    optimizer.step()
    model.weight.main_grad = torch.zeros(5, 10, dtype=torch.float64)  # a DDP main grad wins over .grad
    usage = training_log.memory_usage([model], optimizer, torch.device("cpu"))
    # Adam: exp_avg + exp_avg_sq (fp32) per element, plus a scalar fp32 step per parameter tensor.
    assert usage["grads_bytes"] == 50 * 8 + 5 * 4
    assert usage["optimizer_state_bytes"] == 2 * 220 + 2 * 4
    assert usage["allocated_bytes"] == 220 + 420 + 448
    assert usage["peak_bytes"] > 10_000_000  # this process's peak RSS


def _report(iteration, loss):
    memory = {"on_gpu": False, "params_bytes": 1, "grads_bytes": 2, "optimizer_state_bytes": 3,
              "allocated_bytes": 6, "peak_bytes": 100}  # fmt: skip
    return {
        "iteration": iteration, "rank": 0, "losses": {"lm loss": loss}, "learning_rate": 0.01, "loss_scale": 1.0,
        "grad_norm": 0.5, "num_zeros": 4.0, "skipped": False, "nan": False, "iteration_time_s": 0.25,
        "consumed_samples": 8 * iteration, "global_batch_size": 8, "memory": memory,
    }  # fmt: skip


def test_logger_writes_metrics_tensorboard_and_interval_lines(tmp_path, capsys):
    args = argparse.Namespace(
        metrics_file=None, tensorboard_dir=str(tmp_path / "tb"), save=None, log_interval=2, train_iters=4,
        tensorboard_log_interval=1, log_memory_to_tensorboard=False, log_throughput=True,
        world_size=2, **vars(_flops_args()),
    )  # fmt: skip
    logger = training_log.TrainingLogger(args, is_logging_rank=True)
    for iteration, loss in ((1, 4.0), (2, 2.0), (3, 1.0)):
        logger.log_iteration(_report(iteration, loss))
    logger.log_evaluation(2, {"lm loss": 1.5})
    logger.close()

    printed = capsys.readouterr().out.splitlines()
    assert printed[0].startswith("memory (rank 0) | params: 1 bytes | grads: 2 bytes | optimizer state: 3 bytes")
    line = printed[1]
    assert line.startswith("iteration 2/ 4 | consumed samples: 16 | elapsed time per iteration (ms): 250.0 |")
    assert "| lm loss: 3.000E+00 |" in line  # the mean over the interval's two iterations
    tflops_per_gpu = training_log.training_flops_per_iteration(args, 8) / 0.25 / 2 / 1e12
    assert f"| elapsed time per iteration (ms): 250.0 | throughput per GPU (TFLOP/s/GPU): {tflops_per_gpu:.1f} | " \
           "learning rate: 1.000000E-02 |" in line
    tokens_per_second = re.search(r"tokens/s: ([0-9.]+)", printed[2]).group(1)
    assert float(tokens_per_second) == 8 * 16 / 0.25
    assert printed[3].startswith("validation loss at iteration 2 | lm loss value: 1.500000E+00")
    assert len(printed) == 4  # iteration 3 is not a log iteration

    records = [json.loads(line) for line in (tmp_path / "tb" / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in records] == [1, 2, 3, 2]
    assert records[2] == {
        "iteration": 3, "split": "train", "lm loss": 1.0, "grad norm": 0.5, "num-zeros": 4.0, "learning-rate": 0.01,
        "loss-scale": 1.0, "iteration-time": 0.25, "consumed-samples": 24, "skipped": False,
        "mem-allocated-bytes": 6, "mem-max-allocated-bytes": 100, "params-bytes": 1, "grads-bytes": 2,
        "optimizer-state-bytes": 3,
    }  # fmt: skip
    assert records[3]["split"] == "validation"
    event_files = list((tmp_path / "tb").glob("events.out.tfevents.*"))
    assert len(event_files) == 1 and event_files[0].stat().st_size > 0


def test_memory_is_computed_only_for_iterations_that_report_it(capsys):
    """The training loop hands the memory report as a function: computed once where the memory line, a metrics
    record or TensorBoard needs it, never on iterations that report nothing."""
    args = argparse.Namespace(metrics_file=None, tensorboard_dir=None, save=None, log_interval=2, train_iters=6,
                              log_memory_to_tensorboard=False, log_throughput=False)  # fmt: skip
    logger = training_log.TrainingLogger(args, is_logging_rank=True)
    computed_at = []
    for iteration in range(1, 7):
        report = _report(iteration, 1.0)
        memory = report["memory"]
        report["memory"] = lambda iteration=iteration, memory=memory: computed_at.append(iteration) or memory
        logger.log_iteration(report)
    logger.close()
    assert computed_at == [2]  # the first log line carries the memory line; later ones do not
    assert capsys.readouterr().out.startswith("memory (rank 0) | params: 1 bytes | grads: 2 bytes")


def test_memory_is_computed_once_for_the_line_and_the_metrics_record(tmp_path, capsys):
    args = argparse.Namespace(metrics_file=str(tmp_path / "m.jsonl"), tensorboard_dir=None, save=None,
                              log_interval=1, train_iters=1, log_memory_to_tensorboard=False, log_throughput=False)
    logger = training_log.TrainingLogger(args, is_logging_rank=True)
    calls = []
    report = _report(1, 1.0)
    memory = report["memory"]
    report["memory"] = lambda: calls.append(1) or memory
    logger.log_iteration(report)
    logger.close()
    assert len(calls) == 1
    assert json.loads((tmp_path / "m.jsonl").read_text())["params-bytes"] == 1
    assert "memory (rank 0) | params: 1 bytes" in capsys.readouterr().out


def test_non_logging_rank_writes_nothing(tmp_path, capsys):
    args = argparse.Namespace(metrics_file=str(tmp_path / "m.jsonl"), tensorboard_dir=None, save=None,
                              log_interval=1, train_iters=1, log_memory_to_tensorboard=False, log_throughput=False)
    logger = training_log.TrainingLogger(args, is_logging_rank=False)
    logger.log_iteration(_report(1, 1.0))
    logger.close()
    assert capsys.readouterr().out == "" and not (tmp_path / "m.jsonl").exists()


def test_evaluation_of_a_named_validation_set(tmp_path, capsys, monkeypatch):
    """--multiple-validation-sets: the set's label in the line and the TensorBoard keys, and a "validation-set"
    field in the metrics record, whose "split" stays "validation"."""
    scalars = {}

    class Recorder:
        def add_scalar(self, name, value, step):
            scalars[name] = (value, step)

        def flush(self):
            pass

        close = flush

    monkeypatch.setattr(training_log, "build_scalar_writers", lambda args: Recorder())
    args = argparse.Namespace(metrics_file=str(tmp_path / "m.jsonl"), tensorboard_dir=None, save=None,
                              log_interval=1, train_iters=1, log_memory_to_tensorboard=False, log_throughput=False,
                              log_validation_ppl_to_tensorboard=True)
    logger = training_log.TrainingLogger(args, is_logging_rank=True)
    logger.log_evaluation(4, {"lm loss": 2.0}, set_label="b_text_document")
    logger.close()
    assert capsys.readouterr().out.startswith("validation (b_text_document) loss at iteration 4 | lm loss value: "
                                              "2.000000E+00 |")
    assert set(scalars) == {"lm loss validation (b_text_document)", "lm loss validation (b_text_document) ppl"}
    assert json.loads((tmp_path / "m.jsonl").read_text()) == {
        "iteration": 4, "split": "validation", "validation-set": "b_text_document", "lm loss": 2.0}


def test_interval_loss_averages_only_the_iterations_whose_update_was_applied(capsys):
    """As upstream: a skipped iteration (fp16 overflow: its loss may be inf) is counted as skipped, and left out of
    the interval's mean loss; an interval of skipped iterations only shows no loss."""
    args = argparse.Namespace(metrics_file=None, tensorboard_dir=None, save=None, log_interval=3, train_iters=6,
                              log_memory_to_tensorboard=False, log_throughput=False)  # fmt: skip
    logger = training_log.TrainingLogger(args, is_logging_rank=True)
    for iteration, loss, skipped in ((1, 4.0, False), (2, float("inf"), True), (3, 2.0, False),
                                     (4, 9.0, True), (5, 8.0, True), (6, 7.0, True)):
        report = _report(iteration, loss)
        report["skipped"] = skipped
        logger.log_iteration(report)
    logger.close()
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("iteration")]
    assert "| lm loss: 3.000E+00 | loss scale: 1.0 |" in lines[0]  # (4 + 2) / 2
    assert "number of skipped iterations: 1 |" in lines[0]
    assert "lm loss" not in lines[1] and "| number of skipped iterations: 3 |" in lines[1]


def test_tensorboard_memory_and_throughput_scalars_have_upstreams_names(monkeypatch, tmp_path):
    scalars = {}

    class Recorder:
        def add_scalar(self, name, value, step):
            scalars[name] = value

        def flush(self):
            pass

        close = flush

    monkeypatch.setattr(training_log, "build_scalar_writers", lambda args: Recorder())
    args = argparse.Namespace(metrics_file=None, tensorboard_dir=str(tmp_path), save=None, log_interval=1,
                              train_iters=1, tensorboard_log_interval=1, log_memory_to_tensorboard=True,
                              log_throughput=True, log_timers_to_tensorboard=False, world_size=2,
                              **vars(_flops_args()))
    logger = training_log.TrainingLogger(args, is_logging_rank=True)
    logger.log_iteration(_report(1, 1.0))
    logger.close()
    assert scalars["mem-max-allocated-bytes"] == 100 and scalars["mem-allocated-bytes"] == 6
    assert "mem-peak-bytes" not in scalars
    # TFLOP/s per GPU under upstream's "throughput": 8 sequences of 16 tokens in 0.25 s on 2 ranks.
    flops = training_log.training_flops_per_iteration(_flops_args(), 8)
    assert scalars["throughput"] == flops / 0.25 / 2 / 1e12
    assert scalars["throughput-tokens-per-second"] == 8 * 16 / 0.25


def test_only_skipped_iterations_with_a_non_finite_loss_count_as_nan_iterations(capsys):
    """As upstream: "number of nan iterations" counts the skipped iterations (fp16 overflow) whose loss is NaN or
    infinite; an applied update with a non-finite loss, or a skipped one with a finite loss, is not counted."""
    for bad in (float("nan"), float("inf"), float("-inf")):
        assert training_log.counts_as_nan_iteration(bad, skipped=True)
        assert not training_log.counts_as_nan_iteration(bad, skipped=False)
    assert not training_log.counts_as_nan_iteration(5.25, skipped=True)
    assert not training_log.counts_as_nan_iteration(0.0, skipped=False)

    args = argparse.Namespace(metrics_file=None, tensorboard_dir=None, save=None, log_interval=4, train_iters=4,
                              log_memory_to_tensorboard=False, log_throughput=False)
    logger = training_log.TrainingLogger(args, is_logging_rank=True)
    for iteration, loss, skipped in ((1, float("nan"), True), (2, float("inf"), False), (3, 7.0, True),
                                     (4, float("inf"), True)):
        report = _report(iteration, loss)
        report.update(skipped=skipped, nan=training_log.counts_as_nan_iteration(loss, skipped=skipped))
        logger.log_iteration(report)
    logger.close()
    line = capsys.readouterr().out.splitlines()[-1]
    assert line.endswith("| number of skipped iterations: 3 | number of nan iterations: 2 |")


def test_decoupled_learning_rate_is_logged_beside_the_learning_rate():
    groups = [{"lr": 2e-4, "max_lr": 5e-4, "min_lr": 0.0}, {"lr": 1e-3}, {"lr": 1e-3, "weight_decay": 0.0}]
    assert training_log.reported_learning_rates(groups) == (1e-3, 2e-4)  # the decoupled group need not come first
    assert training_log.reported_learning_rates([{"lr": 1e-3}]) == (1e-3, None)
    line = training_log.format_log_line(
        iteration=5, train_iters=10, consumed_samples=40, elapsed_ms_per_iteration=12.0, learning_rate=1e-3,
        global_batch_size=8, losses={"lm loss": 2.0}, loss_scale=1.0, grad_norm=None, num_zeros=None,
        skipped_iterations=0, nan_iterations=0, decoupled_learning_rate=2e-4)
    assert "| learning rate: 1.000000E-03 | decoupled learning rate: 2.000000E-04 | global batch size: 8 |" in line


def test_flops_estimate_counts_the_quick_geglu_mlp_like_swiglu():
    h, s, f, layers, batch = 64, 16, 256, 2, 3
    plain = training_log.training_flops_per_iteration(_flops_args(), batch)
    quick_geglu = training_log.training_flops_per_iteration(_flops_args(quick_geglu=True), batch)
    assert quick_geglu == training_log.training_flops_per_iteration(_flops_args(swiglu=True), batch)
    assert quick_geglu - plain == 3 * layers * 2 * h * f * s * batch  # the up projection: a third matrix


# Upstream's `num_floating_point_operations` (megatron/training/training.py), written out for the shapes below:
# 12 = 3 GEMMs per matmul (forward, data and weight gradient) x 2 matmuls per block x 2 FLOPs per multiply-add.
def _upstream_dense_flops(batch, s, h, layers, heads, groups, kv_channels, ffn, vocab, swiglu):
    query_width = kv_channels * heads
    gated = 3 / 2 if swiglu else 1
    attention = 12 * layers * h * h * ((1 + groups / heads + s / h / 2) * query_width / h)
    mlp = 12 * layers * h * ffn * gated
    return batch * s * (mlp + attention + 6 * h * vocab)


def test_flops_match_upstreams_formula_with_gqa_and_swiglu():
    args = _flops_args(hidden_size=96, kv_channels=32, num_attention_heads=6, num_query_groups=2, swiglu=True,
                       ffn_hidden_size=160, seq_length=64, padded_vocab_size=256,
                       untie_embeddings_and_output_weights=True, recompute_granularity="full")
    expected = _upstream_dense_flops(batch=5, s=64, h=96, layers=2, heads=6, groups=2, kv_channels=32, ffn=160,
                                     vocab=256, swiglu=True)
    assert training_log.training_flops_per_iteration(args, 5) == pytest.approx(expected, rel=1e-12)


def test_flops_match_upstreams_formula_with_moe_shared_experts_and_layer_pattern():
    h, s, layers, batch, ffn, moe_ffn, shared, topk, vocab = 64, 32, 4, 3, 192, 48, 80, 2, 128
    args = _flops_args(num_layers=layers, seq_length=s, swiglu=True, ffn_hidden_size=ffn, padded_vocab_size=vocab,
                       num_experts=8, moe_router_topk=topk, moe_ffn_hidden_size=moe_ffn,
                       moe_shared_expert_intermediate_size=shared, moe_layer_freq=[0, 1, 1, 0], mtp_num_layers=None)
    dense_layers, moe_layers = 2, 2
    attention = 12 * layers * h * h * ((1 + 4 / 4 + s / h / 2) * 64 / h)
    mlp = 12 * layers * h * (ffn * 1.5 * dense_layers / layers + moe_ffn * topk * 1.5 * moe_layers / layers
                             + shared * 1.5 * moe_layers / layers)
    expected = batch * s * (mlp + attention + 6 * h * vocab)
    assert training_log.training_flops_per_iteration(args, batch) == pytest.approx(expected, rel=1e-12)
    # --moe-layer-freq 2 is the pattern 1, 0, 1, 0: as many MoE layers, so as many FLOPs.
    args.moe_layer_freq = 2
    assert training_log.training_flops_per_iteration(args, batch) == pytest.approx(expected, rel=1e-12)


def test_flops_match_upstreams_formula_with_multi_token_prediction_after_a_moe_layer():
    h, s, layers, batch, ffn, moe_ffn, topk, vocab, depths = 64, 16, 2, 2, 256, 32, 2, 128, 2
    args = _flops_args(num_experts=4, moe_router_topk=topk, moe_ffn_hidden_size=moe_ffn,
                       moe_shared_expert_intermediate_size=None, moe_layer_freq=[0, 1], mtp_num_layers=depths)
    all_layers, moe_layers, dense_layers = layers + depths, 1 + depths, 1  # each depth repeats the last layer
    attention = 12 * all_layers * h * h * ((1 + 1 + s / h / 2) * 64 / h)
    mlp = 12 * all_layers * h * (ffn * dense_layers / all_layers + moe_ffn * topk * moe_layers / all_layers)
    mtp_norms_and_projection = 6 * depths * (3 * h + 2 * h * h)
    expected = batch * s * (mlp + attention + mtp_norms_and_projection + 6 * h * vocab * (depths + 1))
    assert training_log.training_flops_per_iteration(args, batch) == pytest.approx(expected, rel=1e-12)


def test_flops_match_upstreams_formula_with_multi_latent_attention():
    h, s, layers, batch, heads, ffn, vocab = 64, 16, 2, 3, 4, 256, 128
    q_lora, kv_lora, qk_dim, rope_dim, v_dim = 24, 32, 8, 4, 12
    mla = dict(multi_latent_attention=True, kv_lora_rank=kv_lora, qk_head_dim=qk_dim, qk_pos_emb_head_dim=rope_dim,
               v_head_dim=v_dim)
    for q_rank, q_term in ((None, h * heads * (qk_dim + rope_dim)),
                           (q_lora, q_lora * (h + heads * (qk_dim + rope_dim) + 1))):
        args = _flops_args(q_lora_rank=q_rank, **mla)
        attention = 6 * layers * (q_term + kv_lora * (h + heads * (qk_dim + v_dim) + 1) + h * rope_dim
                                  + heads * v_dim * h + s * heads * (qk_dim + rope_dim) / 2 + s * heads * v_dim / 2)
        expected = batch * s * (12 * layers * h * ffn + attention + 6 * h * vocab)
        assert training_log.training_flops_per_iteration(args, batch) == pytest.approx(expected, rel=1e-12)


class _ScalarRecorder:
    def __init__(self):
        self.scalars = []

    def add_scalar(self, name, value, step):
        self.scalars.append((name, value, step))

    def flush(self):
        pass

    close = flush


def test_tensorboard_writes_upstreams_vs_samples_scalars(monkeypatch, tmp_path):
    """Each training scalar also against the consumed samples (`<name> vs samples`), as upstream's dashboards
    plot them, and the validation loss too."""
    recorder = _ScalarRecorder()
    monkeypatch.setattr(training_log, "build_scalar_writers", lambda args: recorder)
    args = argparse.Namespace(metrics_file=None, tensorboard_dir=str(tmp_path), save=None, log_interval=1,
                              train_iters=3,
                              tensorboard_log_interval=1, log_memory_to_tensorboard=False, log_throughput=False,
                              log_timers_to_tensorboard=False, log_batch_size_to_tensorboard=True,
                              log_world_size_to_tensorboard=True, log_validation_ppl_to_tensorboard=True,
                              world_size=2, consumed_train_samples=24)
    logger = training_log.TrainingLogger(args, is_logging_rank=True)
    report = _report(3, 2.5)
    report["params_norm"] = 7.0
    logger.log_iteration(report)
    logger.log_evaluation(3, {"lm loss": 1.5})
    logger.close()
    against_samples = {name: (value, step) for name, value, step in recorder.scalars if name.endswith("vs samples")}
    assert against_samples == {
        "lm loss vs samples": (2.5, 24), "learning-rate vs samples": (0.01, 24), "batch-size vs samples": (8, 24),
        "loss-scale vs samples": (1.0, 24), "world-size vs samples": (2, 24), "grad-norm vs samples": (0.5, 24),
        "num-zeros vs samples": (4.0, 24), "params-norm vs samples": (7.0, 24),
        "lm loss validation vs samples": (1.5, 24), "lm loss validation ppl vs samples": (math.exp(1.5), 24)}
    assert ("lm loss", 2.5, 3) in recorder.scalars and ("lm loss validation", 1.5, 3) in recorder.scalars


def test_energy_fields_sit_after_the_throughput_and_go_to_tensorboard(monkeypatch, capsys, tmp_path):
    class FakeMonitor:
        def lap(self):
            return 1600.0  # joules over the interval, all ranks

        def close(self):
            pass

    recorder = _ScalarRecorder()
    monkeypatch.setattr(training_log, "build_scalar_writers", lambda args: recorder)
    monkeypatch.setattr(training_log.EnergyMonitor, "from_args", classmethod(lambda cls, args: FakeMonitor()))
    args = argparse.Namespace(metrics_file=None, tensorboard_dir=str(tmp_path), save=None, log_interval=2,
                              train_iters=2,
                              tensorboard_log_interval=1, log_memory_to_tensorboard=False, log_throughput=True,
                              log_timers_to_tensorboard=False, log_energy=True, world_size=2, **vars(_flops_args()))
    logger = training_log.TrainingLogger(args, is_logging_rank=True)
    for iteration in (1, 2):
        logger.log_iteration(_report(iteration, 1.0))
    logger.close()
    line = [text for text in capsys.readouterr().out.splitlines() if text.startswith("iteration")][0]
    # 1600 J over 2 iterations and 2 GPUs: 400 J per iteration per GPU; at 0.25 s per iteration, 1600 W.
    assert re.search(r"\| throughput per GPU \(TFLOP/s/GPU\): [0-9.]+ \| energy per GPU \(J/iter/GPU\): 400.0 \| "
                     r"power per GPU \(W/GPU\): 1600.0 \| learning rate: ", line)
    assert ("iter-energy/gpu", 400.0, 2) in recorder.scalars and ("power/gpu", 1600.0, 2) in recorder.scalars


def test_test_set_line_reads_as_upstreams_and_keeps_its_own_tags(monkeypatch, capsys, tmp_path):
    recorder = _ScalarRecorder()
    monkeypatch.setattr(training_log, "build_scalar_writers", lambda args: recorder)
    args = argparse.Namespace(metrics_file=str(tmp_path / "m.jsonl"), tensorboard_dir=str(tmp_path), save=None,
                              log_interval=1, train_iters=4, log_memory_to_tensorboard=False, log_throughput=False,
                              log_validation_ppl_to_tensorboard=True)
    logger = training_log.TrainingLogger(args, is_logging_rank=True)
    logger.log_evaluation(4, {"lm loss": 2.0}, prefix="test", where="on test set")
    logger.close()
    assert capsys.readouterr().out.startswith(
        "validation loss at iteration 4 on test set | lm loss value: 2.000000E+00 | lm loss PPL: 7.389056E+00 |")
    assert {name for name, _, _ in recorder.scalars} == {"lm loss test", "lm loss test ppl"}
    assert json.loads((tmp_path / "m.jsonl").read_text()) == {
        "iteration": 4, "split": "test", "when": "on test set", "lm loss": 2.0}


def test_skipped_samples_follow_the_consumed_samples_once_a_batch_was_dropped():
    args = dict(iteration=3, train_iters=5, consumed_samples=24, elapsed_ms_per_iteration=10.0, learning_rate=1e-3,
                global_batch_size=8, losses={"lm loss": 2.0}, loss_scale=1.0, grad_norm=None, num_zeros=None,
                skipped_iterations=0, nan_iterations=0)
    assert training_log.format_log_line(**args, skipped_samples=8).startswith(
        "iteration 3/ 5 | consumed samples: 24 | skipped samples: 8 | elapsed time per iteration (ms): 10.0 |")
    assert "skipped samples" not in training_log.format_log_line(**args)


def test_validation_perplexity_goes_to_tensorboard_only_with_its_flag(monkeypatch, capsys, tmp_path):
    """As upstream: `<loss> validation` (and vs samples) always, the perplexity scalars only with
    --log-validation-ppl-to-tensorboard; the printed line shows the perplexity either way."""
    written = {}
    for flag in (False, True):
        recorder = _ScalarRecorder()
        monkeypatch.setattr(training_log, "build_scalar_writers", lambda args: recorder)
        args = argparse.Namespace(metrics_file=None, tensorboard_dir=str(tmp_path), save=None, log_interval=1,
                                  train_iters=4, log_memory_to_tensorboard=False, log_throughput=False,
                                  log_validation_ppl_to_tensorboard=flag, consumed_train_samples=32)
        logger = training_log.TrainingLogger(args, is_logging_rank=True)
        logger.log_evaluation(4, {"lm loss": 2.0})
        logger.close()
        written[flag] = sorted(recorder.scalars)
        assert "| lm loss PPL: 7.389056E+00 |" in capsys.readouterr().out
    assert written[False] == [("lm loss validation", 2.0, 4), ("lm loss validation vs samples", 2.0, 32)]
    assert written[True] == sorted(written[False] + [("lm loss validation ppl", math.exp(2.0), 4),
                                                     ("lm loss validation ppl vs samples", math.exp(2.0), 32)])


def test_skipped_train_samples_scalar_appears_once_a_batch_was_dropped(monkeypatch, tmp_path):
    """--iterations-to-skip: upstream's `skipped-train-samples` scalar, written while the count is above 0."""
    recorder = _ScalarRecorder()
    monkeypatch.setattr(training_log, "build_scalar_writers", lambda args: recorder)
    args = argparse.Namespace(metrics_file=None, tensorboard_dir=str(tmp_path), save=None, log_interval=10,
                              train_iters=4, tensorboard_log_interval=1, log_memory_to_tensorboard=False,
                              log_throughput=False, log_timers_to_tensorboard=False)
    logger = training_log.TrainingLogger(args, is_logging_rank=True)
    for iteration, skipped_samples in ((1, 0), (3, 8), (4, 8)):
        report = _report(iteration, 2.0)
        report["skipped_samples"] = skipped_samples
        logger.log_iteration(report)
    logger.close()
    assert [scalar for scalar in recorder.scalars if scalar[0] == "skipped-train-samples"] == [
        ("skipped-train-samples", 8, 3), ("skipped-train-samples", 8, 4)]


def test_validation_perplexity_of_a_diverged_loss_is_not_the_cap(monkeypatch, capsys, tmp_path):
    """A finite loss above 20 shows upstream's capped perplexity exp(20); a NaN or Inf validation loss shows a NaN
    or Inf perplexity, not that cap (which would read as a finite, merely large, perplexity)."""
    recorder = _ScalarRecorder()
    monkeypatch.setattr(training_log, "build_scalar_writers", lambda args: recorder)
    args = argparse.Namespace(metrics_file=None, tensorboard_dir=str(tmp_path), save=None, log_interval=1,
                              train_iters=4, log_memory_to_tensorboard=False, log_throughput=False,
                              log_validation_ppl_to_tensorboard=True)
    logger = training_log.TrainingLogger(args, is_logging_rank=True)
    for iteration, loss in ((1, 25.0), (2, float("nan")), (3, float("inf"))):
        logger.log_evaluation(iteration, {"lm loss": loss})
    logger.close()
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].endswith(f"| lm loss PPL: {math.exp(20.0):.6E} |")
    assert lines[1].endswith("| lm loss value: NAN | lm loss PPL: NAN |")
    assert lines[2].endswith("| lm loss value: INF | lm loss PPL: INF |")
    perplexities = [value for name, value, _ in recorder.scalars if name == "lm loss validation ppl"]
    assert perplexities[0] == math.exp(20.0) and math.isnan(perplexities[1]) and perplexities[2] == math.inf


def test_moe_per_layer_losses_use_upstreams_tensorboard_tags_and_stay_out_of_the_log_line(
        monkeypatch, capsys, tmp_path):
    """--moe-per-layer-logging: each MoE layer's loss under upstream's tag `moe/<name>_layer_<i>` (TensorBoard,
    per iteration, and the metrics file); the log line shows only the average over the MoE layers, as upstream."""
    from megatron.core import num_microbatches_calculator
    from megatron.core.transformer.moe import moe_utils

    recorder = _ScalarRecorder()
    monkeypatch.setattr(training_log, "build_scalar_writers", lambda args: recorder)
    monkeypatch.setattr(num_microbatches_calculator, "get_num_microbatches", lambda: 2)
    args = argparse.Namespace(metrics_file=str(tmp_path / "metrics.jsonl"), tensorboard_dir=str(tmp_path),
                              save=None, log_interval=1, train_iters=1, tensorboard_log_interval=1,
                              log_memory_to_tensorboard=False, log_throughput=False, log_timers_to_tensorboard=False,
                              num_experts=4, moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=0.01,
                              moe_z_loss_coeff=None, moe_layer_freq=[0, 1, 1], num_layers=3, data_parallel_size=1,
                              device="cpu", world_size=1)
    moe_utils.clear_aux_losses_tracker()
    for layer_number, value in ((2, 1.0), (3, 3.0), (2, 2.0), (3, 5.0)):  # two microbatches
        moe_utils.save_to_aux_losses_tracker("load_balancing_loss", torch.tensor(value), layer_number, 3,
                                             per_layer=True)
    logger = training_log.TrainingLogger(args, is_logging_rank=True)
    logger.log_iteration(_report(1, 2.5))
    logger.close()

    expected_per_layer = {"moe/load_balancing_loss_layer_1": 1.5, "moe/load_balancing_loss_layer_2": 4.0}
    moe_scalars = {name: (value, step) for name, value, step in recorder.scalars if "load_balancing" in name}
    assert moe_scalars == {"load_balancing_loss": (2.75, 1), "load_balancing_loss vs samples": (2.75, 8),
                           **{tag: (value, 1) for tag, value in expected_per_layer.items()}}
    (record,) = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert {key: value for key, value in record.items() if "load_balancing" in key} == {
        "load_balancing_loss": 2.75, **expected_per_layer}
    line = capsys.readouterr().out.splitlines()[-1]
    assert "| lm loss: 2.500E+00 | load_balancing_loss: 2.750E+00 | loss scale: 1.0 |" in line


def test_an_iteration_whose_tokens_were_all_masked_is_left_out_of_the_interval_mean(monkeypatch, capsys, tmp_path):
    """A global batch whose loss mask is all zero (over DP x CP) has no loss (None, not 0/0): the line's mean is
    over the iterations that had one, an interval without any shows no loss (as upstream shows no NaN mean), the
    metrics record holds null and TensorBoard gets no point."""
    recorder = _ScalarRecorder()
    monkeypatch.setattr(training_log, "build_scalar_writers", lambda args: recorder)
    args = argparse.Namespace(metrics_file=str(tmp_path / "metrics.jsonl"), tensorboard_dir=str(tmp_path),
                              save=None, log_interval=3, train_iters=6, tensorboard_log_interval=1,
                              log_memory_to_tensorboard=False, log_throughput=False, log_timers_to_tensorboard=False,
                              world_size=1)
    logger = training_log.TrainingLogger(args, is_logging_rank=True)
    for iteration, loss in ((1, 4.0), (2, None), (3, 1.0), (4, None), (5, None), (6, None)):
        report = _report(iteration, loss)
        report["nan"] = training_log.counts_as_nan_iteration(loss, skipped=False)
        logger.log_iteration(report)
    logger.close()

    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("iteration ")]
    assert len(lines) == 2
    assert "| global batch size: 8 | lm loss: 2.500E+00 | loss scale: 1.0 |" in lines[0]
    assert "| global batch size: 8 | loss scale: 1.0 |" in lines[1] and "lm loss" not in lines[1]
    assert lines[1].endswith("| number of skipped iterations: 0 | number of nan iterations: 0 |")
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [record["lm loss"] for record in records] == [4.0, None, 1.0, None, None, None]
    assert [(step, value) for name, value, step in recorder.scalars if name == "lm loss"] == [(1, 4.0), (3, 1.0)]
    assert not training_log.counts_as_nan_iteration(None, skipped=True)


def test_flops_count_latent_experts_at_the_latent_width_and_their_two_projections():
    """--moe-latent-size: the routed experts read and write the latent width l, the shared experts the hidden
    width; each token goes through fc1_latent_proj (h -> l) and fc2_latent_proj (l -> h) once (upstream's formula:
    12 x (l x moe_ffn x topk x gated + h x shared x gated) + 12 x h x l per token and layer)."""
    h, s, layers, batch, moe_ffn, shared, topk, vocab, latent = 64, 32, 2, 3, 48, 80, 2, 128, 16
    moe = dict(num_layers=layers, seq_length=s, swiglu=True, padded_vocab_size=vocab, num_experts=8,
               moe_router_topk=topk, moe_ffn_hidden_size=moe_ffn, moe_shared_expert_intermediate_size=shared,
               moe_layer_freq=1, mtp_num_layers=None)
    args = _flops_args(**moe, moe_latent_size=latent)
    attention = 12 * layers * h * h * ((1 + 4 / 4 + s / h / 2) * 64 / h)
    mlp = 12 * layers * (latent * moe_ffn * topk * 1.5 + h * shared * 1.5 + h * latent)
    expected = batch * s * (mlp + attention + 6 * h * vocab)
    assert training_log.training_flops_per_iteration(args, batch) == pytest.approx(expected, rel=1e-12)
    without = training_log.training_flops_per_iteration(_flops_args(**moe, moe_latent_size=None), batch)
    assert without - expected == pytest.approx(batch * s * 12 * layers * ((h - latent) * moe_ffn * topk * 1.5
                                                                         - h * latent), rel=1e-12)
