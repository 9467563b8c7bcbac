"""Checkpoint save / load cost of the ~100M GPT at DP=2: the logical torch_dist format under the distributed
optimizer, Megatron-FSDP (ZeRO-3) and FSDP2, sync and --async-save, next to torch FSDP2's own DCP checkpoint
(`get_state_dict` + `dcp.save`) of the same model.

    torchrun --nproc-per-node 2 examples/checkpointing/benchmark_checkpoint.py [--model small] [--repeats 3]
             [--steps 3] [--arms "Megatron-FSDP z3,distributed optimizer"] [--out results.json]

Per arm: one training step (so the optimizer has state), then, `--repeats` times, interleaved:
- sync save: wall time of `save_checkpoint` (training is stopped for all of it) and bytes on disk;
- async save: `--steps` training steps right after `save_checkpoint` returns, until the write is published.
  "Blocked" = the time the training thread spends in `save_checkpoint` (building and staging the CPU snapshot)
  plus any final wait for the write; "steps slowed by" = the wall time of save + steps + wait minus the same
  number of steps without a save measured just before (what the background write costs the overlapped steps;
  noisy where step times vary);
- load: wall time of `load_checkpoint` into the running model.
Medians are reported. The "torch FSDP2 native" arm saves and loads with torch.distributed.checkpoint's own
state-dict helpers (model + optimizer, no scheduler/RNG/args), writing with the same DCP writer settings.
"""

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

MODELS = {  # the presets of examples/megatron_fsdp/bench_model.py, as pretrain_gpt.py flags
    "tiny": "--num-layers 4 --hidden-size 256 --num-attention-heads 4 --seq-length 128 --max-position-embeddings 128 "
            "--vocab-size 1024",
    "small": "--num-layers 12 --hidden-size 768 --num-attention-heads 12 --seq-length 256 "
             "--max-position-embeddings 256 --vocab-size 8192",
}
COMMON = ("--micro-batch-size 1 --global-batch-size 2 --lr 1e-4 --train-iters 1000 --mock-data "
          "--tokenizer-type NullTokenizer --make-vocab-size-divisible-by 128 --hidden-dropout 0 --attention-dropout 0 "
          "--num-workers 0 --eval-iters 0 --distributed-backend gloo --untie-embeddings-and-output-weights "
          "--ckpt-format torch_dist")
ARMS = {
    "distributed optimizer": "--use-distributed-optimizer",
    "Megatron-FSDP z3": "--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params",
    "FSDP2 (logical format)": "--use-torch-fsdp2",
    "torch FSDP2 native DCP": "--use-torch-fsdp2",
}


class Run:
    """Model, optimizer, scheduler and data of one arm, built as pretrain() builds them."""

    def __init__(self, argv):
        import pretrain_gpt
        from megatron.training.data_iterators import build_data_iterators
        from megatron.training.initialize import initialize_megatron
        from megatron.training.model_setup import setup_model_and_optimizer
        from megatron.training.result_validation import setup_rerun_state_machine

        self.args = args = initialize_megatron(None, {}, args=argv.split())  # also the tokenizer and microbatches
        setup_rerun_state_machine(args)  # --rerun-mode, as pretrain() sets it
        self.model, self.optimizer, self.scheduler, self.config = setup_model_and_optimizer(
            pretrain_gpt.model_provider, args)
        args.consumed_train_samples, args.iteration = 0, 0
        self.data, _, _ = build_data_iterators(pretrain_gpt.train_valid_test_datasets_provider, args)
        self.forward_step = pretrain_gpt.forward_step

    def step(self):
        from megatron.training.training import train_step

        train_step(self.forward_step, self.data, self.model, self.optimizer, self.scheduler, self.config, self.args)
        self.args.consumed_train_samples += self.args.global_batch_size

    def steps_time(self, count):
        dist.barrier()
        start = time.perf_counter()
        for _ in range(count):
            self.step()
        dist.barrier()
        return time.perf_counter() - start

    def close(self):
        from megatron.core import parallel_state
        from megatron.core.num_microbatches_calculator import destroy_num_microbatches_calculator
        from megatron.training.dist_checkpoint import close_async_queue

        close_async_queue()
        destroy_num_microbatches_calculator()
        parallel_state.destroy_model_parallel()


def _timed(fn):
    dist.barrier()
    start = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - start


def _bytes(path):
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def _native_fsdp2_save_load(run, directory):
    """torch's own FSDP2 checkpoint: get_state_dict / set_state_dict + dcp.save / dcp.load."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    module, optimizer = run.model[0].module, run.optimizer.optimizer

    def save():
        model_state, optimizer_state = get_state_dict(module, optimizer)
        dcp.save({"model": model_state, "optim": optimizer_state},
                 storage_writer=dcp.FileSystemWriter(directory, single_file_per_rank=True, thread_count=1,
                                                     sync_files=True, overwrite=True))

    def load():
        model_state, optimizer_state = get_state_dict(module, optimizer)
        state = {"model": model_state, "optim": optimizer_state}
        dcp.load(state, storage_reader=dcp.FileSystemReader(directory))
        set_state_dict(module, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])

    return save, load


def benchmark_arm(name, model_args, workdir, repeats, steps):
    from megatron.training import checkpointing

    root = os.path.join(workdir, name.replace(" ", "_").replace("(", "").replace(")", ""))
    run = Run(f"{COMMON} {model_args} {ARMS[name]} --save {root} --load {root}")
    run.step()  # optimizer state exists from here on
    native = name == "torch FSDP2 native DCP"
    results = {"sync_save_s": [], "load_s": [], "async_lost_s": [], "async_blocking_s": [], "step_s": [],
               "bytes": None}
    iteration = 1
    for _ in range(repeats):
        iteration += 1
        if native:
            directory = os.path.join(root, f"native_{iteration}")
            save, load = _native_fsdp2_save_load(run, directory)
            results["sync_save_s"].append(_timed(save))
            results["bytes"] = _bytes(directory)
            results["load_s"].append(_timed(load))
            continue
        run.args.async_save = False
        results["sync_save_s"].append(_timed(lambda: checkpointing.save_checkpoint(
            iteration, run.model, run.optimizer, run.scheduler, run.args)))
        results["bytes"] = _bytes(os.path.join(root, checkpointing.iteration_dir_name(iteration)))
        results["load_s"].append(_timed(lambda: checkpointing.load_checkpoint(
            run.model, run.optimizer, run.scheduler, run.args)))
        baseline = run.steps_time(steps)
        results["step_s"].append(baseline / steps)
        iteration += 1
        run.args.async_save = True

        blocking = []

        def save_and_train():
            start = time.perf_counter()
            checkpointing.save_checkpoint(iteration, run.model, run.optimizer, run.scheduler, run.args)
            blocking.append(time.perf_counter() - start)  # staging the snapshot, then the write goes on
            for _ in range(steps):
                run.step()
                checkpointing.maybe_finalize_async_save(run.args)
            start = time.perf_counter()
            checkpointing.maybe_finalize_async_save(run.args, blocking=True)
            blocking.append(time.perf_counter() - start)  # waiting for a write that outlasted the steps

        results["async_lost_s"].append(_timed(save_and_train) - baseline)
        results["async_blocking_s"].append(sum(blocking))
        if dist.get_rank() == 0:
            shutil.rmtree(os.path.join(root, checkpointing.iteration_dir_name(iteration - 1)), ignore_errors=True)
    run.close()
    return results


def summarize(all_results):
    rows = []
    for name, result in all_results.items():
        median = lambda values: statistics.median(values) if values else None  # noqa: E731
        rows.append({"arm": name, "bytes": result["bytes"], "sync_save_s": median(result["sync_save_s"]),
                     "load_s": median(result["load_s"]), "async_lost_s": median(result["async_lost_s"]),
                     "async_blocking_s": median(result["async_blocking_s"]),
                     "step_s": median(result["step_s"])})
    return rows


def table(rows, model, repeats, steps):
    def fmt(value, digits=2):
        return "-" if value is None else f"{value:.{digits}f}"

    lines = [f"| arm ({model} model, DP=2, gloo, 2 CPU cores) | bytes on disk | sync save (s) | load (s) | "
             f"async save: training thread blocked (s) | async save: steps slowed by (s) | step (s) |",
             "|---|---|---|---|---|---|---|"]
    for row in rows:
        lines.append(f"| {row['arm']} | {row['bytes'] / 2**20:.1f} MiB | {fmt(row['sync_save_s'])} | "
                     f"{fmt(row['load_s'])} | {fmt(row['async_blocking_s'])} | {fmt(row['async_lost_s'])} | "
                     f"{fmt(row['step_s'])} |")
    lines.append(f"\nMedians of {repeats} repetitions; async: {steps} training steps overlap each background write.")
    return "\n".join(lines)


def arm_list(text):
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in ARMS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown arm(s) {unknown}; choose from: " + ", ".join(ARMS))
    return names


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(MODELS), default="small")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--arms", type=arm_list, default=list(ARMS),
                        help="Comma-separated subset of: " + ", ".join(ARMS))
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--out", default=None, help="Write the results as JSON here.")
    return parser.parse_args(argv)


def main():
    options = parse_args()
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
    dist.init_process_group("gloo")
    shared = [options.workdir or (tempfile.mkdtemp(prefix="ckpt_bench_") if dist.get_rank() == 0 else None)]
    dist.broadcast_object_list(shared, src=0)  # one checkpoint root for all ranks
    workdir = shared[0]
    results = {}
    for name in options.arms:
        results[name] = benchmark_arm(name, MODELS[options.model], workdir, options.repeats, options.steps)
    if dist.get_rank() == 0:
        rows = summarize(results)
        print(table(rows, options.model, options.repeats, options.steps), flush=True)
        if options.out:
            with open(options.out, "w") as stream:
                json.dump({"model": options.model, "rows": rows, "raw": results}, stream, indent=1)
        shutil.rmtree(workdir, ignore_errors=True) if options.workdir is None else None
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
