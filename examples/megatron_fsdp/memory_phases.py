"""Where in a step the resident memory peaks: RSS per training phase for one benchmark arm.

    python examples/megatron_fsdp/memory_phases.py --arm mfsdp3 --model small --steps 3

Starts two gloo ranks (fresh processes, allocator-neutral: `MALLOC_MMAP_THRESHOLD_=65536` unless
`--default-malloc`), trains the arm on the benchmark model, and prints for rank 0, per phase of the last step:
the RSS when the phase starts, the live tensor bytes then (every storage reachable from Python counted once,
which includes the activations autograd keeps), and the highest RSS sampled (1 ms) during the phase.
"""

import argparse
import gc
import os
import sys
import threading
import time
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PHASES = ("zero_grad", "forward", "backward", "optimizer step")
MIB = 2 ** 20


def resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def live_tensor_bytes() -> int:
    """Bytes of every tensor storage reachable from Python, each storage once."""
    storages = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for obj in gc.get_objects():
            if isinstance(obj, torch.Tensor) and obj.device.type == "cpu":
                try:
                    storage = obj.untyped_storage()
                    key, num_bytes = storage.data_ptr(), storage.nbytes()
                except RuntimeError:  # tensors without a readable storage (placeholders, wrapper subclasses)
                    continue
                storages[key] = max(storages.get(key, 0), num_bytes)
    return sum(storages.values())


class PhaseSampler:
    """A thread that keeps the highest RSS seen while each phase runs."""

    def __init__(self):
        self.phase, self.peaks, self.running = None, {}, True
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()

    def _sample(self):
        while self.running:
            self._record(resident_bytes())
            time.sleep(0.001)

    def _record(self, rss):
        if self.phase is not None:
            self.peaks[self.phase] = max(self.peaks.get(self.phase, 0), rss)

    def enter(self, phase):
        self._record(resident_bytes())
        self.phase = phase

    def stop(self):
        self._record(resident_bytes())
        self.running = False
        self.thread.join()


def rank_main(rank, world_size, port, arm_name, model_name, steps, results):
    sys.path.insert(0, REPO_ROOT)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    from examples.megatron_fsdp.bench_arms import ARMS, build_arm
    from examples.megatron_fsdp.bench_model import MODEL_PRESETS, build_model, mock_batches, rank_micro_batch

    config = MODEL_PRESETS[model_name]
    device = torch.device("cpu")
    tokens_per_step = mock_batches(config, steps, 1)
    train_model, optimizer = build_arm(ARMS[arm_name], build_model(config, 0, device), device, 1e-4)
    sampler = PhaseSampler()
    at_start = {}
    for step in range(steps):
        tokens, labels = rank_micro_batch(tokens_per_step, step, rank, world_size, device)
        last = step == steps - 1

        def enter(phase):
            if last:
                sampler.enter(None)  # keep the gc walk out of the peaks
                at_start[phase] = (resident_bytes(), live_tensor_bytes())
                sampler.enter(phase)
                sampler.peaks[phase] = max(sampler.peaks.get(phase, 0), at_start[phase][0])

        enter("zero_grad")
        optimizer.zero_grad()
        enter("forward")
        loss = train_model(tokens, labels)
        enter("backward")
        loss.backward()
        enter("optimizer step")
        optimizer.step()
    sampler.stop()
    if rank == 0:
        results.put({phase: (at_start[phase][0], at_start[phase][1], sampler.peaks.get(phase, 0))
                     for phase in PHASES})
    dist.destroy_process_group()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arm", default="mfsdp3", help="an arm of benchmark.py (ddp, fsdp2, mfsdp3, ...)")
    parser.add_argument("--model", default="tiny", choices=("tiny", "small"))
    parser.add_argument("--steps", type=int, default=3, help="steps to run; the last one is reported")
    parser.add_argument("--port", type=int, default=29561)
    parser.add_argument("--default-malloc", action="store_true", help="keep glibc's default malloc settings")
    args = parser.parse_args(argv)
    if not args.default_malloc:
        os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"  # read by the spawned rank processes at start
    context = mp.get_context("spawn")
    results = context.SimpleQueue()
    ranks = [context.Process(target=rank_main, args=(rank, 2, args.port, args.arm, args.model, args.steps, results))
             for rank in range(2)]
    for process in ranks:
        process.start()
    report = results.get()
    for process in ranks:
        process.join()
    print(f"{args.arm} on {args.model}, rank 0, last of {args.steps} steps "
          f"({'default malloc' if args.default_malloc else 'allocator-neutral'}), MiB")
    print("| phase | RSS at start | live tensors at start | peak RSS during |")
    print("|---|---|---|---|")
    for phase in PHASES:
        rss, tensors, peak = report[phase]
        print(f"| {phase} | {rss / MIB:.0f} | {tensors / MIB:.0f} | {peak / MIB:.0f} |")


if __name__ == "__main__":
    main()
