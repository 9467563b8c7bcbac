"""Quantization-aware training through pretrain() (2 ranks): a trained tiny GPT is quantized (FP8 PTQ,
examples/post_training/quantize.py) and exported as a torch_dist checkpoint holding modelopt's state; pretrain()
loads it (`--load Q --finetune`), which converts the freshly built model from that state before loading the
weights and amaxes, and trains it quantized under DDP and under Megatron-FSDP. A QAT run interrupted after 2
iterations and resumed from its torch_dist checkpoint at another tensor-parallel size (TP2 instead of DP2)
continues the uninterrupted run's losses (iteration 3 tests the loaded model, 4 the loaded optimizer state).
quantize.py and prune.py refuse the quantized checkpoint as their --load, saying what to load instead.

fp32 on CPUs: the runs differ only in the order of floating-point reductions (and, resumed at TP2, in the
partial sums of row-parallel layers); with the same amaxes the fake-quantized values are the same unless an
element sits on a rounding boundary, so losses agree to 1e-5 relative (measured: Megatron-FSDP equal to DDP in
all 4 iterations, resumed at TP2 2.5e-8). The mock data are random tokens, so the losses stay near ln(vocab);
the README's QAT numbers come from a corpus.
"""

import os
import re

import pytest
import torch

from megatron.core.optional_deps import modelopt_installed
from tests.unit_tests.dist_checkpointing.pretrain_helpers import run_pretrain, tiny_gpt_argv
from tests.unit_tests.multiprocess_harness import run_on_ranks
from tests.unit_tests.post_training.modelopt_plugins import import_modelopt_plugins

pytestmark = pytest.mark.skipif(
    not modelopt_installed(), reason="nvidia-modelopt is not installed (pip install -e '.[modelopt]')"
)

DIST = "--ckpt-format torch_dist"
QAT_ITERS = "--train-iters 4 --lr-decay-iters 4 --lr-warmup-iters 0 --lr 1e-3 --min-lr 1e-4"
REL_TOLERANCE = 1e-5


def _post_training_quantize(trained, exported):
    from examples.post_training import quantize
    from megatron.training.initialize import initialize_megatron
    from megatron.training.training import _teardown

    argv = tiny_gpt_argv(f"--train-iters 4 --load {trained} {DIST} --quant-cfg fp8 --calib-batches 2 "
                         f"--eval-iters 2 --eval-interval 4 --export-dir {exported}")
    args = initialize_megatron(extra_args_provider=quantize.add_quantize_arguments, args=argv.split())
    try:
        result = quantize.run(args)
        return {"before": result["before"], "after": result["after"]}
    finally:
        _teardown(args)


def _error_loading_quantized(script_name, exported, extra):
    """The ValueError quantize.py or prune.py (`script_name`) gives for --load of a quantized checkpoint."""
    import importlib

    from megatron.training.initialize import initialize_megatron
    from megatron.training.training import _teardown

    script = importlib.import_module(f"examples.post_training.{script_name}")
    add_arguments = {"quantize": "add_quantize_arguments", "prune": "add_prune_arguments"}[script_name]
    argv = tiny_gpt_argv(f"--train-iters 4 --load {exported} {DIST} --eval-iters 1 --eval-interval 4 {extra}")
    args = initialize_megatron(extra_args_provider=getattr(script, add_arguments), args=argv.split())
    try:
        script.run(args)
    except ValueError as error:
        return str(error)
    finally:
        _teardown(args)
    return None


def _qat_runs(workdir):
    from megatron.training.checkpointing import write_tracker

    import_modelopt_plugins()
    trained, exported, qat = (os.path.join(workdir, name) for name in ("trained", "quantized", "qat"))
    run_pretrain(workdir, f"--train-iters 8 --save {trained} --save-interval 8 {DIST}")
    ptq = _post_training_quantize(trained, exported)
    ptq["quantize_again"] = _error_loading_quantized("quantize", exported, "--quant-cfg int8 --calib-batches 1")
    ptq["prune"] = _error_loading_quantized("prune", exported, "--calib-size 8 --target-ffn-hidden-size 32")
    from_quantized = f"--load {exported} --finetune {DIST} {QAT_ITERS}"
    results = {
        "ptq": ptq,
        "qat_ddp": run_pretrain(workdir, f"{from_quantized} --save {qat} --save-interval 2"),
        "qat_megatron_fsdp": run_pretrain(
            workdir, f"{from_quantized} --use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params"),
        "finetune_unquantized": run_pretrain(workdir, f"--load {trained} --finetune {DIST} {QAT_ITERS}"),
    }
    if torch.distributed.get_rank() == 0:
        write_tracker(qat, 2)  # resume from the checkpoint of iteration 2
    torch.distributed.barrier()
    results["qat_resumed_tp2"] = run_pretrain(workdir, f"--load {qat} {DIST} {QAT_ITERS} "
                                                       "--tensor-model-parallel-size 2")
    return results


@pytest.fixture(scope="module")
def qat_results(tmp_path_factory):
    return run_on_ranks(2, _qat_runs, str(tmp_path_factory.mktemp("qat")))[0]


def _assert_close(actual, expected, what):
    assert abs(actual - expected) <= REL_TOLERANCE * abs(expected), (what, actual, expected)


def test_ptq_changes_the_validation_loss_a_little(qat_results):
    ptq = qat_results["ptq"]
    assert ptq["after"] != ptq["before"]
    assert abs(ptq["after"] - ptq["before"]) < 0.05 * ptq["before"], ptq


def test_quantize_and_prune_refuse_a_quantized_checkpoint(qat_results):
    modes = r"\(quantize, max_calibrate\)"
    assert re.search(rf"--load \S+quantized holds a model modelopt already converted {modes}.*"
                     r"pretrain_gpt.py --load \S+quantized --finetune", qat_results["ptq"]["quantize_again"])
    assert re.search(rf"--load \S+quantized holds a model modelopt converted {modes}: prune.py prunes an "
                     r"unconverted model.*Prune the checkpoint it was quantized from", qat_results["ptq"]["prune"])


def test_qat_trains_the_quantized_model(qat_results):
    qat, plain = qat_results["qat_ddp"], qat_results["finetune_unquantized"]
    assert sorted(qat) == sorted(plain) == [1, 2, 3, 4]
    for iteration in qat:  # the quantized model is what trains: its losses are not the plain model's
        assert qat[iteration] != plain[iteration], iteration
        assert abs(qat[iteration] - plain[iteration]) < 0.05 * plain[iteration], (iteration, qat, plain)


def test_qat_under_megatron_fsdp_equals_ddp(qat_results):
    fsdp, ddp = qat_results["qat_megatron_fsdp"], qat_results["qat_ddp"]
    assert sorted(fsdp) == sorted(ddp)
    for iteration in ddp:
        _assert_close(fsdp[iteration], ddp[iteration], f"Megatron-FSDP iteration {iteration}")


def test_qat_resumed_at_tp2_continues_the_uninterrupted_run(qat_results):
    resumed, straight = qat_results["qat_resumed_tp2"], qat_results["qat_ddp"]
    assert sorted(resumed) == [3, 4], resumed
    for iteration in resumed:
        _assert_close(resumed[iteration], straight[iteration], f"resumed iteration {iteration}")
