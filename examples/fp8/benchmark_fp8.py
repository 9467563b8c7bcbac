"""FP8 on this machine: step time and all-gathered bytes with and without `--fp8-param-gather`, and the cost of
FP8 GEMMs (torch._scaled_mm and dequantize-and-matmul emulation) against fp32; on one GPU, torch-native FP8
against bf16 per linear layer and end to end.

    python examples/fp8/benchmark_fp8.py [--iters 30] [--repeats 2] [--nproc 2] [--output results.json]
    PYTHONPATH=.:megatron/core/distributed/fsdp/src python examples/fp8/benchmark_fp8.py --part gpu  # one GPU
    python examples/fp8/benchmark_fp8.py --part gpu --smoke      # part 3's code paths on the CPU, tiny
    python examples/fp8/benchmark_fp8.py --part gpu-diagnostics  # where one FP8 linear's time goes (one GPU)

Part 1 trains the README's tiny GPT (4 layers, hidden 128, seq 128, swiglu, rope) with `pretrain_gpt.py` on
`--nproc` gloo ranks with the distributed optimizer and with Megatron-FSDP ZeRO-3 (`optim_grads_params`), once
per arm and repetition (arms interleaved), and reports the median iteration time (first 3 iterations dropped)
and the bytes all-gathered per step: the size of every gathered output, counted by wrapping, in each rank, the
call that does the parameter all-gather (`torch.distributed.all_gather_into_tensor` for the distributed
optimizer, `megatron_fsdp.collectives.all_gather_flat` and `all_gather_pieces_in_place` for Megatron-FSDP, which
gathers point-to-point on gloo).
`--wrappers` restricts part 1 to one of them. Part 2 times one linear layer's forward + backward (fp32
`F.linear`, FP8 through `torch._scaled_mm`, FP8 emulated); `--skip-gemm` leaves it out (part 1's table is printed
first either way).

Part 3 (`--part gpu`, one GPU): FP8 against bf16 with the torch-native backend, per linear layer (the GPT-1.3B
shapes; torchao's compiled Float8Linear too when torchao is importable) and `pretrain_gpt.py` end to end (GPT 24
layers x 2048 hidden) under Megatron DDP and Megatron-FSDP z3; see `examples/fp8/gpu_benchmark.py`. `--smoke` runs
part 3's code paths on the CPU with tiny shapes (a check of the program, not a measurement). Where no FP8-capable
GPU is present part 3 prints why it was skipped.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

TINY_GPT = (
    "--num-layers 4 --hidden-size 128 --num-attention-heads 4 --seq-length 128 --max-position-embeddings 128 "
    "--position-embedding-type rope --normalization RMSNorm --swiglu --hidden-dropout 0 --attention-dropout 0 "
    "--make-vocab-size-divisible-by 64 --micro-batch-size 8 --global-batch-size 16 --lr 3e-3 --seed 1234 "
    "--mock-data --vocab-size 257 --num-workers 0 --log-interval 1000 --eval-iters 0 --distributed-backend gloo"
)
DISTRIBUTED_OPTIMIZER = "--ckpt-format torch --use-distributed-optimizer"
MEGATRON_FSDP_Z3 = "--ckpt-format torch_dist --use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params"
TENSORWISE = "--fp8-format hybrid --fp8-recipe tensorwise"
ARMS = {
    "fp32": DISTRIBUTED_OPTIMIZER,
    "fp8 tensorwise": f"{DISTRIBUTED_OPTIMIZER} {TENSORWISE}",
    "fp8 tensorwise, emulated GEMMs": f"{DISTRIBUTED_OPTIMIZER} {TENSORWISE}",
    "fp8 delayed": f"{DISTRIBUTED_OPTIMIZER} --fp8-format hybrid --fp8-recipe delayed --fp8-amax-history-len 16 "
                   "--fp8-amax-compute-algo max",
    "fp8 tensorwise + --fp8-param-gather": f"{DISTRIBUTED_OPTIMIZER} {TENSORWISE} --fp8-param-gather",
    "Megatron-FSDP z3, fp8 tensorwise": f"{MEGATRON_FSDP_Z3} {TENSORWISE}",
    "Megatron-FSDP z3, fp8 tensorwise + --fp8-param-gather": f"{MEGATRON_FSDP_Z3} {TENSORWISE} --fp8-param-gather",
}
EMULATED_ARMS = {"fp8 tensorwise, emulated GEMMs"}
WRAPPERS = {"distributed-optimizer": DISTRIBUTED_OPTIMIZER, "megatron-fsdp": MEGATRON_FSDP_Z3}
# The arm each arm's bytes are compared with: the fp32 run of the same wrapper (FP8 without parameter gathering
# all-gathers the same bytes as fp32, so it stands for fp32 under Megatron-FSDP).
BASELINES = {name: ("Megatron-FSDP z3, fp8 tensorwise" if MEGATRON_FSDP_Z3 in args else "fp32")
             for name, args in ARMS.items()}
WARMUP_ITERATIONS = 3


# ---- worker (one rank of one arm, started by torchrun) -------------------------------------------------------------


def worker(argv, counts_path, emulate):
    sys.path.insert(0, REPO_ROOT)
    import contextlib

    import torch.distributed as dist

    import pretrain_gpt
    from megatron.core.enums import ModelType
    from megatron.core.fp8_utils import force_fp8_gemm_emulation
    from megatron.training.training import pretrain

    gathered = []

    def counting(original):
        def counting_all_gather(output, input_, *args, **kwargs):
            gathered.append([str(output.dtype), output.numel() * output.element_size()])
            return original(output, input_, *args, **kwargs)

        return counting_all_gather

    if "--use-megatron-fsdp" in argv.split():
        import megatron_fsdp.collectives

        megatron_fsdp.collectives.all_gather_flat = counting(megatron_fsdp.collectives.all_gather_flat)
        gather_in_place = megatron_fsdp.collectives.all_gather_pieces_in_place

        def counting_in_place(outputs_by_rank, own_pieces, *args, **kwargs):  # fp32 groups, gathered into place
            views = [view for views in outputs_by_rank for view in views]
            gathered.append([str(views[0].dtype), sum(v.numel() * v.element_size() for v in views)])
            return gather_in_place(outputs_by_rank, own_pieces, *args, **kwargs)

        megatron_fsdp.collectives.all_gather_pieces_in_place = counting_in_place
    else:
        dist.all_gather_into_tensor = counting(dist.all_gather_into_tensor)
    context = force_fp8_gemm_emulation() if emulate else contextlib.nullcontext()
    with context:
        pretrain(pretrain_gpt.train_valid_test_datasets_provider, pretrain_gpt.model_provider,
                 ModelType.encoder_or_decoder, pretrain_gpt.forward_step, argv=argv.split())
    if int(os.environ.get("RANK", "0")) == 0:
        with open(counts_path, "w") as out:
            json.dump(gathered, out)


# ---- driver ----------------------------------------------------------------------------------------------------------


def launch(name, argv, nproc, workdir, emulate=False):
    """Train one arm under torchrun; returns (metrics rows, [dtype, bytes] of every counted all-gather)."""
    metrics = os.path.join(workdir, "metrics.jsonl")
    counts = os.path.join(workdir, "gathers.json")
    for path in (metrics, counts):
        if os.path.exists(path):
            os.remove(path)
    command = [
        sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", "--standalone",
        os.path.abspath(__file__), "--worker", f"{argv} --metrics-file {metrics}", "--counts", counts,
    ] + (["--emulate"] if emulate else [])
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // nproc))}
    completed = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True)
    if completed.returncode != 0:
        raise RuntimeError(f"arm {name!r} failed:\n{completed.stderr[-4000:]}")
    with open(metrics) as records:
        rows = [json.loads(line) for line in records]
    with open(counts) as gathers:
        return rows, json.load(gathers)


def run_arm(name, iters, nproc, workdir):
    argv = f"{TINY_GPT} --train-iters {iters} {ARMS[name]}"
    rows, gathered = launch(name, argv, nproc, workdir, emulate=name in EMULATED_ARMS)
    times = [row["iteration-time"] for row in rows[WARMUP_ITERATIONS:]]
    gathered_bytes = sum(size for _, size in gathered)
    fp8_bytes = sum(size for dtype, size in gathered if dtype == "torch.uint8")
    # The distributed optimizer gathers once per step, and its FP8 parameters add one start-up round; Megatron-FSDP
    # ZeRO-3 gathers each unit in forward and in backward, and nothing at start-up.
    rounds = iters + (1 if fp8_bytes and "--use-megatron-fsdp" not in ARMS[name] else 0)
    return {
        "median_step_s": statistics.median(times),
        "gathered_bytes_per_step": gathered_bytes / rounds,
        "fp8_bytes_per_step": fp8_bytes / rounds,
        "final_loss": rows[-1]["lm loss"],
    }


def time_linear(tokens, features, repeats):
    """Median seconds of forward + backward of one [tokens, features] x [features, features] linear."""
    import torch
    import torch.nn.functional as F

    from megatron.core.fp8_utils import (Fp8RecipeSettings, LinearScaling, force_fp8_gemm_emulation,
                                         force_fp8_scaled_mm, fp8_linear, get_fp8_format)

    torch.manual_seed(0)
    x = torch.randn(tokens, features, requires_grad=True)
    weight = torch.randn(features, features, requires_grad=True)
    grad = torch.randn(tokens, features)
    scaling = LinearScaling(Fp8RecipeSettings(get_fp8_format("hybrid"), "tensorwise"), "none")

    def fp32():
        F.linear(x, weight).backward(grad)

    def fp8():
        with force_fp8_scaled_mm():  # the CPU default is emulation; time torch's kernel here
            fp8_linear(x, weight, None, scaling).backward(grad)

    def emulated():
        with force_fp8_gemm_emulation():
            fp8_linear(x, weight, None, scaling).backward(grad)

    results = {}
    for name, step in (("fp32 F.linear", fp32), ("fp8 torch._scaled_mm", fp8), ("fp8 emulated", emulated)):
        step()
        samples = []
        for _ in range(repeats):
            start = time.perf_counter()
            step()
            samples.append(time.perf_counter() - start)
        results[name] = statistics.median(samples)
    return results


def parse_options(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--output", default=None)
    parser.add_argument("--wrappers", choices=["all", *WRAPPERS], default="all",
                        help="run only the arms of one data-parallel wrapper")
    parser.add_argument("--part", choices=["all", "cpu", "gpu", "gpu-diagnostics"], default="all",
                        help="cpu: parts 1-2 (gloo ranks, GEMMs on the CPU); gpu: part 3 (FP8 vs bf16 on one GPU); "
                             "gpu-diagnostics: where one FP8 linear's time goes on one GPU (not part of 'all')")
    parser.add_argument("--skip-gemm", action="store_true",
                        help="part 1 only on the CPU: skip part 2's per-linear timing (torch._scaled_mm's CPU kernel "
                             "takes seconds per GEMM on some x86 CPUs)")
    parser.add_argument("--skip-pretrain", action="store_true",
                        help="part 3 without its pretrain_gpt.py runs (the per-linear table only)")
    parser.add_argument("--pretrain-only", action="store_true",
                        help="part 3's pretrain_gpt.py runs only (no per-linear table)")
    parser.add_argument("--smoke", action="store_true",
                        help="part 3 on the CPU with tiny shapes and a tiny model: checks the program, "
                             "measures nothing")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--counts", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--emulate", action="store_true", help=argparse.SUPPRESS)
    options = parser.parse_args(argv)
    if options.worker is None and options.part in ("all", "cpu") and options.iters <= WARMUP_ITERATIONS:
        parser.error(f"--iters {options.iters}: the step time is the median over the iterations after the first "
                     f"{WARMUP_ITERATIONS}; give --iters {WARMUP_ITERATIONS + 1} or more")
    return options


def main():
    options = parse_options()
    if options.worker is not None:
        worker(options.worker, options.counts, options.emulate)
        return

    sys.path.insert(0, REPO_ROOT)
    report = {"iters": options.iters, "repeats": options.repeats, "nproc": options.nproc}
    if options.part in ("all", "cpu"):
        report.update(run_cpu_parts(options))
    if options.part in ("all", "gpu"):
        from examples.fp8 import gpu_benchmark

        report["gpu"] = gpu_benchmark.run(smoke=options.smoke, skip_pretrain=options.skip_pretrain,
                                           pretrain_only=options.pretrain_only)
    if options.part == "gpu-diagnostics":
        from examples.fp8 import gpu_diagnostics

        report["gpu_diagnostics"] = gpu_diagnostics.run(smoke=options.smoke)
    if options.output:
        with open(options.output, "w") as out:
            json.dump(report, out, indent=2)


def run_cpu_parts(options):
    selected = [name for name, args in ARMS.items()
                if options.wrappers == "all" or WRAPPERS[options.wrappers] in args]
    samples = {name: [] for name in selected}
    with tempfile.TemporaryDirectory() as workdir:
        for _ in range(options.repeats):
            for name in selected:  # interleaved, so drift on a shared machine hits every arm alike
                samples[name].append(run_arm(name, options.iters, options.nproc, workdir))
    arms = {}
    for name, runs in samples.items():
        arms[name] = {
            "median_step_s": statistics.median(run["median_step_s"] for run in runs),
            "gathered_bytes_per_step": runs[0]["gathered_bytes_per_step"],
            "fp8_bytes_per_step": runs[0]["fp8_bytes_per_step"],
            "final_loss": runs[0]["final_loss"],
        }
    print(f"pretrain_gpt.py, README tiny GPT, {options.nproc} gloo ranks, "
          f"{options.iters} iterations x {options.repeats} interleaved repetitions; 'vs' compares with the arm named")
    print("| arm | median step (ms) | all-gathered per step (bytes) | of which FP8 | vs | bytes vs | loss at end |")
    print("|---|---|---|---|---|---|---|")
    for name, arm in arms.items():
        base = arms.get(BASELINES[name])
        ratio = f"{arm['gathered_bytes_per_step'] / base['gathered_bytes_per_step']:.3f}" if base else "-"
        print(f"| {name} | {1000 * arm['median_step_s']:.1f} | {arm['gathered_bytes_per_step']:,.0f} | "
              f"{arm['fp8_bytes_per_step']:,.0f} | {BASELINES[name]} | {ratio} | {arm['final_loss']:.4f} |", flush=True)
    if options.skip_gemm:
        return {"arms": arms}
    import torch

    torch.set_num_threads(max(1, (os.cpu_count() or 1)))
    gemm = {f"{tokens}x{features}": time_linear(tokens, features, 5)
            for tokens, features in ((2048, 128), (4096, 1024))}
    print("\none linear layer, forward + backward (median of 5)")
    print("| tokens x features | fp32 F.linear (ms) | fp8 torch._scaled_mm (ms) | fp8 emulated (ms) |")
    print("|---|---|---|---|")
    for shape, timings in gemm.items():
        print(f"| {shape} | " + " | ".join(f"{1000 * timings[name]:.2f}" for name in
                                          ("fp32 F.linear", "fp8 torch._scaled_mm", "fp8 emulated")) + " |")
    return {"arms": arms, "gemm_forward_backward_s": gemm}


if __name__ == "__main__":
    main()
