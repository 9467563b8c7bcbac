"""Time to wrap a model and take its first steps: Megatron-FSDP ZeRO-3 against torch DDP and torch FSDP2.

    torchrun --nproc-per-node 2 examples/megatron_fsdp/setup_time.py [--layers 24] [--hidden 64] [--repeats 3]

Every arm builds the same GPT (`bench_model.py`, fp32) from the same seed and times, on each rank, the wrap (the
wrapper and its optimizer), the first training step and the median of the next steps; the slowest rank's time
counts. The arms run interleaved (every arm once, then every arm again; a first round is not counted), each
after clearing DTensor's sharding-propagation cache, so that each one starts as cold as in a fresh process. One
more arm builds Megatron-FSDP's resting parameters through `nn.Parameter` (which detaches each DTensor, through
DTensor's dispatch) instead of `dtensor_parameter`, to show what that costs; and, apart, the two ways are timed
on parameters of as many shapes (`--shapes`). Another runs FSDP2 with Megatron's `ShardLocalAdamW` (AdamW on the
DTensors' local shards, which `--use-torch-fsdp2` builds) instead of torch's AdamW on the DTensors. Rank 0 prints
a markdown table.
"""

import argparse
import contextlib
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

from examples.megatron_fsdp.bench_arms import ARMS, build_arm  # noqa: E402
from examples.megatron_fsdp.bench_model import GPTBenchConfig, build_model, mock_batches, rank_micro_batch  # noqa: E402

ARM_NAMES = ("ddp", "fsdp2", "fsdp2_shard_local_adam", "mfsdp3", "mfsdp3_nn_parameter")
LABELS = {
    "ddp": "torch DDP",
    "fsdp2": "torch FSDP2 (fully_shard per block + root)",
    "fsdp2_shard_local_adam": "torch FSDP2 with ShardLocalAdamW (as `--use-torch-fsdp2` builds it)",
    "mfsdp3": "Megatron-FSDP ZeRO-3",
    "mfsdp3_nn_parameter": "Megatron-FSDP ZeRO-3, resting parameters through nn.Parameter",
}


def _clear_dtensor_caches():
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    _clear_sharding_prop_cache()


class _ShardLocalAdamW:
    """Makes the benchmark's arms build Megatron's `ShardLocalAdamW` (which steps DTensors through their local
    shards) instead of torch's AdamW while active."""

    def __enter__(self):
        from examples.megatron_fsdp import bench_arms
        from megatron.core.optimizer.shard_local_adam import ShardLocalAdamW

        self._module = bench_arms
        self._original = bench_arms._adamw
        bench_arms._adamw = lambda params, lr: ShardLocalAdamW(params, lr=lr, weight_decay=0.01)
        return self

    def __exit__(self, *exc_info):
        self._module._adamw = self._original
        return False


class _RestingThroughNNParameter:
    """Makes Megatron-FSDP build its resting parameters with `nn.Parameter(dtensor)` while active."""

    def __enter__(self):
        from megatron_fsdp import resting_parameters

        self._module = resting_parameters
        self._original = resting_parameters.dtensor_parameter
        resting_parameters.dtensor_parameter = lambda dtensor, requires_grad: torch.nn.Parameter(
            dtensor, requires_grad=requires_grad)
        return self

    def __exit__(self, *exc_info):
        self._module.dtensor_parameter = self._original
        return False


# Arms that are another arm built under a context manager: {arm: (base arm, context manager class)}.
VARIANTS = {"mfsdp3_nn_parameter": ("mfsdp3", _RestingThroughNNParameter),
            "fsdp2_shard_local_adam": ("fsdp2", _ShardLocalAdamW)}


def _step(model, optimizer, tokens, labels):
    optimizer.zero_grad()
    loss = model(tokens, labels)  # the bench model returns its mean cross-entropy
    loss.backward()
    optimizer.step()
    return loss.detach()


def _slowest(seconds):
    value = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return value.item()


def measure_arm(name, config, steps, device):
    """(wrap, first step, median later step) seconds of one arm (the slowest rank's), its parameter count and
    this rank's loss of the last step."""
    base, variant = VARIANTS.get(name, (name, contextlib.nullcontext))
    spec = ARMS[base]
    rank, world = dist.get_rank(), dist.get_world_size()
    tokens = mock_batches(config, steps, seed=1)
    model = build_model(config, seed=0, device=device)
    parameters = sum(1 for _ in model.parameters())
    _clear_dtensor_caches()
    dist.barrier()
    started = time.perf_counter()
    with variant():
        model, optimizer = build_arm(spec, model, device, lr=1e-4)
    wrap = _slowest(time.perf_counter() - started)
    step_times = []
    for step in range(steps):
        batch = rank_micro_batch(tokens, step, rank, world, device)
        dist.barrier()
        started = time.perf_counter()
        loss = _step(model, optimizer, *batch)
        step_times.append(_slowest(time.perf_counter() - started))
    del model, optimizer
    return wrap, step_times[0], statistics.median(step_times[1:]), parameters, loss.item()


def measure(config, arms, steps, repeats, device, uncounted_rounds=1):
    """{arm: [(wrap, first step, later step, parameters, last loss) per repeat]}, arms interleaved repeat by
    repeat, after `uncounted_rounds` rounds that are not counted (the first pays the imports and the one-time
    set-up of each wrapper's code)."""
    results = {arm: [] for arm in arms}
    for repeat in range(uncounted_rounds + repeats):
        for arm in arms:
            measured = measure_arm(arm, config, steps, device)
            if repeat >= uncounted_rounds:
                results[arm].append(measured)
    return results


def measure_parameter_construction(count, device):
    """Seconds (the slowest rank's) to make `count` Shard(0) DTensors of `count` different shapes parameters, through
    `nn.Parameter` and through `dtensor_parameter`, each from a cold sharding-propagation cache."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from megatron_fsdp.dtensor_views import dtensor_parameter

    world = dist.get_world_size()
    mesh = init_device_mesh(device.type, (world,))
    shapes = [(world * (8 + index), 32) for index in range(count)]
    seconds = {}
    for way in ("nn.Parameter", "dtensor_parameter"):
        dtensors = [DTensor.from_local(torch.zeros(rows // world, columns, device=device), mesh, [Shard(0)],
                                       run_check=False, shape=torch.Size((rows, columns)), stride=(columns, 1))
                    for rows, columns in shapes]
        _clear_dtensor_caches()
        dist.barrier()
        started = time.perf_counter()
        for dtensor in dtensors:
            if way == "nn.Parameter":
                torch.nn.Parameter(dtensor, requires_grad=True)
            else:
                dtensor_parameter(dtensor, True)
        seconds[way] = _slowest(time.perf_counter() - started)
    return seconds


def render(results, config, world, steps, repeats):
    lines = [
        f"{config.num_layers} layers, hidden {config.hidden_size}, {world} ranks, fp32, AdamW; median of {repeats} "
        f"interleaved repeats; step = median of steps 2-{steps}",
        "",
        "| arm | parameters | wrap (ms) | first step (ms) | later step (ms) | wrap + first step vs DDP |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    medians = {arm: [statistics.median(run[i] for run in runs) for i in range(3)] for arm, runs in results.items()}
    ddp = medians.get("ddp")
    for arm, runs in results.items():
        wrap, first, later = medians[arm]
        ratio = f"{(wrap + first) / (ddp[0] + ddp[1]):.2f}" if ddp else "-"
        lines.append(f"| {LABELS[arm]} | {runs[0][3]} | {wrap * 1e3:.1f} | {first * 1e3:.1f} | {later * 1e3:.1f} "
                     f"| {ratio} |")
    return "\n".join(lines)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=24, help="transformer blocks (default 24)")
    parser.add_argument("--hidden", type=int, default=64, help="hidden size (default 64; 4 heads)")
    parser.add_argument("--steps", type=int, default=4, help="training steps per arm (default 4, at least 2)")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved repeats (default 3)")
    parser.add_argument("--arms", nargs="+", default=list(ARM_NAMES), choices=ARM_NAMES)
    parser.add_argument("--shapes", type=int, default=40,
                        help="parameters of distinct shapes in the construction measurement (default 40; 0: none)")
    args = parser.parse_args(argv)
    if args.steps < 2:
        parser.error("--steps must be at least 2 (the first step is reported apart)")
    return args


def main(argv=None):
    args = parse_args(argv)
    if "RANK" not in os.environ:
        raise SystemExit("run under torchrun: torchrun --nproc-per-node 2 examples/megatron_fsdp/setup_time.py")
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    config = GPTBenchConfig(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=4, seq_length=64,
                            vocab_size=512)
    try:
        results = measure(config, args.arms, args.steps, args.repeats, torch.device("cpu"))
        construction = measure_parameter_construction(args.shapes, torch.device("cpu")) if args.shapes else None
        if dist.get_rank() == 0:
            print(render(results, config, dist.get_world_size(), args.steps, args.repeats))
            if construction:
                print(f"\n{args.shapes} Shard(0) DTensors of {args.shapes} shapes made parameters from a cold cache: "
                      + ", ".join(f"{way} {value * 1e3:.1f} ms" for way, value in construction.items()))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
