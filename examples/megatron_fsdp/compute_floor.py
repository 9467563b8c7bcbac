"""The compute-only floor of a data-parallel step: every rank's work with no communication at all.

    python examples/megatron_fsdp/compute_floor.py [--model small] [--nproc 2] [--steps 6] [--warmup 2]

Starts `--nproc` independent processes side by side (no process group, one intra-op thread each, so they share
the machine's cores and memory bandwidth as the ranks of a benchmark run do). Each one builds the benchmark model
from the benchmark's seed, trains on its own slice of the same global batches with plain AdamW over all weights,
and times forward, backward and the optimizer step. No data-parallel arm can be faster than this; what an arm
spends above it is communication and bookkeeping.
"""

import argparse
import os
import statistics
import sys
import time

import torch
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # run as a script

from examples.megatron_fsdp.bench_model import MODEL_PRESETS, build_model, mock_batches, rank_micro_batch  # noqa: E402

PHASES = ("forward", "backward", "optimizer step")


def _worker(rank, nproc, model_name, steps, seed, lr, results):
    torch.set_num_threads(1)
    config = MODEL_PRESETS[model_name]
    device = torch.device("cpu")
    model = build_model(config, seed, device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    all_tokens = mock_batches(config, steps, seed)
    per_step = []
    for step in range(steps):
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        tokens, labels = rank_micro_batch(all_tokens, step, rank, nproc, device)
        loss = model(tokens, labels)
        forward_done = time.perf_counter()
        loss.backward()
        backward_done = time.perf_counter()
        optimizer.step()
        step_done = time.perf_counter()
        per_step.append((forward_done - start, backward_done - forward_done, step_done - backward_done))
    results[rank] = per_step


def measure(model_name, nproc, steps, warmup, seed=1234, lr=1e-4):
    """Median seconds per phase after warm-up, slowest process per step: {phase: s, "step": s}."""
    if steps <= warmup:
        raise ValueError(f"--steps ({steps}) must be larger than --warmup ({warmup})")
    results = mp.Manager().dict()
    mp.spawn(_worker, args=(nproc, model_name, steps, seed, lr, results), nprocs=nproc)
    slowest = [[max(results[rank][step][phase] for rank in range(nproc)) for phase in range(len(PHASES))]
               for step in range(warmup, steps)]
    medians = {name: statistics.median(step[index] for step in slowest) for index, name in enumerate(PHASES)}
    medians["step"] = statistics.median(sum(step) for step in slowest)
    return medians


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(MODEL_PRESETS), default="small")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()
    medians = measure(args.model, args.nproc, args.steps, args.warmup)
    print(f"compute floor, `{args.model}` model, {args.nproc} independent processes, 1 thread each, "
          f"median of {args.steps - args.warmup} steps after {args.warmup} warm-up (slowest process per step):")
    print("| forward s | backward s | optimizer step s (AdamW, all weights) | step s |")
    print("|---|---|---|---|")
    print(f"| {medians['forward']:.3f} | {medians['backward']:.3f} | {medians['optimizer step']:.3f} | "
          f"{medians['step']:.3f} |")


if __name__ == "__main__":
    main()
