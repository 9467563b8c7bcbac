"""`pretrain_gpt.py` itself under every data-parallel wrapper, side by side on the same model and data.

    python examples/megatron_fsdp/pretrain_benchmark.py [--model small] [--iters 6] [--repeats 2]
                                                        [--arms ddp distopt mfsdp1 mfsdp2 mfsdp3 fsdp2]
                                                        [--update-doc docs/benchmarks.md]

Every arm is a fresh `torchrun --nproc-per-node 2 pretrain_gpt.py` (through `pretrain_counted.py`, which counts
the collective traffic of the training steps) on the same GPT, mock data, seed and flags; only the wrapper flags
differ. Repetitions are interleaved (every arm once, then every arm again) so machine load drifts over all arms
alike. Per arm: median iteration time after the warm-up iterations, tokens/s, the per-rank parameter, gradient
and optimizer-state bytes the training log reports, those against the ZeRO theory, the bytes sent per step and
the largest loss difference from the DDP arm. With `--update-doc` the table replaces the section between
`<!-- pretrain-benchmark:start -->` and `<!-- pretrain-benchmark:end -->` of that file (appended if missing).
"""

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

from examples.megatron_fsdp import bench_report, bench_theory  # noqa: E402

WORLD_SIZE = 2
SECTION_START, SECTION_END = "<!-- pretrain-benchmark:start -->", "<!-- pretrain-benchmark:end -->"

# Shapes as in bench_model.py's presets; untied embeddings because torch FSDP2 requires them.
MODEL_FLAGS = {
    "tiny": ["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "4", "--seq-length", "128",
             "--max-position-embeddings", "128", "--vocab-size", "1024"],
    "small": ["--num-layers", "12", "--hidden-size", "768", "--num-attention-heads", "12", "--seq-length", "256",
              "--max-position-embeddings", "256", "--vocab-size", "8192"],
}
COMMON_FLAGS = [
    "--micro-batch-size", "4", "--global-batch-size", "8", "--lr", "1e-4", "--min-lr", "1e-5",
    "--lr-decay-style", "constant", "--hidden-dropout", "0.0", "--attention-dropout", "0.0",
    "--untie-embeddings-and-output-weights", "--make-vocab-size-divisible-by", "128",
    "--mock-data", "--tokenizer-type", "NullTokenizer", "--seed", "1234", "--num-workers", "0",
    "--log-interval", "1", "--eval-iters", "0", "--distributed-backend", "gloo", "--ckpt-format", "torch_dist",
]

# arm -> (wrapper flags, ZeRO level of its per-rank state)
ARMS = {
    "ddp": ([], 0),
    "distopt": (["--use-distributed-optimizer"], 1),
    "mfsdp1": (["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim"], 1),
    "mfsdp2": (["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads"], 2),
    "mfsdp3": (["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads_params"], 3),
    "fsdp2": (["--use-torch-fsdp2"], 3),
}


def run_arm(arm, model, iters, workdir):
    """One launch of the arm; returns its metrics records and per-rank traffic counts (or an error text)."""
    metrics_path = os.path.join(workdir, "metrics.jsonl")
    counts_dir = os.path.join(workdir, "counts")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={WORLD_SIZE}",
               os.path.join(REPO_ROOT, "examples", "megatron_fsdp", "pretrain_counted.py"),
               *MODEL_FLAGS[model], *COMMON_FLAGS, "--train-iters", str(iters), "--metrics-file", metrics_path,
               *ARMS[arm][0]]
    environment = dict(os.environ, PRETRAIN_COUNTS_DIR=counts_dir, OMP_NUM_THREADS="1",
                       PRETRAIN_COUNT_AFTER="1")
    completed = subprocess.run(command, cwd=REPO_ROOT, env=environment, capture_output=True, text=True)
    if completed.returncode != 0:
        return {"error": (completed.stdout + completed.stderr)[-2000:]}
    with open(metrics_path) as stream:
        records = [json.loads(line) for line in stream if line.strip()]
    counts = []
    for rank in range(WORLD_SIZE):
        with open(os.path.join(counts_dir, f"rank{rank}.json")) as stream:
            counts.append(json.load(stream))
    return {"records": [r for r in records if r.get("split") == "train"], "counts": counts}


def summarise_arm(arm, runs, warmup, seq_length, global_batch):
    errors = [run["error"] for run in runs if "error" in run]
    if errors:
        return {"arm": arm, "error": errors[0].strip().splitlines()[-1] if errors[0].strip() else "failed"}
    times = [statistics.median(r["iteration-time"] for r in run["records"][warmup:]) for run in runs]
    step_s = statistics.median(times)
    last = runs[0]["records"][-1]
    counts = runs[0]["counts"]
    steps = max(counts[0]["counted_steps"], 1)
    sent_per_step = max(count["wire_bytes"] for count in counts) / steps
    return {
        "arm": arm,
        "step_s": step_s,
        "step_spread": times,
        "tokens_per_s": global_batch * seq_length / step_s,
        "state": {"params": last["params-bytes"], "grads": last["grads-bytes"],
                  "optimizer": last["optimizer-state-bytes"]},
        "sent_per_step": sent_per_step,
        "losses": [r["lm loss"] for r in runs[0]["records"]],
    }


def theory_bytes(arm, param_bytes):
    """ZeRO theory for an fp32 model: every arm, the distributed optimizer included, steps the fp32 weights (or
    their shards) in place, so no arm keeps a main copy."""
    return bench_theory.zero_state_bytes(ARMS[arm][1], param_bytes, WORLD_SIZE)


def render(summaries, meta):
    reference = next((s for s in summaries if s["arm"] == "ddp" and "error" not in s), None)
    param_bytes = reference["state"]["params"] if reference else None
    headers = ["arm", "step s (runs)", "vs DDP", "tokens/s", "params / grads / optimizer MiB per rank",
               "state vs ZeRO theory", "sent MiB per step per rank", "max abs dloss vs DDP"]
    rows = []
    for summary in summaries:
        if "error" in summary:
            rows.append([summary["arm"], f"failed: {summary['error']}"] + [""] * (len(headers) - 2))
            continue
        state = summary["state"]
        total = sum(state.values())
        theory = sum(theory_bytes(summary["arm"], param_bytes).values()) if param_bytes else None
        rows.append([
            summary["arm"],
            f"{summary['step_s']:.3f} ({', '.join(f'{t:.3f}' for t in summary['step_spread'])})",
            bench_report.format_ratio(bench_theory.ratio(summary["step_s"], reference["step_s"] if reference else None)),
            f"{summary['tokens_per_s']:.0f}",
            " / ".join(bench_report.format_mib(state[k]) for k in ("params", "grads", "optimizer")),
            bench_report.format_ratio(bench_theory.ratio(total, theory)),
            bench_report.format_mib(summary["sent_per_step"]),
            bench_report.format_loss_diff(bench_theory.max_abs_difference(summary["losses"], reference["losses"]))
            if reference else "",
        ])
    lines = [
        SECTION_START,
        "## pretrain_gpt.py under each wrapper",
        "",
        f"`python examples/megatron_fsdp/pretrain_benchmark.py --model {meta['model']} --iters {meta['iters']} "
        f"--repeats {meta['repeats']}` on {meta['machine']}, {meta['date']}: {WORLD_SIZE} gloo ranks, fp32, "
        "AdamW, mock data, global batch 8 (micro-batch 4, one microbatch per rank), untied embeddings, one thread "
        f"per rank. Step time: median iteration time after {meta['warmup']} warm-up iteration(s), median over the "
        "interleaved runs (each run in brackets). State: the per-rank bytes the training log's memory line reports "
        "(optimizer state includes main-parameter copies and shards held outside the model); theory: ZeRO-k of "
        "the DDP arm's parameter bytes with two fp32 Adam moments per parameter (plus the fp32 main copy of its "
        "shard for the distributed optimizer). Sent: the bytes the busiest rank "
        "sends per training step (collectives on a ring, point-to-point sends as sent), counted after the first "
        "iteration.",
        "",
        bench_report.markdown_table(headers, rows),
        SECTION_END,
    ]
    return "\n".join(lines) + "\n"


def cpu_model_name():
    try:
        with open("/proc/cpuinfo") as stream:
            for line in stream:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def update_doc(path, section):
    text = open(path).read() if os.path.exists(path) else ""
    if SECTION_START in text and SECTION_END in text:
        before, rest = text.split(SECTION_START, 1)
        after = rest.split(SECTION_END, 1)[1].lstrip("\n")
        text = before + section + ("\n" + after if after else "")
    else:
        text = text.rstrip("\n") + "\n\n" + section
    with open(path, "w") as stream:
        stream.write(text)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small", choices=sorted(MODEL_FLAGS))
    parser.add_argument("--iters", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2, help="iterations left out of the step time")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    parser.add_argument("--update-doc", default=None, help="markdown file whose benchmark section is replaced")
    parser.add_argument("--raw", default=None, help="write the raw per-run results as JSON here")
    args = parser.parse_args(argv)
    if args.iters <= args.warmup:
        parser.error(f"--iters ({args.iters}) must exceed --warmup ({args.warmup})")
    arms = (["ddp"] if "ddp" not in args.arms else []) + args.arms
    runs = {arm: [] for arm in arms}
    with tempfile.TemporaryDirectory(prefix="pretrain_bench_") as root:
        for repeat in range(args.repeats):
            for arm in arms:
                workdir = os.path.join(root, f"{arm}_{repeat}")
                os.makedirs(workdir)
                result = run_arm(arm, args.model, args.iters, workdir)
                runs[arm].append(result)
                status = result.get("error", "").strip().splitlines()[-1:] or ["ok"]
                print(f"[{repeat + 1}/{args.repeats}] {arm}: {status[0]}", flush=True)
    seq_length = int(MODEL_FLAGS[args.model][MODEL_FLAGS[args.model].index("--seq-length") + 1])
    summaries = [summarise_arm(arm, runs[arm], args.warmup, seq_length, 8) for arm in arms]
    meta = {"model": args.model, "iters": args.iters, "repeats": args.repeats, "warmup": args.warmup,
            "machine": f"{cpu_model_name()} ({os.cpu_count()} cores)",
            "date": datetime.date.today().isoformat()}
    section = render(summaries, meta)
    print(section)
    if args.raw:
        with open(args.raw, "w") as stream:
            json.dump({"meta": meta, "runs": runs}, stream)
    if args.update_doc:
        update_doc(args.update_doc, section)


if __name__ == "__main__":
    main()
