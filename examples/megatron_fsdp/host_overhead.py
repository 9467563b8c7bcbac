"""Host time a step costs under each data-parallel wrapper on one rank, where nothing is communicated: the step's
CPU time is the model's own work plus the wrapper's bookkeeping (hooks, buffers, gradient copies), the part that
decides the step time once a GPU runs ahead of the host (an FP8 step, say).

One process of one rank and one intra-op thread builds every arm's model and optimizer from the same flags and
seed (a GPT of 24 layers, as the GPU runs' model, but hidden 64, so that host work is most of a step), then takes
one `train_step` of each arm in turn, the order alternating, as `examples/moe/benchmark_interleaved.py` does, and
prints each arm's median step, its median CPU time, the ratio to DDP and the last step's loss (the arms train the
same model on the same data: the losses agree to rounding).

    python examples/megatron_fsdp/host_overhead.py [--steps 40] [--warmup 5] [--arms DDP "Megatron-FSDP z3" FSDP2]
"""

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPOSITORY = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, REPOSITORY)

from examples.moe import benchmark_interleaved as interleaved  # noqa: E402

MODEL = ("--num-layers 24 --hidden-size 64 --num-attention-heads 4 --seq-length 64 --max-position-embeddings 64 "
         "--micro-batch-size 2 --global-batch-size 8 --lr 1e-3 --hidden-dropout 0 --attention-dropout 0 "
         "--untie-embeddings-and-output-weights --mock-data --tokenizer-type NullTokenizer --vocab-size 512 "
         "--seed 1234 --num-workers 0 --log-interval 1000 --eval-iters 0 --distributed-backend gloo")
ARMS = {
    "DDP": "",
    "distributed optimizer": "--use-distributed-optimizer",
    "Megatron-FSDP z3": "--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params",
    "FSDP2": "--use-torch-fsdp2",
}


def one_thread_worker(names, flags, steps, warmup):
    import torch

    import megatron.training.initialize as initialize

    initialize.set_cpu_threads = lambda: torch.set_num_threads(1)  # one thread: the host's own time, unshared
    interleaved.worker(names, flags, steps, warmup)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--arms", nargs="+", choices=list(ARMS), default=["DDP", "Megatron-FSDP z3", "FSDP2"],
                        help="arms to interleave (DDP, the reference of the ratios, always runs)")
    options = parser.parse_args()
    if options.steps <= options.warmup:
        parser.error(f"--steps ({options.steps}) must exceed --warmup ({options.warmup})")
    names = ["DDP"] + [name for name in ARMS if name in options.arms and name != "DDP"]
    arms = [(name, f"{MODEL} {ARMS[name]} --train-iters {options.steps}") for name in names]
    interleaved.launch_job(__file__, 1, options.steps, options.warmup, arms)


if __name__ == "__main__":
    interleaved.run_script(one_thread_worker, main)
