"""Adam against Muon under each data-parallel wrapper on 2 CPU ranks (or `--world`): optimizer-step time,
whole step time and the Newton-Schulz share of the step, in one torchrun job.

A small fp32 GPT (4 layers, hidden 256 by default: the weight matrices are large enough for Newton-Schulz to show)
trains on mock data under Megatron DDP, the distributed optimizer, Megatron-FSDP ZeRO-3 and FSDP2, each with
`--optimizer adam` and `--optimizer muon`. Every arm is built from the same flags and seed in one job (as
`examples/moe/benchmark_interleaved.py` does) and takes pretrain_gpt.py's `train_step` in turn, in alternating
order, ranks aligned by a barrier, so drifting machine load hits all arms alike. Times are per rank, the slowest
rank's per step, then the median over the steps after `--warmup`:
- step: the whole `train_step` (forward, backward, gradient reduction, optimizer step);
- optimizer: `optimizer.step()` (gradient statistics, clipping, the update, parameter gathers of the wrapper);
- Newton-Schulz: the time inside `newton_schulz` (all iterations over all matrices this rank orthogonalizes),
  the slowest rank's; its share is of the same step's time.
Muon arms run twice when Muon can distribute Newton-Schulz over data parallel: each rank orthogonalizing a share
of the matrices ("Muon"), and every rank orthogonalizing every matrix ("Muon, NS on every rank").

    python examples/optimizer/benchmark_muon.py [--steps 12] [--warmup 3] [--hidden 256] [--layers 4]
        [--wrappers DDP FSDP2 ...] [--world 2]

Megatron-FSDP's hybrid sharding (`--wrappers "Megatron-FSDP HSDP" "Megatron-FSDP HFSDP"`: two optimizer instances,
the outer ranks replicating or also splitting the main weights) needs `--world` 4 or more.
"""

import argparse
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPOSITORY = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, REPOSITORY)
from examples.moe.benchmark_interleaved import launch_job, run_script  # noqa: E402  (the repository's examples)

WRAPPERS = {
    "DDP": "",
    "distributed optimizer": "--use-distributed-optimizer",
    "Megatron-FSDP z3": "--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params",
    "FSDP2": "--use-torch-fsdp2",
    "Megatron-FSDP HSDP": "--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params "
                          "--num-distributed-optimizer-instances 2",
    "Megatron-FSDP HFSDP": "--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params "
                           "--num-distributed-optimizer-instances 2 --outer-dp-sharding-strategy optim",
}
HYBRID_WRAPPERS = ("Megatron-FSDP HSDP", "Megatron-FSDP HFSDP")
OPTIMIZERS = ("Adam", "Muon", "Muon, NS on every rank")


def model_flags(layers, hidden, seq, steps, world):
    return (f"--num-layers {layers} --hidden-size {hidden} --num-attention-heads 4 --seq-length {seq} "
            f"--max-position-embeddings {seq} --micro-batch-size 2 --global-batch-size {2 * world} --lr 1e-3 "
            "--hidden-dropout 0 --attention-dropout 0 --mock-data --tokenizer-type NullTokenizer --vocab-size 1024 "
            "--seed 1234 --num-workers 0 --log-interval 1000 --eval-iters 0 --distributed-backend gloo "
            f"--untie-embeddings-and-output-weights --train-iters {steps}")


def _muon_optimizers(optimizer, seen=None):
    """The `MuonWithAdamW` instances inside a Megatron optimizer (chained, per chunk, wrapped)."""
    from megatron.core.optimizer.muon import MuonWithAdamW

    seen = set() if seen is None else seen
    if id(optimizer) in seen:
        return []
    seen.add(id(optimizer))
    if isinstance(optimizer, MuonWithAdamW):
        return [optimizer]
    found = []
    for name in ("optimizer", "optimizers", "chained_optimizers", "chunk_optimizers"):
        inner = getattr(optimizer, name, None)
        for item in (inner if isinstance(inner, (list, tuple)) else [inner]):
            if item is not None:
                found += _muon_optimizers(item, seen)
    return found


class _Clock:
    """Wall time accumulated inside wrapped functions since the last `take()`."""

    def __init__(self):
        self.seconds = 0.0

    def wrap(self, function):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start
        return timed

    def take(self):
        seconds, self.seconds = self.seconds, 0.0
        return seconds


def worker(arm_names, arm_flags, steps, warmup):
    import torch
    import torch.distributed as dist

    sys.path.insert(0, REPOSITORY)
    import pretrain_gpt
    from examples.moe.benchmark_interleaved import _build_arm, initialize_job
    from megatron.core.optimizer import muon
    from megatron.training.global_vars import set_args
    from megatron.training.training import train_step

    runtime = initialize_job(arm_flags[0])
    newton_schulz_clock, optimizer_clock = _Clock(), _Clock()
    muon.newton_schulz = newton_schulz_clock.wrap(muon.newton_schulz)
    arms = []
    for name, flags in zip(arm_names, arm_flags):
        args, model, optimizer, scheduler, config, iterator = _build_arm(
            flags, runtime, pretrain_gpt.model_provider, pretrain_gpt.train_valid_test_datasets_provider)
        for torch_optimizer in _muon_optimizers(optimizer):
            torch_optimizer.distribute_newton_schulz = not name.endswith("NS on every rank")
        optimizer.step = optimizer_clock.wrap(optimizer.step)
        arms.append((args, model, optimizer, scheduler, config, iterator))
    # times[arm][step] = (step, optimizer, Newton-Schulz) seconds of this rank
    times = [[] for _ in arms]
    losses = [None] * len(arms)
    for step in range(steps):
        for index in (range(len(arms)) if step % 2 == 0 else reversed(range(len(arms)))):
            args, model, optimizer, scheduler, config, iterator = arms[index]
            set_args(args)
            dist.barrier()
            newton_schulz_clock.take(), optimizer_clock.take()
            start = time.perf_counter()
            loss, _, _, _ = train_step(pretrain_gpt.forward_step, iterator, model, optimizer, scheduler, config, args)
            times[index].append((time.perf_counter() - start, optimizer_clock.take(), newton_schulz_clock.take()))
            losses[index] = loss
    slowest = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    if dist.get_rank() == dist.get_world_size() - 1:  # the last rank holds the loss, as in the training log
        report(arm_names, slowest[:, warmup:], losses)


def report(arm_names, times, losses):
    """`times[arm, step]`: (step, optimizer, Newton-Schulz) seconds, each the slowest rank's."""
    adam_step = {name.split(" / ")[0]: statistics.median(times[index, :, 0].tolist())
                 for index, name in enumerate(arm_names) if name.endswith(" / Adam")}
    print("| wrapper | optimizer | step (ms) | vs Adam | optimizer step (ms) | Newton-Schulz (ms) | "
          "NS share of step | lm loss, last step |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for index, name in enumerate(arm_names):
        wrapper, optimizer = name.split(" / ")
        step, optimizer_step, newton_schulz = (statistics.median(times[index, :, column].tolist())
                                               for column in range(3))
        share = statistics.median((times[index, :, 2] / times[index, :, 0]).tolist())
        loss = losses[index].get("lm loss") if isinstance(losses[index], dict) else losses[index]
        loss_text = f"{float(loss):.6f}" if loss is not None else "n/a"
        print(f"| {wrapper} | {optimizer} | {1000 * step:.0f} | {step / adam_step[wrapper]:.2f} | "
              f"{1000 * optimizer_step:.0f} | {1000 * newton_schulz:.0f} | {100 * share:.0f}% | {loss_text} |")
    print(f"\nmedians over {times.shape[1]} steps per arm")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--wrappers", nargs="+", choices=list(WRAPPERS),
                        default=[name for name in WRAPPERS if name not in HYBRID_WRAPPERS])
    parser.add_argument("--world", type=int, default=2, help="CPU ranks (data parallel)")
    parser.add_argument("--optimizers", nargs="+", choices=OPTIMIZERS, default=list(OPTIMIZERS),
                        help="Adam, the reference of the ratios, always runs")
    options = parser.parse_args()
    if options.steps <= options.warmup:
        parser.error(f"--steps ({options.steps}) must exceed --warmup ({options.warmup})")
    hybrid = [name for name in options.wrappers if name in HYBRID_WRAPPERS]
    if hybrid and (options.world < 4 or options.world % 2):
        parser.error(f"{hybrid} shard over two optimizer instances of at least two ranks: pass an even --world of "
                     f"at least 4 (got {options.world})")
    sys.path.insert(0, REPOSITORY)
    from megatron.core.optimizer.muon import MuonWithAdamW

    optimizers = [name for name in OPTIMIZERS if name in options.optimizers or name == "Adam"]
    if not hasattr(MuonWithAdamW, "distribute_newton_schulz"):  # Muon that always orthogonalizes on every rank
        optimizers = [name for name in optimizers if name != "Muon, NS on every rank"]
    arms = [(f"{wrapper} / {optimizer}",
             model_flags(options.layers, options.hidden, options.seq, options.steps, options.world)
             + " " + WRAPPERS[wrapper] + " --optimizer " + optimizer.split(",")[0].lower())
            for wrapper in options.wrappers for optimizer in optimizers]
    launch_job(__file__, options.world, options.steps, options.warmup, arms)


if __name__ == "__main__":
    run_script(worker, main)
