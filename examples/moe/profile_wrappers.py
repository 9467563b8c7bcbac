"""Where one step of an arm of `benchmark_wrappers.py` spends its time, per rank: wall and thread CPU time of the
phases of a step and of Megatron-FSDP's schedule methods, collective calls per step, minor page faults.

Launches pretrain_gpt.py on 2 ranks (the benchmark's model and flags) through this file, which wraps the functions
below with timers before training starts and writes, for steps `--start` .. `--start + --steps - 1`, one table per
rank (`OUT/timers<rank>.txt`, inclusive times per step, nested calls counted in each caller too).

    python examples/moe/profile_wrappers.py --arm "Megatron-FSDP z3" [--model small] [--start 5] [--steps 20]
"""

import argparse
import collections
import functools
import os
import resource
import runpy
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPOSITORY = os.path.dirname(os.path.dirname(HERE))

SCHEDULE_METHODS = ["root_pre_forward", "root_post_forward", "_root_pre_backward", "_unit_pre_backward",
                    "_unit_post_backward", "_post_backward", "ensure_gathered", "gather", "release", "launch_reduce",
                    "_wait_oldest_reduce", "finish_grad_sync", "zero_grad_buffer", "_track_transient"]
HOOK_FACTORIES = ["_make_pre_forward", "_make_post_forward"]
GROUP_METHODS = ["write_grad", "take_accumulated_grads", "reduce_input", "start_gather", "finish_gather", "allocate_compute", "release_compute",
                 "_allocate_transient_grads", "ensure_main_grads"]
DIST_CALLS = ["isend", "irecv", "all_reduce", "all_to_all_single", "all_gather_into_tensor", "broadcast"]


class Timers:
    """Wall and thread-CPU seconds and calls per name, counted only while `active`."""

    def __init__(self):
        self.active = False
        self.wall, self.cpu, self.calls = collections.Counter(), collections.Counter(), collections.Counter()

    def wrap(self, name, function):
        @functools.wraps(function)
        def timed(*args, **kwargs):
            if not self.active:
                return function(*args, **kwargs)
            wall, cpu = time.perf_counter(), time.thread_time()
            try:
                return function(*args, **kwargs)
            finally:
                self.wall[name] += time.perf_counter() - wall
                self.cpu[name] += time.thread_time() - cpu
                self.calls[name] += 1
        return timed

    def patch(self, owner, names, prefix):
        for name in names:
            if hasattr(owner, name):
                setattr(owner, name, self.wrap(prefix + name, getattr(owner, name)))

    def write(self, path, steps):
        with open(path, "w") as stream:
            stream.write("wall ms/step | thread CPU ms/step | calls/step | what\n")
            for name, wall in sorted(self.wall.items(), key=lambda item: -item[1]):
                stream.write(f"{1000 * wall / steps:8.2f} | {1000 * self.cpu[name] / steps:8.2f} | "
                             f"{self.calls[name] / steps:6.1f} | {name}\n")


def _instrument(timers, start, steps, out):
    """Wrap the training step, its phases, Megatron-FSDP's schedule and torch.distributed's calls with `timers`."""
    import torch.distributed as dist

    import megatron.core.pipeline_parallel.schedules as schedules
    import megatron.training.training as training

    try:
        from megatron_fsdp import collectives, grad_buffers, param_and_grad_buffer, schedule
        timers.patch(schedule.Schedule, SCHEDULE_METHODS, "fsdp.")
        for factory in HOOK_FACTORIES:  # the hooks they make are timed (registered after this patch)
            made = getattr(schedule.Schedule, factory)
            setattr(schedule.Schedule, factory, functools.partialmethod(
                lambda self, unit, made=made, factory=factory: timers.wrap(
                    f"fsdp.{factory[len('_make_'):]} hook", made(self, unit))))
        timers.patch(grad_buffers, ["copy_grad_in"], "fsdp.")
        timers.patch(collectives.PendingCollective, ["wait"], "fsdp.PendingCollective.")
        # the hand-over of point-to-point messages to the posting thread (which posts them: "all threads" time)
        timers.patch(collectives, ["_post_messages"], "fsdp.")
        timers.patch(param_and_grad_buffer.ParamGroup, GROUP_METHODS, "fsdp.group.")
    except ImportError:
        pass
    timers.patch(dist, DIST_CALLS, "dist.")
    from megatron.core.distributed.distributed_data_parallel import DistributedDataParallel
    timers.patch(DistributedDataParallel, ["_accumulate_into_main_grad"], "ddp.")
    timers.patch(schedules, ["forward_step", "backward_step", "_finalize"], "")
    train_step, state = training.train_step, {"step": 0}

    def profiled_step(forward_step_func, data_iterator, model, optimizer, *args, **kwargs):
        step = state["step"]
        state["step"] += 1
        timers.active = start <= step < start + steps
        if timers.active and not getattr(optimizer, "profiled", False):
            optimizer.step, optimizer.profiled = timers.wrap("optimizer.step", optimizer.step), True
        wall, process, thread = time.perf_counter(), time.process_time(), time.thread_time()
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        try:
            return train_step(forward_step_func, data_iterator, model, optimizer, *args, **kwargs)
        finally:
            if timers.active:
                timers.wall["step"] += time.perf_counter() - wall
                timers.cpu["step"] += time.thread_time() - thread
                timers.calls["step"] += 1
                timers.wall["step (process CPU, all threads)"] += time.process_time() - process
                timers.calls["step (process CPU, all threads)"] += 1
                timers.wall["thousand minor page faults (not ms)"] += (
                    resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults) / 1e6
            timers.active = False
            if step == start + steps - 1:
                os.makedirs(out, exist_ok=True)
                timers.write(os.path.join(out, f"timers{os.environ.get('RANK', '0')}.txt"), steps)

    training.train_step = profiled_step


def main():
    sys.path.insert(0, HERE)
    import benchmark_wrappers as benchmark

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arm", choices=list(benchmark.ARMS), default="Megatron-FSDP z3")
    parser.add_argument("--model", choices=list(benchmark.MODELS), default="small")
    parser.add_argument("--start", type=int, default=5, help="first profiled step (0-based)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--out", default=os.path.join(tempfile.gettempdir(), "profile_wrappers_out"),
                        help="directory for the per-rank profiles (default: under the system temp directory)")
    options = parser.parse_args()
    expert_parallel_size, flags, _ = benchmark.ARMS[options.arm]
    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={benchmark.WORLD}",
               os.path.abspath(__file__), "--worker", str(options.start), str(options.steps),
               os.path.abspath(options.out), os.path.join(REPOSITORY, "pretrain_gpt.py"),
               *benchmark.model_flags(options.model).split(), *flags.split(),
               "--expert-model-parallel-size", str(expert_parallel_size),
               "--train-iters", str(options.start + options.steps)]
    package = os.path.join(REPOSITORY, "megatron", "core", "distributed", "fsdp", "src")
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(filter(None, [package, REPOSITORY, os.environ.get("PYTHONPATH")])))
    subprocess.run(command, check=True, cwd=REPOSITORY, env=env, stdout=subprocess.DEVNULL)
    for rank in range(benchmark.WORLD):
        with open(os.path.join(options.out, f"timers{rank}.txt")) as stream:
            print(f"rank {rank}\n{stream.read()}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        first, count, out, script = int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
        _instrument(Timers(), first, count, out)
        sys.argv = [script] + sys.argv[6:]
        runpy.run_path(script, run_name="__main__")
    else:
        main()
