"""Megatron-FSDP (ZeRO-0..3) against torch DDP and torch FSDP2: step time, peak RSS, state and communication bytes.

Two ways to launch it:

    python examples/megatron_fsdp/benchmark.py --model tiny [--steps N] [--repeats R] [--configs ...] [--out F]
        Spawns a fresh group of ranks for every measurement (arm x repetition x memory mode), so each process's
        `ru_maxrss` is the peak of exactly one arm, and runs both memory modes (default malloc and
        MALLOC_MMAP_THRESHOLD_=65536) in one go. This is the mode for the published tables.

    torchrun --nproc-per-node 2 examples/megatron_fsdp/benchmark.py --model tiny [...]
        Runs every arm inside the ranks torchrun started. Peak RSS is then the sampled growth over each arm's
        start; the memory mode is whatever the environment torchrun was given (run it twice, once with
        MALLOC_MMAP_THRESHOLD_=65536, to get both).

In both, repetitions are interleaved (every arm once, then every arm again) so that drifting machine load hits
all arms alike, and every arm builds the same model from the same seed and trains on the same tokens.
"""

import argparse
import datetime
import json
import os
import platform
import shlex
import socket
import subprocess
import sys
import tempfile
import time

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

from examples.megatron_fsdp import bench_report, bench_summary, bench_theory  # noqa: E402
from examples.megatron_fsdp.bench_arms import ARMS  # noqa: E402
from examples.megatron_fsdp.bench_model import MODEL_PRESETS, count_parameters  # noqa: E402

NEUTRAL_MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536"}
MEMORY_MODES = ("default", "neutral")
DEFAULT_STEPS = {"tiny": (20, 3), "small": (8, 2)}  # (steps, warm-up steps)
BYTES_PER_PARAM = 4  # fp32

METHOD_TEXT = """
## How this is measured

- **Model**: GPT-like, plain torch (`examples/megatron_fsdp/bench_model.py`): token + learned position
  embeddings, pre-LayerNorm blocks (causal attention via `scaled_dot_product_attention`, GELU MLP), final
  LayerNorm, untied LM head; no dropout, no buffers. Mock tokens from a fixed seed, global batch 8 sequences
  split evenly over the ranks, fp32, AdamW (lr 1e-4, weight decay 0.01), one intra-op thread per rank.
- **Arms**: torch DDP (stock all-reduce comm hook), torch FSDP2 (`fully_shard` on every block, then on the
  root), FSDP2 with `reshard_after_forward=False`, Megatron-FSDP with `zero_dp_strategy` 0..3 and
  `fsdp_unit_modules=[TransformerBlock]`, and Megatron-FSDP ZeRO-3 with both overlaps off. An arm that cannot
  be built shows its error instead of numbers.
- **Step time**: wall time of zero_grad + forward + backward + optimizer step; a step's time is its slowest
  rank's; the arm's time is the median over repetitions of the median post-warm-up step.
- **Peak RSS**: two numbers per rank. *peak* is `getrusage(RUSAGE_SELF).ru_maxrss`, the kernel's high-water
  mark for the process; it is only an arm's peak because the launcher starts fresh rank processes for every
  measurement (it includes the ~300-400 MiB of the imported torch). *growth* is the high-water mark from just
  before the model is built to the end of the arm, minus the RSS at its start: on Linux the kernel's mark, reset
  then (`/proc/self/clear_refs`) and read at the end (`VmHWM`), so nothing runs beside the training; elsewhere a
  2 ms sampling thread reading `/proc/self/statm` (it takes the GIL and slows the steps it measures, and can miss
  spikes shorter than its period). Reported: the largest rank, median over repetitions.
- **Memory modes**: with glibc's default malloc, large freed buffers often stay resident, so sharding that
  frees gathered parameters may not lower RSS at all. With `MALLOC_MMAP_THRESHOLD_=65536` in the rank
  processes' environment every allocation of 64 KiB or more is its own mapping and returns to the OS when
  freed: RSS then follows what the code holds (allocator-neutral). That mode is slower, so step times come from
  the default mode.
- **State bytes**: storages behind the model's and optimizer's parameters, their `.grad`s and the optimizer
  state tensors, each storage once (DTensor shards by their local tensor). DDP's internal bucket buffers are not
  exposed as tensors and are not counted; with `gradient_as_bucket_view=False` (the default) they double the
  gradient memory in practice.
- **Communication**: `torch.distributed` collectives and point-to-point sends (`isend`, `send`) are replaced
  in the rank processes by counting wrappers before any library under test is imported; torch DDP's C++ reducer
  is routed through the stock Python all-reduce hook so it is counted too. Payload = the whole logical tensor
  (all-gather output, reduce-scatter input, all-reduced tensor, all-to-all input); for point-to-point, the bytes
  the rank sends (receives are not counted). Megatron-FSDP on gloo builds its all-gathers and reduce-scatters
  from such messages, so its traffic shows up there. Volume weights an all-reduce twice (it is a reduce-scatter
  plus an all-gather) and point-to-point bytes by g / (g - 1), g the size of the group the message went
  through: a rank that sends its shard to each of its g - 1 peers gets the volume of the all-gather it stands
  for. Wire bytes per rank: volume x (g - 1) / g for collectives, the bytes sent for point-to-point messages.
  ZeRO theory per step with psi = parameter bytes: ZeRO-0 all-reduce psi (volume 2 psi);
  ZeRO-1/2 reduce-scatter psi + all-gather psi (2 psi); ZeRO-3 all-gather psi in forward, all-gather of the
  re-sharded units again in backward, reduce-scatter psi: 3 psi, or 2 psi when parameters stay gathered from forward to
  backward (`reshard_after_forward=False`). Communicating less than the theory is allowed by the targets.
- **Loss**: mean of the ranks' micro-batch losses per step; max abs difference from DDP's curve.
- **Targets**: for every Megatron-FSDP arm, loss equal to DDP's within 1e-5, per-step communication volume
  at most ZeRO theory + 2%, state bytes within 5% of ZeRO theory; for ZeRO-3, step time at most 0.80 x
  FSDP2's and 1.15 x DDP's, allocator-neutral peak RSS at most 0.90 x FSDP2's.

## How to reproduce

Run on a quiet machine (no other jobs; run-to-run spread on shared machines is 10-30% or worse). Both memory
modes are measured by one command; `--provisional` marks a report taken on a busy machine (and its re-renders).

```
python examples/megatron_fsdp/benchmark.py --model tiny --out docs/benchmarks.md --raw-json /tmp/tiny.json
python examples/megatron_fsdp/benchmark.py --model small --repeats 2 --out docs/benchmarks.md --append
# the same arms inside one torchrun group (RSS as sampled growth), once per memory mode:
torchrun --nproc-per-node 2 examples/megatron_fsdp/benchmark.py --model tiny --out /tmp/tiny_torchrun.md
MALLOC_MMAP_THRESHOLD_=65536 torchrun --nproc-per-node 2 examples/megatron_fsdp/benchmark.py --out /tmp/n.md
# re-render a report from saved raw results without measuring again:
python examples/megatron_fsdp/benchmark.py --render-raw-json /tmp/tiny.json --out docs/benchmarks.md
```
"""


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(MODEL_PRESETS), default="tiny")
    parser.add_argument("--steps", type=int, default=None, help="steps per measurement (tiny 20, small 8)")
    parser.add_argument("--warmup", type=int, default=None, help="steps left out of the median (tiny 3, small 2)")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved repetitions in the default-malloc mode")
    parser.add_argument(
        "--neutral-repeats", type=int, default=1, help="repetitions in the allocator-neutral mode (memory only)"
    )
    parser.add_argument("--configs", nargs="+", choices=list(ARMS), default=list(ARMS), help="arms to run")
    parser.add_argument("--memory-modes", nargs="+", choices=MEMORY_MODES, default=list(MEMORY_MODES))
    parser.add_argument("--nproc", type=int, default=2, help="ranks per measurement (spawning launcher only)")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--out", default=None, help="markdown report path (e.g. docs/benchmarks.md)")
    parser.add_argument("--append", action="store_true", help="add the report to the end of --out")
    parser.add_argument(
        "--plot", default=None, help="SVG path (default: next to --out, named after it and the model; 'none': skip)"
    )
    parser.add_argument("--raw-json", default=None, help="also write every rank's raw results here")
    parser.add_argument(
        "--render-raw-json", default=None, help="only re-render --out from the raw results of an earlier run"
    )
    parser.add_argument("--provisional", action="store_true", help="mark the report as taken on a noisy machine")
    parser.add_argument("--timeout-s", type=int, default=1800, help="limit for one measurement's processes")
    parser.add_argument(
        "--pg-timeout-s", type=int, default=300, help="collective timeout, so a rank whose peer failed stops"
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--arm", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--result-file", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    steps, warmup = DEFAULT_STEPS[args.model]
    args.steps = steps if args.steps is None else args.steps
    args.warmup = warmup if args.warmup is None else args.warmup
    if args.steps < 1:
        parser.error(f"--steps must be at least 1, got {args.steps}")
    if not 0 <= args.warmup < args.steps:
        parser.error(f"--warmup must be in [0, --steps); got {args.warmup} with --steps {args.steps}")
    if args.repeats < 1 or args.neutral_repeats < 1:
        parser.error("--repeats and --neutral-repeats must be at least 1")
    return args


# ----------------------------------------------------------------------------------------------- rank side
def _start_rank(timeout_s):
    import torch

    from examples.megatron_fsdp import comm_counter
    from examples.megatron_fsdp.bench_worker import init_process_group_from_env

    comm_counter.install()  # before anything under test is imported
    torch.set_num_threads(1)
    init_process_group_from_env(timeout_s)


def worker_main(args):
    """One rank of one measurement (spawned by `spawn_main`): run the arm, write the result as JSON."""
    import torch.distributed as dist

    from examples.megatron_fsdp.bench_worker import run_arm

    _start_rank(args.pg_timeout_s)
    result = run_arm(args.arm, args.model, args.steps, args.warmup, args.seed, args.lr)
    with open(args.result_file, "w") as handle:
        json.dump(result, handle)
    dist.barrier()
    dist.destroy_process_group()


def torchrun_main(args, argv):
    """All arms inside the ranks torchrun started; rank 0 writes the report."""
    import torch.distributed as dist

    from examples.megatron_fsdp.bench_worker import run_arm

    started = time.time()
    _start_rank(args.pg_timeout_s)
    mode = "neutral" if os.environ.get("MALLOC_MMAP_THRESHOLD_") else "default"
    results = {mode: {arm: [] for arm in args.configs}}
    for repetition in range(args.repeats):
        for arm in args.configs:
            result = run_arm(arm, args.model, args.steps, args.warmup, args.seed, args.lr)
            gathered = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, result)
            results[mode][arm].append(gathered)
            if dist.get_rank() == 0:
                _print_progress(mode, repetition, arm, gathered)
    if dist.get_rank() == 0:
        command = "torchrun --nproc-per-node {} {}".format(dist.get_world_size(), shlex.join(argv))
        launch = (
            "torchrun, all arms in the same rank processes. RSS: sampled growth only; under default malloc "
            "memory freed by an earlier arm stays resident and hides later arms' growth (use the spawning "
            "launcher, or MALLOC_MMAP_THRESHOLD_=65536, for memory comparisons)"
        )
        finish(args, results, command, launch, started, in_process=True, repeats={mode: args.repeats})
    dist.barrier()
    dist.destroy_process_group()


# ----------------------------------------------------------------------------------------------- launcher side
def _free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _rank_env(rank, world_size, port, memory_mode):
    env = dict(os.environ)
    env.pop("MALLOC_MMAP_THRESHOLD_", None)
    if memory_mode == "neutral":
        env.update(NEUTRAL_MALLOC_ENV)
    env.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        OMP_NUM_THREADS="1",
    )
    return env


def run_measurement(args, arm, memory_mode, work_dir, tag):
    """Start `args.nproc` fresh rank processes for one arm; returns their results (errors as results)."""
    port = _free_port()
    processes, result_files, log_files = [], [], []
    for rank in range(args.nproc):
        result_file = os.path.join(work_dir, f"{tag}_rank{rank}.json")
        log_path = os.path.join(work_dir, f"{tag}_rank{rank}.log")
        command = [
            sys.executable, os.path.abspath(__file__), "--worker", "--arm", arm, "--model", args.model,
            "--steps", str(args.steps), "--warmup", str(args.warmup), "--seed", str(args.seed), "--lr", str(args.lr),
            "--pg-timeout-s", str(args.pg_timeout_s), "--result-file", result_file,
        ]  # fmt: skip
        log = open(log_path, "w")
        processes.append(
            subprocess.Popen(command, env=_rank_env(rank, args.nproc, port, memory_mode), stdout=log, stderr=log)
        )
        result_files.append(result_file)
        log_files.append((log, log_path))
    deadline = time.time() + args.timeout_s
    for process in processes:
        try:
            process.wait(timeout=max(1, deadline - time.time()))
        except subprocess.TimeoutExpired:
            for straggler in processes:
                if straggler.poll() is None:
                    straggler.kill()
                    straggler.wait()
    results = []
    for rank, (process, result_file, (log, log_path)) in enumerate(zip(processes, result_files, log_files)):
        log.close()
        if os.path.exists(result_file):
            with open(result_file) as handle:
                results.append(json.load(handle))
            continue
        with open(log_path) as handle:
            tail = handle.read()[-600:].strip().replace("\n", " / ")
        results.append({"arm": arm, "rank": rank, "error": f"rank {rank} exit code {process.returncode}: {tail}"})
    return results


def spawn_main(args, argv):
    started = time.time()
    repeats = {"default": args.repeats, "neutral": args.neutral_repeats}
    repeats = {mode: repeats[mode] for mode in args.memory_modes}
    results = {mode: {arm: [] for arm in args.configs} for mode in args.memory_modes}
    with tempfile.TemporaryDirectory(prefix="mfsdp_bench_") as work_dir:
        for repetition in range(max(repeats.values())):
            for mode in args.memory_modes:
                if repetition >= repeats[mode]:
                    continue
                for arm in args.configs:
                    ranks = run_measurement(args, arm, mode, work_dir, f"{mode}_{repetition}_{arm}")
                    results[mode][arm].append(ranks)
                    _print_progress(mode, repetition, arm, ranks)
    command = "python " + shlex.join(argv)
    launch = f"fresh processes per measurement ({args.nproc} ranks, env:// rendezvous), interleaved"
    finish(args, results, command, launch, started, in_process=False, repeats=repeats)


def _print_progress(mode, repetition, arm, ranks):
    errors = [r["error"] for r in ranks if r.get("error")]
    if errors:
        print(f"[{mode} rep {repetition}] {arm}: {errors[0][:300]}", flush=True)
        return
    step_times = bench_theory.slowest_rank_step_times([r["step_times"] for r in ranks])
    median = bench_theory.median_after_warmup(step_times, ranks[0]["warmup_steps"])
    peak = max(r["rss_lifetime_peak"] for r in ranks) / 2**20
    print(f"[{mode} rep {repetition}] {arm}: median step {median:.3f} s, peak RSS {peak:.0f} MiB, "
          f"last loss {ranks[0]['losses'][-1]:.5f}", flush=True)  # fmt: skip


# ----------------------------------------------------------------------------------------------- report
def _device_description(first_result):
    import torch

    if first_result.get("device", "cpu").startswith("cuda"):
        return torch.cuda.get_device_name(0)
    cpu = platform.processor() or "CPU"
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            names = [line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")]
        cpu = names[0] if names else cpu
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} cores visible, no GPU used"


def finish(args, results, command, launch, started, in_process, repeats):
    """Describe the run, then write the report, the plot and (if asked) the raw results."""
    import torch

    config = MODEL_PRESETS[args.model]
    param_count = count_parameters(config)
    all_results = [r for mode in results.values() for reps in mode.values() for ranks in reps for r in ranks]
    first = next((r for r in all_results if not r.get("error")), all_results[0] if all_results else {})
    meta = {
        "model": args.model,
        "model_description": f"{config.num_layers} layers, hidden {config.hidden_size}, {config.num_attention_heads} "
        f"heads, seq {config.seq_length}, vocab {config.vocab_size}, {param_count / 1e6:.2f} M parameters",
        "device": _device_description(first),
        "torch_version": torch.__version__,
        "backend": first.get("backend", "?"),
        "world_size": first.get("world_size", args.nproc),
        "threads": first.get("threads", 1),
        "date": datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z"),
        "command": command,
        "provisional": args.provisional,
        "launch": launch,
        "in_process": in_process,
        "steps": args.steps,
        "warmup": args.warmup,
        "repeats": repeats,
        "wall_s": time.time() - started,
        "param_bytes": param_count * BYTES_PER_PARAM,
    }
    if args.raw_json:
        with open(args.raw_json, "w") as handle:
            json.dump({"meta": meta, "results": results}, handle)
    write_report(args, meta, results)
    print(f"benchmark wall time {meta['wall_s']:.0f} s", flush=True)


def write_report(args, meta, results):
    memory_modes = list(results)
    timing_mode = "default" if "default" in results else memory_modes[0]
    arm_names = [name for name in ARMS if any(name in mode_results for mode_results in results.values())]
    summaries = bench_summary.summarise(
        results, arm_names, meta["param_bytes"], meta["world_size"], timing_mode, meta["in_process"]
    )
    meta = dict(meta, provisional=args.provisional, timing_mode=timing_mode)
    plot_path = None
    if args.out and args.plot != "none":
        plot_path = args.plot or f"{os.path.splitext(args.out)[0]}_{meta['model']}.svg"
        meta["plot"] = os.path.relpath(plot_path, os.path.dirname(os.path.abspath(args.out)))
    appending = bool(args.out) and args.append and os.path.exists(args.out)
    # An appended report shares the method section of the report it follows.
    markdown = bench_report.render_markdown(meta, summaries, memory_modes, "" if appending else METHOD_TEXT)
    print(markdown)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "a" if appending else "w") as handle:
            handle.write(("\n---\n\n" if appending else "") + markdown)
    if plot_path:
        title = f"Megatron-FSDP benchmark, {meta['model']} model, {meta['world_size']} ranks, {meta['date']}"
        rss_heading = "RSS growth per rank, MiB" if meta["in_process"] else "peak RSS per rank, MiB"
        with open(plot_path, "w") as handle:
            handle.write(bench_report.render_svg(summaries, memory_modes, title, rss_heading))


def render_main(args):
    """Re-render the report from a --raw-json file of an earlier run, without measuring anything."""
    with open(args.render_raw_json) as handle:
        raw = json.load(handle)
    meta = raw["meta"]
    meta.setdefault("in_process", meta["launch"].startswith("torchrun"))
    # A report measured on a busy machine stays marked so when re-rendered (raw files written before the mark was
    # recorded carry it in their command line only).
    recorded = meta.get("provisional", "--provisional" in meta.get("command", "").split())
    args.provisional = args.provisional or recorded
    write_report(args, meta, raw["results"])


def main(argv=None):
    argv = list(sys.argv if argv is None else argv)
    args = parse_args(argv[1:])
    if args.render_raw_json:
        render_main(args)
    elif args.worker:
        worker_main(args)
    elif "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        torchrun_main(args, argv)
    else:
        spawn_main(args, argv)


if __name__ == "__main__":
    main()
