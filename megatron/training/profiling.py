"""--profile and --record-memory-history in the training loop.

Iterations are counted as upstream counts them: `completed` is the number of iterations finished before a step,
and the steps with --profile-step-start <= completed < --profile-step-end are profiled (the defaults, 10 and
12, profile the steps the log numbers 11 and 12). Only --profile-ranks profile.

- With --use-pytorch-profiler, torch.profiler records CPU (and CUDA) activity: one step of warm-up before the
  first profiled step, then the profiled steps, each inside a `ProfilerStep#N` range and an `iteration N` range
  (the log's number). The trace goes to --tensorboard-dir (else --save) as `rank<R>.<timestamp>.pt.trace.json`,
  readable by TensorBoard's profiler plugin, Perfetto or chrome://tracing. As upstream, op input shapes
  (--pytorch-profiler-collect-shapes) and Python call stacks (--pytorch-profiler-collect-callstack) are recorded
  only when asked for; --pytorch-profiler-collect-chakra adds an execution trace of the same steps for Chakra,
  `chakra/rank<R>.json` in the trace directory, completed when training ends.
- Without it, the profiled steps are the capture range of Nsight Systems (`nsys profile
  --capture-range=cudaProfilerApi`): torch.cuda.profiler start/stop with NVTX ranges of the autograd ops
  (validation has made sure the run is on CUDA).
- --record-memory-history records the CUDA caching allocator's events with stack traces from the start of
  training, and the last rank dumps a snapshot to --memory-snapshot-path at every --log-interval.
- --nvtx-ranges (CUDA) pushes NVTX ranges, for Nsight Systems, around every training step (`iteration N`), its
  `forward-backward` and `optimizer` phases, and the forward of the embedding, each transformer layer, its
  attention and MLP, and the output layer (named by their parameter prefix, e.g. `decoder.layers.0.mlp`).

This module and `accelerator.py` are the training driver's only users of `torch.cuda`.
"""

import contextlib
import os
import re

import torch

# Allocator events kept by --record-memory-history (upstream's trace_alloc_max_entries).
MEMORY_HISTORY_MAX_ENTRIES = 100000
# --nvtx-ranges: the modules whose forward gets a range of its own (by the last part of their qualified name), and
# the transformer layers themselves (`...layers.<i>`, decoder and multi-token prediction alike).
NVTX_ANNOTATED_MODULES = ("embedding", "self_attention", "cross_attention", "mlp", "output_layer")
NVTX_LAYER_NAME = re.compile(r"(^|\.)layers\.\d+$")
# Wrappers (DDP, Float16Module, FSDP) hold the model as `module`; range names leave these prefixes out.
WRAPPER_PREFIX = re.compile(r"^(module\.)+")


class TorchProfilerSteps:
    """--profile --use-pytorch-profiler on this rank, for a loop that starts after `first_completed` iterations."""

    def __init__(self, args, rank, first_completed):
        start, end = args.profile_step_start, args.profile_step_end
        self.trace_dir = args.tensorboard_dir or args.save
        self._profiler = None
        self._execution_trace = None
        if first_completed >= end:
            print(f"rank {rank}: --profile: training resumes after iteration {first_completed}, past "
                  f"--profile-step-end {end}; nothing is profiled", flush=True)
            return
        first_profiled = max(start, first_completed)
        schedule = torch.profiler.schedule(
            wait=max(first_profiled - 1 - first_completed, 0),
            warmup=1 if first_profiled > first_completed else 0,
            active=end - first_profiled,
            repeat=1,
        )
        activities = [torch.profiler.ProfilerActivity.CPU]
        if args.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        if args.pytorch_profiler_collect_chakra:
            chakra_dir = os.path.join(self.trace_dir, "chakra")
            os.makedirs(chakra_dir, exist_ok=True)
            self._execution_trace = torch.profiler.ExecutionTraceObserver().register_callback(
                os.path.join(chakra_dir, f"rank{rank}.json"))
        self._profiler = torch.profiler.profile(
            activities=activities,
            schedule=schedule,
            on_trace_ready=torch.profiler.tensorboard_trace_handler(self.trace_dir, worker_name=f"rank{rank}"),
            record_shapes=args.pytorch_profiler_collect_shapes,
            with_stack=args.pytorch_profiler_collect_callstack,
            execution_trace_observer=self._execution_trace,
        )
        self._profiler.start()

    def step_range(self, completed):
        """A range named after the step's log number (`iteration N`) around the step, while profiling."""
        if self._profiler is None:
            return contextlib.nullcontext()
        return torch.profiler.record_function(f"iteration {completed + 1}")

    def after_step(self, completed):
        if self._profiler is not None:
            self._profiler.step()  # the trace is written when the last active step ends

    def close(self):
        if self._profiler is not None:
            self._profiler.stop()
            self._profiler = None
        if self._execution_trace is not None:
            self._execution_trace.unregister_callback()  # completes the JSON file
            self._execution_trace = None


class NsightCaptureRange:
    """--profile without --use-pytorch-profiler (CUDA): cudaProfilerStart/Stop around the profiled steps."""

    def __init__(self, args):
        self.start, self.end = args.profile_step_start, args.profile_step_end
        self._nvtx = None

    def step_range(self, completed):
        if completed == self.start and self._nvtx is None:
            torch.cuda.profiler.start()
            self._nvtx = torch.autograd.profiler.emit_nvtx(record_shapes=True)
            self._nvtx.__enter__()
        return contextlib.nullcontext()

    def after_step(self, completed):
        if completed >= self.end:
            self.close()

    def close(self):
        if self._nvtx is not None:
            self._nvtx.__exit__(None, None, None)
            torch.cuda.profiler.stop()
            self._nvtx = None


class MemoryHistory:
    """--record-memory-history (CUDA): allocator history from now on; a snapshot every --log-interval."""

    def __init__(self, args, is_last_rank):
        self.path = args.memory_snapshot_path
        self.log_interval = args.log_interval
        self.is_last_rank = is_last_rank
        torch.cuda.memory._record_memory_history(max_entries=MEMORY_HISTORY_MAX_ENTRIES)

    def step_range(self, completed):
        return contextlib.nullcontext()

    def after_step(self, completed):
        if self.is_last_rank and completed % self.log_interval == 0:
            torch.cuda.memory._dump_snapshot(self.path)

    def close(self):
        torch.cuda.memory._record_memory_history(enabled=None)


def nvtx_for_device(device):
    """Where --nvtx-ranges pushes its ranges: torch.cuda.nvtx on a GPU; None on CPU, where no NVTX consumer runs."""
    return torch.cuda.nvtx if device.type == "cuda" else None


def nvtx_annotated_modules(chunk):
    """(range name, module) for the modules of a model chunk whose forward --nvtx-ranges annotates."""
    for name, module in chunk.named_modules():
        name = WRAPPER_PREFIX.sub("", name)
        if name.rsplit(".", 1)[-1] in NVTX_ANNOTATED_MODULES or NVTX_LAYER_NAME.search(name):
            yield name, module


class NvtxRanges:
    """--nvtx-ranges: ranges pushed and popped through `nvtx` (torch.cuda.nvtx) around each step, the phases
    the step names (`phase_range`) and the forward of the annotated modules of `model` (forward hooks)."""

    def __init__(self, nvtx, model):
        self._nvtx = nvtx
        self._hooks = []
        for chunk in model:
            for name, module in nvtx_annotated_modules(chunk):
                self._hooks.append(module.register_forward_pre_hook(self._push_hook(name)))
                # always_call: the range is popped even when the forward raises.
                self._hooks.append(module.register_forward_hook(self._pop_hook, always_call=True))

    def _push_hook(self, name):
        def push(module, inputs):
            self._nvtx.range_push(name)
        return push

    def _pop_hook(self, module, inputs, output):
        self._nvtx.range_pop()

    @contextlib.contextmanager
    def phase_range(self, name):
        self._nvtx.range_push(name)
        try:
            yield
        finally:
            self._nvtx.range_pop()

    def step_range(self, completed):
        return self.phase_range(f"iteration {completed + 1}")

    def after_step(self, completed):
        pass

    def close(self):
        for hook in self._hooks:
            hook.remove()
        self._hooks = []


class TrainingProfilers:
    """The profilers the flags ask for on this rank, driven by the loop around each step::

        with profilers.step_range(completed):
            ...the step, with profilers.phase_range("forward-backward") around its phases...
        profilers.after_step(completed + 1)
    """

    def __init__(self, args, rank, world_size, first_completed, model=()):
        self._parts = []
        self._nvtx = None
        if args.profile and rank in args.profile_ranks:
            if args.use_pytorch_profiler:
                self._parts.append(TorchProfilerSteps(args, rank, first_completed))
            else:
                self._parts.append(NsightCaptureRange(args))
        if args.record_memory_history:
            self._parts.append(MemoryHistory(args, is_last_rank=rank == world_size - 1))
        nvtx = nvtx_for_device(args.device) if getattr(args, "nvtx_ranges", False) else None
        if nvtx is not None:
            # After the Nsight capture range, so the capture has started when the step's range is pushed.
            self._nvtx = NvtxRanges(nvtx, model)
            self._parts.append(self._nvtx)

    def phase_range(self, name):
        """An NVTX range named `name` with --nvtx-ranges on CUDA; else nothing."""
        return self._nvtx.phase_range(name) if self._nvtx is not None else contextlib.nullcontext()

    def step_range(self, completed):
        stack = contextlib.ExitStack()
        for part in self._parts:
            stack.enter_context(part.step_range(completed))
        return stack

    def after_step(self, completed):
        for part in self._parts:
            part.after_step(completed)

    def close(self):
        for part in self._parts:
            part.close()
        self._parts = []
        self._nvtx = None

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.close()
        return False
