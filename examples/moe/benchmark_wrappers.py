"""Mixture-of-Experts under each data-parallel wrapper on 2 CPU ranks: per-rank expert bytes against theory and
step time.

Trains pretrain_gpt.py (mock data) with 8 experts per layer, top-2, alltoall dispatch, at EP2 under Megatron DDP,
the distributed optimizer, FSDP2 and Megatron-FSDP ZeRO-3 (experts on their expert data-parallel mesh, one rank
here), and reads the last rank's metrics record: the memory line's expert bytes and the iteration times. Prints a
markdown table. Arms are interleaved over `--repeats` rounds; the step time is the median over steps after the first
`--warmup` of every repeat, and each arm's ratio to DDP is also printed per repeat (the arms of one repeat run back
to back, so those ratios see the same machine load). `--arms` picks some of them (DDP, the reference of the ratio,
always runs); `--model large` trains a larger MoE model (4 layers, hidden 512, expert FFN 1024, seq 256) where
compute outweighs the per-step communication of the tiny default one. Subprocesses import this checkout's
`megatron_fsdp` package.

    python examples/moe/benchmark_wrappers.py [--repeats 2] [--iters 20] [--arms DDP "Megatron-FSDP z3"] [--model large]
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

REPOSITORY = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXPERTS, WORLD = 8, 2
MODELS = {  # name: (layers, hidden, expert FFN, sequence length)
    "small": (2, 128, 256, 64),
    "large": (4, 512, 1024, 256),
}


def model_flags(model):
    layers, hidden, ffn, seq = MODELS[model]
    return (f"--num-layers {layers} --hidden-size {hidden} --num-attention-heads 4 --seq-length {seq} "
            f"--max-position-embeddings {seq} --micro-batch-size 4 --global-batch-size 16 --lr 1e-3 "
            f"--hidden-dropout 0 --attention-dropout 0 --mock-data --tokenizer-type NullTokenizer --vocab-size 1024 "
            f"--seed 1234 --num-workers 0 --log-interval 1000 --eval-iters 0 --distributed-backend gloo "
            f"--num-experts {EXPERTS} "
            f"--moe-router-topk 2 --moe-ffn-hidden-size {ffn} --moe-token-dispatcher-type alltoall")

ARMS = {  # name: (expert-parallel size, flags, expert-DP sharding of (params, optimizer state))
    "DDP": (2, "", (1, 1)),
    "distributed optimizer": (2, "--use-distributed-optimizer", (1, 1)),
    "FSDP2": (2, "--use-torch-fsdp2 --untie-embeddings-and-output-weights", (1, 1)),
    "Megatron-FSDP z3": (2, "--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params", (1, 1)),
}


def expert_bytes_theory(model, expert_parallel_size, params_over, optimizer_over):
    """(params, grads, optimizer state) bytes per rank: fp32 experts with biases and Adam's two moments (the
    distributed optimizer steps an fp32 model's shards in place, with no main copy)."""
    layers, hidden, ffn, _ = MODELS[model]
    per_expert = 2 * hidden * ffn + ffn + hidden
    local = 4 * layers * EXPERTS * per_expert // expert_parallel_size
    return local // params_over, local // params_over, 2 * local // optimizer_over


def training_records(records):
    """The metrics file's training iterations, in order (evaluation records carry no iteration time)."""
    return [record for record in records if record.get("split") == "train"]


def run(name, model, iters, metrics_path):
    expert_parallel_size, flags, _ = ARMS[name]
    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={WORLD}",
               os.path.join(REPOSITORY, "pretrain_gpt.py"), *model_flags(model).split(), *flags.split(),
               "--expert-model-parallel-size", str(expert_parallel_size), "--train-iters", str(iters),
               "--metrics-file", metrics_path]
    package = os.path.join(REPOSITORY, "megatron", "core", "distributed", "fsdp", "src")
    python_path = os.pathsep.join(filter(None, [package, REPOSITORY, os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=python_path)
    subprocess.run(command, check=True, cwd=REPOSITORY, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    with open(metrics_path) as stream:
        return training_records(json.loads(line) for line in stream)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--arms", nargs="+", choices=list(ARMS), default=list(ARMS),
                        help="arms to run (DDP always runs: the step-time ratios are against it)")
    parser.add_argument("--model", choices=list(MODELS), default="small")
    options = parser.parse_args()
    arms = ["DDP"] + [name for name in ARMS if name in options.arms and name != "DDP"]
    times = {name: [] for name in arms}
    repeat_medians = {name: [] for name in arms}  # one median step per repeat: the ratios pair arms run side by side
    last = {}
    with tempfile.TemporaryDirectory() as directory:
        for repeat in range(options.repeats):
            for name in arms:
                path = os.path.join(directory, f"{repeat}-{len(times[name])}-{name.replace(' ', '_')}.jsonl")
                records = run(name, options.model, options.iters, path)
                steps = [record["iteration-time"] for record in records[options.warmup:]]
                times[name] += steps
                repeat_medians[name].append(statistics.median(steps))
                last[name] = records[-1]
    ddp_time = statistics.median(times["DDP"])
    print("| wrapper | EP | expert params (B) | theory | expert grads (B) | theory | expert optimizer (B) | theory "
          "| step (ms) | vs DDP |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name in arms:
        expert_parallel_size, _, (params_over, optimizer_over) = ARMS[name]
        record = last[name]
        theory = expert_bytes_theory(options.model, expert_parallel_size, params_over, optimizer_over)
        measured = (record.get("expert-params-bytes"), record.get("expert-grads-bytes"),
                    record.get("expert-optimizer-state-bytes"))
        cells = " | ".join(f"{'n/a' if m is None else m} | {t}" for m, t in zip(measured, theory))
        step = statistics.median(times[name])
        print(f"| {name} | {expert_parallel_size} | {cells} | {1000 * step:.1f} | {step / ddp_time:.2f} |")
    print()
    for name in arms[1:]:
        ratios = [arm / ddp for arm, ddp in zip(repeat_medians[name], repeat_medians["DDP"])]
        listed = ", ".join(f"{ratio:.2f}" for ratio in ratios)
        print(f"{name} vs DDP per repeat: {listed} (median {statistics.median(ratios):.2f})")


if __name__ == "__main__":
    main()
