"""What gathers and reductions cost on gloo: torch's stock collectives against Megatron-FSDP's point-to-point ones.

    python examples/megatron_fsdp/gloo_collective_costs.py [--nproc 2] [--shard-mib 13.5] [--calls 14] [--out F]

Starts `--nproc` gloo ranks (fresh processes, one intra-op thread each) and times, per implementation, `--calls`
back-to-back collectives on buffers the size of one unit of the benchmark's `small` model (a 13.5 MiB shard per
rank, 14 calls ~ one ZeRO-3 forward's all-gathers): wall time, and CPU time of the whole process (every thread,
so gloo's own I/O threads count). Every result is checked against the stock collective's. On a machine whose
cores are all busy computing, a collective's CPU time is what it adds to a training step, overlapped or not.
"""

import argparse
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

MIB = 1024 * 1024
# Newer torch names the flat collectives `*_single` and deprecates the `*_tensor` names.
STOCK_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
STOCK_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _free_port():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _implementations(world, shard_numel):
    """(kind, label, run, check) per implementation, and a function that poisons every output buffer (so a
    check can only pass on what the implementation under test wrote)."""
    from megatron_fsdp import collectives

    counter = collectives.CommunicationCounter()
    group = dist.group.WORLD
    shard = torch.randn(shard_numel)
    full = torch.randn(world * shard_numel)
    gathered = torch.empty(world * shard_numel)
    reduced = torch.empty(shard_numel)
    summed = torch.empty_like(full)

    def stock_all_gather():
        STOCK_ALL_GATHER(gathered, shard)

    def p2p_all_gather():
        collectives.all_gather_flat(gathered, shard, group, counter)

    def stock_reduce_scatter():
        STOCK_REDUCE_SCATTER(reduced, full)

    def p2p_reduce_scatter():
        collectives.reduce_scatter_flat(reduced, full, group, counter)

    def stock_all_reduce():
        summed.copy_(full)
        dist.all_reduce(summed)

    def check_gather():
        expected = torch.empty_like(gathered)
        STOCK_ALL_GATHER(expected, shard)
        return torch.equal(expected, gathered)

    def check_reduction():
        expected = full.clone()
        dist.all_reduce(expected)
        rank = dist.get_rank()
        return torch.allclose(expected[rank * shard_numel:(rank + 1) * shard_numel], reduced, rtol=1e-6, atol=1e-6)

    def poison_outputs():
        for output in (gathered, reduced, summed):
            output.fill_(float("nan"))

    return poison_outputs, [
        ("all-gather", "torch (gloo all_gather_into_tensor)", stock_all_gather, check_gather),
        ("all-gather", "megatron_fsdp (point-to-point)", p2p_all_gather, check_gather),
        ("reduce-scatter", "torch (gloo reduce_scatter_tensor)", stock_reduce_scatter, check_reduction),
        ("reduce-scatter", "megatron_fsdp (point-to-point)", p2p_reduce_scatter, check_reduction),
        ("all-reduce", "torch (gloo all_reduce)", stock_all_reduce, lambda: True),
    ]


def _worker(rank, world, port, shard_numel, calls, repeats, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        measured = {}
        for _ in range(repeats):
            poison_outputs, implementations = _implementations(world, shard_numel)
            for kind, label, run, check in implementations:
                poison_outputs()
                dist.barrier()
                wall_start, cpu_start = time.perf_counter(), time.process_time()
                for _ in range(calls):
                    run()
                wall, cpu = time.perf_counter() - wall_start, time.process_time() - cpu_start
                if not check():
                    raise RuntimeError(f"{label} {kind} gave a wrong result on rank {rank}")
                measured.setdefault((kind, label), []).append((wall, cpu))
        results[rank] = measured
    finally:
        dist.destroy_process_group()


def measure(nproc, shard_numel, calls, repeats):
    """{(kind, implementation): (median wall s, median CPU s)}, slowest rank, over `repeats` interleaved runs."""
    manager = mp.Manager()
    results = manager.dict()
    mp.spawn(_worker, args=(nproc, _free_port(), shard_numel, calls, repeats, results), nprocs=nproc)
    table = {}
    for key in results[0]:
        walls = [max(results[rank][key][rep][0] for rank in range(nproc)) for rep in range(repeats)]
        cpus = [max(results[rank][key][rep][1] for rank in range(nproc)) for rep in range(repeats)]
        table[key] = (statistics.median(walls), statistics.median(cpus))
    return table


def render(table, nproc, shard_numel, calls, repeats):
    shard_mib = shard_numel * 4 / MIB
    lines = [
        f"{calls} back-to-back calls, {nproc} gloo ranks, fp32 shard of {shard_mib:.1f} MiB per rank (the reduce-scatter "
        f"input and the all-reduced buffer hold {nproc} shards); slowest rank, median of {repeats} interleaved "
        "repetitions. CPU = process CPU time, all threads.",
        "",
        "| collective | implementation | wall s | CPU s | CPU vs torch's |",
        "|---|---|---|---|---|",
    ]
    stock_cpu = {kind: cpu for (kind, label), (_, cpu) in table.items() if label.startswith("torch")}
    for (kind, label), (wall, cpu) in table.items():
        lines.append(f"| {kind} | {label} | {wall:.3f} | {cpu:.3f} | {cpu / stock_cpu[kind]:.2f} |")
    return "\n".join(lines) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--shard-mib", type=float, default=13.5, help="fp32 shard per rank, MiB")
    parser.add_argument("--calls", type=int, default=14)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", help="append the table to this markdown file")
    args = parser.parse_args()
    if args.nproc < 2:
        parser.error("--nproc must be at least 2: a single rank sends nothing")
    shard_numel = int(args.shard_mib * MIB / 4)
    table = measure(args.nproc, shard_numel, args.calls, args.repeats)
    text = render(table, args.nproc, shard_numel, args.calls, args.repeats)
    print(text)
    if args.out:
        with open(args.out, "a") as handle:
            handle.write("\n" + text)


if __name__ == "__main__":
    main()
