"""Upstream's --train-sync-interval, --nvtx-ranges and --pytorch-profiler-collect-* flags with their effect on a
run, and the upstream flags that stop here (--symmetric-ar-type, --nccl-all-reduce-for-prefill, --mrope-section,
--kitchen-*) with messages that name the flag and say what to do."""

import argparse
import glob
import json
import warnings
from functools import partial

import pytest
import torch

from megatron.training import run_control
from megatron.training.arguments import parse_args
from megatron.training.profiling import TorchProfilerSteps
from tests.unit_tests.multiprocess_harness import run_on_ranks
from tests.unit_tests.training import argument_checks
from tests.unit_tests.training.test_training import TINY_GPT

BASE = f"{argument_checks.BASE} --train-iters 4"
validated = partial(argument_checks.validated, base=BASE)


@pytest.mark.parametrize("extra, message", [
    ("--symmetric-ar-type two_shot", r"^--symmetric-ar-type two_shot runs the tensor-parallel all-reduces on NCCL "
     r"symmetric memory, which needs CUDA GPUs; this run's --distributed-backend is gloo: drop the flag"),
    ("--symmetric-ar-type multimem_all_reduce --distributed-backend nccl", r"^--symmetric-ar-type multimem_all_reduce: "
     r"upstream hands it to Transformer Engine's row-parallel linears, which this build does not use; .* drop the "
     r"flag"),
    ("--nccl-all-reduce-for-prefill", r"^--nccl-all-reduce-for-prefill switches upstream's inference engine .* "
     r"tools/run_text_generation_server.py has symmetric-memory kernels .*: drop the flag$"),
    ("--mrope-section 16 24 24", r"^--mrope-section splits the rotary channels of --position-embedding-type mrope, "
     r"which is not offered: multimodal RoPE .* use --position-embedding-type rope, and drop --mrope-section$"),
    ("--kitchen-config-file recipes.yaml", r"^--kitchen-config-file configures NVIDIA Kitchen quantization, a library "
     r"this build does not support: drop --kitchen-config-file; .*--fp8-format"),
    ("--kitchen-recipe-number 3", r"^--kitchen-recipe-number configures NVIDIA Kitchen quantization, a library this "
     r"build does not support: drop --kitchen-recipe-number; "),
    ("--train-sync-interval 0", r"^--train-sync-interval must be a positive number of iterations, got 0"),
    ("--pytorch-profiler-collect-shapes --pytorch-profiler-collect-chakra", r"^--pytorch-profiler-collect-shapes, "
     r"--pytorch-profiler-collect-chakra choose what the PyTorch profiler records: add --profile "
     r"--use-pytorch-profiler"),
])
def test_refused_flags_name_the_flag_and_what_to_do(extra, message):
    with pytest.raises(ValueError, match=message):
        validated(extra)


def test_kitchen_flags_exclude_each_other_and_symmetric_ar_type_takes_upstreams_choices(capsys):
    for extra, error in (
            ("--kitchen-config-file a.yaml --kitchen-recipe-number 1",
             "argument --kitchen-recipe-number: not allowed with argument --kitchen-config-file"),
            ("--symmetric-ar-type three_shot", "argument --symmetric-ar-type: invalid choice: 'three_shot'")):
        with pytest.raises(SystemExit):
            parse_args(args=f"{BASE} {extra}".split())
        assert error in capsys.readouterr().err
    for choice in ("two_shot", "one_shot", "multimem_all_reduce"):
        assert parse_args(args=f"{BASE} --symmetric-ar-type {choice}".split()).symmetric_ar_type == choice


def test_nvtx_ranges_warn_on_cpu_and_parse_with_upstreams_defaults():
    with pytest.warns(UserWarning, match="--nvtx-ranges annotates CUDA work for Nsight Systems; this run uses gloo"):
        args = validated("--nvtx-ranges --train-sync-interval 3")
    assert (args.nvtx_ranges, args.train_sync_interval) == (True, 3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        args = validated("")
    assert (args.nvtx_ranges, args.train_sync_interval, args.symmetric_ar_type, args.mrope_section) == (
        False, None, None, None)
    assert (args.pytorch_profiler_collect_shapes, args.pytorch_profiler_collect_callstack,
            args.pytorch_profiler_collect_chakra) == (False, False, False)


def test_synchronize_at_interval_synchronizes_every_nth_iteration(monkeypatch):
    synchronized = []
    monkeypatch.setattr(run_control, "synchronize_device", synchronized.append)
    device = torch.device("cpu")
    for interval in (None, 3):
        args = argparse.Namespace(train_sync_interval=interval, device=device)
        due = [completed for completed in range(1, 10) if run_control.synchronize_at_interval(args, completed)]
        assert due == ([] if interval is None else [3, 6, 9])
    assert synchronized == [device] * 3


def _profile_three_steps(trace_dir, shapes, callstack, chakra):
    args = argparse.Namespace(profile_step_start=1, profile_step_end=2, tensorboard_dir=str(trace_dir), save=None,
                              device=torch.device("cpu"), pytorch_profiler_collect_shapes=shapes,
                              pytorch_profiler_collect_callstack=callstack, pytorch_profiler_collect_chakra=chakra)
    profiler = TorchProfilerSteps(args, rank=0, first_completed=0)
    linear = torch.nn.Linear(4, 4)
    for completed in range(3):
        with profiler.step_range(completed):
            linear(torch.randn(2, 4)).sum().backward()
        profiler.after_step(completed + 1)
    profiler.close()
    (trace,) = glob.glob(str(trace_dir / "rank0.*.pt.trace.json"))
    events = json.load(open(trace))["traceEvents"]
    addmm = [event for event in events if event.get("name") == "aten::addmm"]
    assert len(addmm) == 1  # the profiled step's forward only
    return addmm[0]["args"], {event.get("cat") for event in events}


def test_pytorch_profiler_collects_shapes_callstack_and_chakra_only_when_asked(tmp_path):
    addmm_args, categories = _profile_three_steps(tmp_path / "shapes", shapes=True, callstack=False, chakra=False)
    assert addmm_args["Input Dims"] == [[4], [2, 4], [4, 4], [], []]  # bias, input, weight^T, beta, alpha
    assert "python_function" not in categories
    assert not (tmp_path / "shapes" / "chakra").exists()

    addmm_args, categories = _profile_three_steps(tmp_path / "stacks", shapes=False, callstack=True, chakra=True)
    assert "Input Dims" not in addmm_args
    assert "python_function" in categories  # the Python frames of --pytorch-profiler-collect-callstack
    execution_trace = json.load(open(tmp_path / "stacks" / "chakra" / "rank0.json"))
    names = {node["name"] for node in execution_trace["nodes"]}
    assert {"iteration 2", "aten::addmm", "AddmmBackward0"} <= names  # the profiled step, forward and backward
    assert not {"iteration 1", "iteration 3"} & names


class _NvtxRecorder:
    def __init__(self):
        self.events = []

    def range_push(self, name):
        self.events.append(("push", name))

    def range_pop(self):
        self.events.append(("pop", None))


def _train_with_sync_interval_and_nvtx(workdir):
    import pretrain_gpt
    from megatron.core.enums import ModelType
    from megatron.training import profiling
    from megatron.training.global_vars import get_args
    from megatron.training.training import pretrain

    recorder, synchronized_after = _NvtxRecorder(), []
    real_nvtx_for_device, real_synchronize = profiling.nvtx_for_device, run_control.synchronize_device
    profiling.nvtx_for_device = lambda device: recorder  # a GPU's torch.cuda.nvtx, recorded
    run_control.synchronize_device = lambda device: synchronized_after.append(get_args().iteration)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            pretrain(pretrain_gpt.train_valid_test_datasets_provider, pretrain_gpt.model_provider,
                     ModelType.encoder_or_decoder, pretrain_gpt.forward_step,
                     argv=f"{TINY_GPT} --train-iters 5 --train-sync-interval 2 --nvtx-ranges --save {workdir} "
                     "--save-interval 100".split())
    finally:
        profiling.nvtx_for_device, run_control.synchronize_device = real_nvtx_for_device, real_synchronize
    return recorder.events, synchronized_after


def test_train_sync_interval_and_nvtx_ranges_in_training(tmp_path):
    (events, synchronized_after), = run_on_ranks(1, _train_with_sync_interval_and_nvtx, str(tmp_path))
    assert synchronized_after == [2, 4]  # after the 2nd and 4th of 5 iterations

    # Balanced pushes and pops, one step range per iteration around everything else.
    depth, steps = 0, []
    for kind, name in events:
        depth += 1 if kind == "push" else -1
        assert depth >= 0
        if kind == "push" and depth == 1:
            steps.append(name)
    assert depth == 0
    assert steps == [f"iteration {n}" for n in range(1, 6)]

    # One step: its phases, and the forward of each annotated module per microbatch (8 / 2 = 4), nested.
    first_step = events[:events.index(("push", "iteration 2"))]
    pushed = [name for kind, name in first_step if kind == "push"]
    layer = ["decoder.layers.{i}", "decoder.layers.{i}.self_attention", "decoder.layers.{i}.mlp"]
    microbatch = (["embedding"] + [name.format(i=i) for i in (0, 1) for name in layer] + ["output_layer"])
    assert pushed == ["iteration 1", "forward-backward"] + microbatch * 4 + ["optimizer"]
    attention = first_step.index(("push", "decoder.layers.0.self_attention"))
    assert first_step[attention + 1] == ("pop", None)  # attention's range closes before the MLP's opens
