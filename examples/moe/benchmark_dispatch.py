"""Bytes the alltoall token dispatcher sends per step at EP2 on 2 CPU ranks, against theory.

Trains pretrain_gpt.py (mock data, the model of `benchmark_wrappers.py`: 2 layers, hidden 128, 8 experts, top-2,
alltoall dispatch) under Megatron DDP at EP2, with every `all_to_all_single` issued by
`megatron/core/transformer/moe/collectives.py` counted on each rank: the bytes of the rows bound for the other
ranks (a rank's own block never leaves it), by phase: the forward dispatch (tokens to their experts), the forward
combine (expert outputs back), and their backwards (the combine's backward sends the output gradients to the
experts, the dispatch's backward sends the input gradients back). Theory, per rank and step, each of the four:

    tokens x topk x hidden x (EP - 1) / EP x bytes per element

(with `--moe-latent-size L`, latent MoE, the tokens travel at the latent width: L in place of hidden), with tokens =
the rank's tokens per step (global batch / DP x seq length) and every layer counted; it assumes the
router spreads the token-expert pairs evenly over the expert-parallel ranks, so the measured bytes move with the
routing (the aux loss keeps it near even). Prints a markdown table of the per-step mean over the iterations.

    python examples/moe/benchmark_dispatch.py [--iters 10] [--moe-latent-size 32]
"""

import argparse
import json
import os
import runpy
import subprocess
import sys
import tempfile

REPOSITORY = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LAYERS, HIDDEN, FFN, EXPERTS, TOPK, WORLD, EXPERT_PARALLEL = 2, 128, 256, 8, 2, 2, 2
SEQ, GLOBAL_BATCH, BYTES_PER_ELEMENT = 64, 16, 4  # fp32
MODEL = (f"--num-layers {LAYERS} --hidden-size {HIDDEN} --num-attention-heads 4 --seq-length {SEQ} "
         f"--max-position-embeddings {SEQ} --micro-batch-size 4 --global-batch-size {GLOBAL_BATCH} --lr 1e-3 "
         f"--hidden-dropout 0 --attention-dropout 0 --mock-data --tokenizer-type NullTokenizer --vocab-size 1024 "
         f"--seed 1234 --num-workers 0 --log-interval 1000 --eval-interval 100000 --eval-iters 0 "
         f"--distributed-backend gloo --num-experts {EXPERTS} --moe-router-topk {TOPK} --moe-ffn-hidden-size {FFN} "
         f"--moe-token-dispatcher-type alltoall --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 0.01 "
         f"--expert-model-parallel-size {EXPERT_PARALLEL}")
PHASES = ("forward dispatch", "forward combine", "backward of combine", "backward of dispatch")
COUNTS_ENV = "MOE_DISPATCH_COUNTS_DIR"


def theory_bytes_per_step(latent_size=None):
    data_parallel = WORLD  # TP = PP = CP = 1
    tokens = GLOBAL_BATCH // data_parallel * SEQ
    width = latent_size or HIDDEN
    return LAYERS * tokens * TOPK * width * (EXPERT_PARALLEL - 1) // EXPERT_PARALLEL * BYTES_PER_ELEMENT


def install_byte_counter(sent_bytes):
    """Count, into `sent_bytes[phase]`, the bytes each `all_to_all_single` of the collectives module sends to other
    ranks. The phase is set by wrapping the autograd functions and the asynchronous launch that issue them."""
    import torch.distributed as dist

    from megatron.core.transformer.moe import collectives

    current = {"phase": None}

    class CountingDistributed:
        """`torch.distributed` as seen by the collectives module, with `all_to_all_single` counted."""

        def __getattr__(self, name):
            return getattr(dist, name)

        @staticmethod
        def all_to_all_single(output, tensor, output_split_sizes=None, input_split_sizes=None, group=None,
                              **kwargs):
            if current["phase"] is None:
                raise RuntimeError("an all_to_all_single outside the dispatcher's known call sites")
            own = dist.get_rank(group)
            row_bytes = tensor[0].numel() * tensor.element_size() if tensor.size(0) else 0
            sent_rows = sum(rows for rank, rows in enumerate(input_split_sizes) if rank != own)
            sent_bytes[current["phase"]] += sent_rows * row_bytes
            return dist.all_to_all_single(output, tensor, output_split_sizes=output_split_sizes,
                                          input_split_sizes=input_split_sizes, group=group, **kwargs)

    def in_phase(phase, function):
        def wrapped(*args, **kwargs):
            previous, current["phase"] = current["phase"], phase
            try:
                return function(*args, **kwargs)
            finally:
                current["phase"] = previous
        return wrapped

    collectives.dist = CountingDistributed()
    collectives.start_all_to_all = in_phase(PHASES[0], collectives.start_all_to_all)
    collectives._AllToAll.forward = staticmethod(in_phase(PHASES[1], collectives._AllToAll.forward))
    collectives._AllToAll.backward = staticmethod(in_phase(PHASES[2], collectives._AllToAll.backward))
    collectives._FinishAllToAll.backward = staticmethod(in_phase(PHASES[3], collectives._FinishAllToAll.backward))
    # The dispatcher imported its functions by name: point it at the counted launch.
    from megatron.core.transformer.moe import token_dispatcher
    token_dispatcher.start_all_to_all = collectives.start_all_to_all


def train_rank(arguments):
    """One rank of the launch: count, train, write this rank's counts."""
    sent_bytes = {phase: 0 for phase in PHASES}
    install_byte_counter(sent_bytes)
    sys.argv = [os.path.join(REPOSITORY, "pretrain_gpt.py"), *arguments]
    sys.path.insert(0, REPOSITORY)
    runpy.run_path(sys.argv[0], run_name="__main__")
    rank = int(os.environ["RANK"])
    with open(os.path.join(os.environ[COUNTS_ENV], f"rank{rank}.json"), "w") as stream:
        json.dump(sent_bytes, stream)


def launch(iters, directory, latent_size=None):
    latent = [] if latent_size is None else ["--moe-latent-size", str(latent_size)]
    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={WORLD}", os.path.abspath(__file__),
               "--train-rank", *MODEL.split(), *latent, "--train-iters", str(iters)]
    env = dict(os.environ, OMP_NUM_THREADS="1", **{COUNTS_ENV: directory})
    subprocess.run(command, check=True, cwd=REPOSITORY, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    counts = []
    for rank in range(WORLD):
        with open(os.path.join(directory, f"rank{rank}.json")) as stream:
            counts.append(json.load(stream))
    return counts


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--train-rank":
        train_rank(sys.argv[2:])
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--moe-latent-size", type=int, default=None,
                        help="Latent MoE: the experts (and the dispatched tokens) at this width.")
    options = parser.parse_args()
    with tempfile.TemporaryDirectory() as directory:
        counts = launch(options.iters, directory, options.moe_latent_size)
    theory = theory_bytes_per_step(options.moe_latent_size)
    print("| phase | " + " | ".join(f"rank {rank} (B/step)" for rank in range(WORLD)) + " | theory (B/step) "
          "| worst deviation |")
    print("|---|" + "---:|" * WORLD + "---:|---:|")
    for phase in PHASES:
        per_step = [counts[rank][phase] / options.iters for rank in range(WORLD)]
        deviation = max(abs(value / theory - 1) for value in per_step)
        print(f"| {phase} | " + " | ".join(f"{value:.0f}" for value in per_step)
              + f" | {theory} | {100 * deviation:.1f}% |")


if __name__ == "__main__":
    main()
