"""Step time of Megatron-FSDP ZeRO-3 (and the distributed optimizer) against Megatron DDP on the MoE model of
`benchmark_wrappers.py`, with the arms' steps interleaved in one job: the ratio holds on a host whose speed drifts.

`benchmark_wrappers.py` runs each arm as its own training job, one after another; on a shared 2-core host the
machine's speed changes between jobs by more than the difference being measured (the same arm run twice differs
by up to 30%). Here one torchrun job of 2 CPU ranks builds every arm's model and optimizer from the same flags
and seed, then takes one training step (pretrain_gpt.py's `train_step`: all microbatches, then the optimizer step)
of each arm in turn, in alternating order (A B, B A, ...), ranks aligned by a barrier before each step. Adjacent
steps see the same machine load, so each step's ratio to the neighbouring DDP step cancels the drift. Prints
each arm's median step (after `--warmup` steps), the ratio of medians, the median of the per-step ratios, the
median CPU time of a step summed over the process's threads (on 2 cores shared by 2 ranks every CPU millisecond of
any thread shows in the step), and the lm loss of the last step of each arm: the arms train the same model on the
same data, so their losses agree to rounding.

    python examples/moe/benchmark_interleaved.py [--steps 60] [--warmup 5] [--arms DDP "Megatron-FSDP z3"]

`--arms` also takes "Megatron-FSDP z0" .. "z2" (no_shard, optim, optim_grads): the same wrapper sharding less,
which shows what each step towards ZeRO-3 adds to the step time.
"""

import argparse
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPOSITORY = os.path.dirname(os.path.dirname(HERE))
INTERLEAVABLE = ["DDP", "distributed optimizer", "Megatron-FSDP z3"]  # arms of benchmark_wrappers.py that train
# the same model, and Megatron-FSDP's other sharding strategies, to see what each adds on the way to ZeRO-3
STRATEGY_ARMS = {f"Megatron-FSDP z{level}": f"--use-megatron-fsdp --data-parallel-sharding-strategy {strategy}"
                 for level, strategy in enumerate(["no_shard", "optim", "optim_grads"])}
ALL_ARMS = INTERLEAVABLE[:2] + list(STRATEGY_ARMS) + INTERLEAVABLE[2:]  # the order of the table


def _build_arm(flags, runtime, model_provider, datasets_provider):
    """Parse and validate one arm's flags, then build its model, optimizer, scheduler and data iterator as
    pretrain() does. `runtime`: the launched job's validated arguments (rank, device, vocabulary, ...)."""
    from megatron.training.arguments import parse_args, validate_args
    from megatron.training.data_iterators import build_data_iterators
    from megatron.training.global_vars import set_args
    from megatron.training.initialize import set_random_seed
    from megatron.training.model_setup import setup_model_and_optimizer
    from megatron.training.training import _attach_timers
    from megatron.training.global_vars import get_timers

    args = validate_args(parse_args(args=flags))
    for name in ("rank", "world_size", "local_rank", "device", "distributed_backend", "padded_vocab_size",
                 "created_process_group"):
        setattr(args, name, getattr(runtime, name))
    args.consumed_train_samples, args.iteration = 0, 0
    set_args(args)
    set_random_seed(args.seed, args.data_parallel_random_init)  # every arm starts from the same weights
    model, optimizer, scheduler, config = setup_model_and_optimizer(model_provider, args)
    config = _attach_timers(model, get_timers(), args)
    train_iterator, _, _ = build_data_iterators(datasets_provider, args)
    return args, model, optimizer, scheduler, config, train_iterator


def initialize_job(first_arm_flags):
    """Join the launched job and set up what pretrain() sets up once (timers, tokenizer and microbatches, which
    initialize_megatron() sets up, and the rerun state machine) from the first arm's flags; returns those validated
    arguments, the `runtime` of `_build_arm`."""
    from megatron.training.initialize import initialize_megatron
    from megatron.training.result_validation import setup_rerun_state_machine

    runtime = initialize_megatron(args=first_arm_flags)
    setup_rerun_state_machine(runtime)
    return runtime


def worker(arm_names, arm_flags, steps, warmup):
    import torch.distributed as dist

    sys.path.insert(0, REPOSITORY)
    import pretrain_gpt
    from megatron.training.global_vars import set_args
    from megatron.training.training import train_step

    runtime = initialize_job(arm_flags[0])
    arms = [_build_arm(flags, runtime, pretrain_gpt.model_provider, pretrain_gpt.train_valid_test_datasets_provider)
            for flags in arm_flags]
    times = [[] for _ in arms]
    cpu_times = [[] for _ in arms]  # CPU seconds of all of the process's threads (gloo's, the posting thread)
    losses = [None] * len(arms)
    for step in range(steps):
        order = range(len(arms)) if step % 2 == 0 else reversed(range(len(arms)))
        for index in order:
            args, model, optimizer, scheduler, config, iterator = arms[index]
            set_args(args)
            dist.barrier()
            start, start_cpu = time.perf_counter(), time.process_time()
            loss, _, _, _ = train_step(pretrain_gpt.forward_step, iterator, model, optimizer, scheduler, config, args)
            times[index].append(time.perf_counter() - start)
            cpu_times[index].append(time.process_time() - start_cpu)
            losses[index] = loss
    if dist.get_rank() == dist.get_world_size() - 1:  # the last rank holds the loss, as in the training log
        report(arm_names, [t[warmup:] for t in times], [t[warmup:] for t in cpu_times], losses)


def report(arm_names, times, cpu_times, losses):
    reference = times[0]
    print("| wrapper | step (ms) | vs DDP (ratio of medians) | vs DDP (median of per-step ratios) | "
          "CPU of all threads (ms) | lm loss, last step |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, arm, cpu, loss in zip(arm_names, times, cpu_times, losses):
        ratios = [a / b for a, b in zip(arm, reference)]
        loss_value = loss.get("lm loss") if isinstance(loss, dict) else loss
        loss_text = f"{float(loss_value):.6f}" if loss_value is not None else "n/a"
        print(f"| {name} | {1000 * statistics.median(arm):.1f} | "
              f"{statistics.median(arm) / statistics.median(reference):.3f} | {statistics.median(ratios):.3f} | "
              f"{1000 * statistics.median(cpu):.1f} | {loss_text} |")
    quartiles = {name: statistics.quantiles([a / b for a, b in zip(arm, reference)], n=4)
                 for name, arm in zip(arm_names[1:], times[1:]) if len(arm) >= 2}
    for name, (low, _, high) in quartiles.items():
        print(f"\n{name} / DDP per step: quartiles {low:.3f} .. {high:.3f} over {len(reference)} steps")


def main():
    sys.path.insert(0, HERE)
    import benchmark_wrappers as benchmark

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--arms", nargs="+", choices=ALL_ARMS,
                        default=["DDP", "Megatron-FSDP z3"],
                        help="arms to interleave (DDP, the reference of the ratios, always runs)")
    parser.add_argument("--model", choices=list(benchmark.MODELS), default="small")
    options = parser.parse_args()
    if options.steps <= options.warmup:
        parser.error(f"--steps ({options.steps}) must exceed --warmup ({options.warmup})")
    names = ["DDP"] + [name for name in ALL_ARMS if name in options.arms and name != "DDP"]
    arms = []
    for name in names:
        expert_parallel_size, flags, _ = benchmark.ARMS[name] if name in benchmark.ARMS else (
            benchmark.ARMS["Megatron-FSDP z3"][0], STRATEGY_ARMS[name], None)
        arm_flags = [*benchmark.model_flags(options.model).split(), *flags.split(),
                     "--expert-model-parallel-size", str(expert_parallel_size),
                     "--train-iters", str(options.steps)]
        arms.append((name, " ".join(arm_flags)))
    launch_job(__file__, benchmark.WORLD, options.steps, options.warmup, arms)


def launch_job(script, world, steps, warmup, arms):
    """Run `script` under torchrun on `world` gloo ranks (one intra-op thread each) as
    `script --worker STEPS WARMUP --arm NAME FLAGS ...`, for `arms` = [(name, flags), ...]; `run_script` reads it."""
    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={world}", os.path.abspath(script),
               "--worker", str(steps), str(warmup)]
    for name, flags in arms:
        command += ["--arm", name, flags]
    package = os.path.join(REPOSITORY, "megatron", "core", "distributed", "fsdp", "src")
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(filter(None, [package, REPOSITORY, os.environ.get("PYTHONPATH")])))
    subprocess.run(command, check=True, cwd=REPOSITORY, env=env)


def run_script(worker_function, main_function):
    """A launched rank (`--worker`, see `launch_job`) calls `worker_function(names, flags, steps, warmup)`;
    otherwise `main_function()` parses the options and launches the job."""
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        steps, warmup, rest = int(sys.argv[2]), int(sys.argv[3]), sys.argv[4:]
        names, flags = rest[1::3], [entry.split() for entry in rest[2::3]]
        worker_function(names, flags, steps, warmup)
    else:
        main_function()


if __name__ == "__main__":
    run_script(worker, main)
