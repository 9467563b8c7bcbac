"""FP8 against bf16 on one GPU: `python examples/fp8/benchmark_fp8.py --part gpu [--smoke]`.

(a) One linear layer, forward + backward (tokens x in x out: the GPT-1.3B shapes 8192x2048x6144,
8192x2048x8192, 8192x8192x2048, 8192x2048x2048), timed with CUDA events over 20 runs after warm-up: bf16
`F.linear`, `fp8_linear` tensorwise, `fp8_linear` delayed (with a recorded history, as in training), and
torchao's `Float8Linear` (tensorwise) under `torch.compile` when torchao is importable.
(b) `pretrain_gpt.py` end to end on one rank (torchrun --nproc-per-node 1): GPT 24 layers x 2048 hidden, 16
heads, seq 2048, micro batch 4, global batch 16, bf16, untied embeddings, mock data, 10 iterations, median step
of iterations 4-10 (from the metrics file), bf16 against FP8 hybrid tensorwise and delayed, under Megatron DDP
and Megatron-FSDP z3 (`--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params`).

`--smoke` runs the same code paths on the CPU with tiny shapes and a tiny model (gloo, wall-clock timing), to
check the program, not to measure. Run from the source tree with
`PYTHONPATH=.:megatron/core/distributed/fsdp/src`.
"""

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

LINEAR_SHAPES = ((8192, 2048, 6144), (8192, 2048, 8192), (8192, 8192, 2048), (8192, 2048, 2048))
SMOKE_LINEAR_SHAPES = ((64, 32, 48), (64, 48, 32))
GPT_1_3B = (
    "--num-layers 24 --hidden-size 2048 --num-attention-heads 16 --seq-length 2048 --max-position-embeddings 2048 "
    "--micro-batch-size 4 --global-batch-size 16 --bf16 --untie-embeddings-and-output-weights --mock-data "
    "--vocab-size 32000 --make-vocab-size-divisible-by 128 --lr 1e-4 --seed 1234 --num-workers 0 "
    "--log-interval 1000 --eval-iters 0 --distributed-backend nccl --ckpt-format torch_dist"
)
SMOKE_GPT = (
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 32 "
    "--micro-batch-size 2 --global-batch-size 4 --bf16 --untie-embeddings-and-output-weights --mock-data "
    "--vocab-size 128 --make-vocab-size-divisible-by 64 --lr 1e-4 --seed 1234 --num-workers 0 "
    "--log-interval 1000 --eval-iters 0 --distributed-backend gloo --ckpt-format torch_dist"
)
WRAPPERS = {
    "Megatron DDP": "",
    "Megatron-FSDP z3": "--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params",
}
PRECISIONS = {
    "bf16": "",
    "fp8 tensorwise": "--fp8-format hybrid --fp8-recipe tensorwise",
    "fp8 delayed": "--fp8-format hybrid --fp8-recipe delayed --fp8-amax-history-len 16 --fp8-amax-compute-algo max",
}
TRAIN_ITERS = 10
MEDIAN_FROM_ITERATION = 4


# ---- (a) one linear layer -------------------------------------------------------------------------------------------


class _Timer:
    """CUDA events on a GPU, wall clock elsewhere; `measure(step, runs)` -> median milliseconds."""

    def __init__(self, device):
        self.device = device

    def measure(self, step, runs, warmup):
        import torch

        for _ in range(warmup):
            step()
        samples = []
        for _ in range(runs):
            if self.device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                step()
                end.record()
                end.synchronize()
                samples.append(start.elapsed_time(end))
            else:
                begin = time.perf_counter()
                step()
                samples.append(1000 * (time.perf_counter() - begin))
        return statistics.median(samples)


def _torchao_step(x, weight, grad):
    """torchao's Float8Linear (tensorwise) under torch.compile, or None when torchao is not importable."""
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except Exception:
        return None
    import torch

    linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False, device=x.device, dtype=x.dtype)
    with torch.no_grad():
        linear.weight.copy_(weight)
    module = torch.nn.Sequential(linear)
    convert_to_float8_training(module, config=Float8LinearConfig())
    compiled = torch.compile(module)

    def step():
        compiled(x).backward(grad)

    return step


def _without_triton(step):
    """`step` with the quantization through the torch.compile'd / eager functions instead of the Triton kernels."""
    from megatron.core.fp8.tensor import triton_quantization

    with triton_quantization(False):
        return step()


def time_linears(device, shapes, runs=20, warmup=5):
    """{shape name: {arm: median ms}} of one linear's forward + backward."""
    import torch
    import torch.nn.functional as F

    from megatron.core.fp8_utils import (Fp8RecipeSettings, LinearScaling, fp8_linear, get_fp8_format,
                                         reduce_and_record_amaxes)

    timer = _Timer(device)
    hybrid = get_fp8_format("hybrid")
    results = {}
    for tokens, in_features, out_features in shapes:
        generator = torch.Generator(device=device).manual_seed(0)
        x = torch.randn(tokens, in_features, device=device, generator=generator, dtype=torch.bfloat16)
        x.requires_grad_(True)
        weight = (torch.randn(out_features, in_features, device=device, generator=generator) * 0.02)
        weight = weight.to(torch.bfloat16).requires_grad_(True)
        grad = torch.randn(tokens, out_features, device=device, generator=generator, dtype=torch.bfloat16)
        tensorwise = LinearScaling(Fp8RecipeSettings(hybrid, "tensorwise"), "none")
        delayed = LinearScaling(Fp8RecipeSettings(hybrid, "delayed", amax_history_len=16, amax_compute_algo="max"),
                                "none")
        fp8_linear(x, weight, None, delayed).backward(grad)
        reduce_and_record_amaxes(delayed.states(), [])  # a recorded history: the steady state of training

        # The weight quantized once (with its transposed bytes), as a layer caches it across the microbatches of
        # an optimizer step.
        cached_weight = tensorwise.weight.quantize(weight.detach(), with_transpose=True)
        arms = {
            "bf16 F.linear": lambda: F.linear(x, weight).backward(grad),
            "fp8_linear tensorwise": lambda: fp8_linear(x, weight, None, tensorwise).backward(grad),
            "fp8_linear delayed": lambda: fp8_linear(x, weight, None, delayed).backward(grad),
            "fp8_linear tensorwise, weight cached": lambda: fp8_linear(x, weight, None, tensorwise,
                                                                      weight_fp8=cached_weight).backward(grad),
            "fp8_linear tensorwise, no Triton kernels": lambda: _without_triton(
                lambda: fp8_linear(x, weight, None, tensorwise).backward(grad)),
        }
        torchao = _torchao_step(x, weight.detach(), grad)
        if torchao is not None:
            arms["torchao Float8Linear + compile"] = torchao
        name = f"{tokens}x{in_features}x{out_features}"
        results[name] = {arm: timer.measure(step, runs, warmup) for arm, step in arms.items()}
        for tensor in (x, weight):
            tensor.grad = None
    return results


# ---- (b) pretrain_gpt.py end to end ---------------------------------------------------------------------------------


def _median_step(metrics_path):
    with open(metrics_path) as records:
        rows = [json.loads(line) for line in records]
    times = [row["iteration-time"] for row in rows if row.get("iteration", 0) >= MEDIAN_FROM_ITERATION]
    if not times:
        raise RuntimeError(f"no iterations >= {MEDIAN_FROM_ITERATION} in {metrics_path}")
    return statistics.median(times)


def run_pretrain(model_args, extra, workdir, train_iters, timeout=600):
    """Median step seconds of one `pretrain_gpt.py` run on one rank (torchrun), from its metrics file."""
    metrics = os.path.join(workdir, "metrics.jsonl")
    if os.path.exists(metrics):
        os.remove(metrics)
    # --standalone: the rendezvous takes a free port, so runs beside another job on this host do not collide
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=1", "--standalone",
               os.path.join(REPO_ROOT, "pretrain_gpt.py"), *model_args.split(), *extra.split(),
               "--train-iters", str(train_iters), "--metrics-file", metrics]
    fsdp_src = os.path.join(REPO_ROOT, "megatron", "core", "distributed", "fsdp", "src")
    path = os.pathsep.join(p for p in (REPO_ROOT, fsdp_src, os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONPATH": path}
    completed = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    if completed.returncode != 0:
        raise RuntimeError(f"pretrain_gpt.py {extra!r} failed:\n{completed.stderr[-4000:]}")
    return _median_step(metrics)


def time_pretrain(smoke):
    """{wrapper: {precision: median step seconds}}."""
    model_args = SMOKE_GPT if smoke else GPT_1_3B
    train_iters = MEDIAN_FROM_ITERATION + 1 if smoke else TRAIN_ITERS
    results = {}
    with tempfile.TemporaryDirectory() as workdir:
        for wrapper, wrapper_args in WRAPPERS.items():
            results[wrapper] = {}
            for precision, precision_args in PRECISIONS.items():
                started = time.perf_counter()
                try:
                    step = run_pretrain(model_args, f"{wrapper_args} {precision_args}", workdir, train_iters)
                except (RuntimeError, subprocess.TimeoutExpired) as error:  # report it, go on with the other arms
                    print(f"pretrain_gpt.py {wrapper}, {precision}: failed: {error}", flush=True)
                    step = float("nan")
                results[wrapper][precision] = step
                # One line per run as it ends, so a run cut short still reports the arms it finished.
                print(f"pretrain_gpt.py {wrapper}, {precision}: median step {step:.4f} s "
                      f"(run took {time.perf_counter() - started:.0f} s)", flush=True)
    return results


# ---- report ----------------------------------------------------------------------------------------------------------


def report(linears, pretrain, device_name):
    lines = []
    if linears:
        lines.append(f"\none linear layer, forward + backward, median ms ({device_name})")
        arms = list(next(iter(linears.values())))
        lines.append("| tokens x in x out | " + " | ".join(arms) + " | fp8 tensorwise / bf16 |")
        lines.append("|---" * (len(arms) + 2) + "|")
        for shape, timings in linears.items():
            ratio = timings["fp8_linear tensorwise"] / timings["bf16 F.linear"]
            lines.append(f"| {shape} | " + " | ".join(f"{timings[arm]:.3f}" for arm in arms) + f" | {ratio:.2f} |")
    if pretrain:
        lines.append(f"\npretrain_gpt.py, median step (s) of iterations {MEDIAN_FROM_ITERATION}-{TRAIN_ITERS}, one "
                     f"rank ({device_name})")
        lines.append("| wrapper | " + " | ".join(PRECISIONS) + " | tensorwise / bf16 | delayed / bf16 |")
        lines.append("|---" * (len(PRECISIONS) + 3) + "|")
        for wrapper, steps in pretrain.items():
            lines.append(f"| {wrapper} | " + " | ".join(f"{steps[p]:.3f}" for p in PRECISIONS)
                         + f" | {steps['fp8 tensorwise'] / steps['bf16']:.2f} | "
                         f"{steps['fp8 delayed'] / steps['bf16']:.2f} |")
    text = "\n".join(lines)
    print(text)
    return text


def unavailable_reason():
    import torch

    if not torch.cuda.is_available():
        return "no CUDA device on this machine (run with --smoke to check the program on the CPU)"
    from megatron.core.fp8_utils import scaled_mm_supported

    if not scaled_mm_supported("cuda"):
        return "this GPU has no FP8 torch._scaled_mm kernel (FP8 tensor cores need compute capability 8.9+)"
    return None


def run(smoke=False, skip_pretrain=False, pretrain_only=False):
    """Part (a) and (b) (or one of them); returns the report dict (`{"skipped": reason}` where the GPU part
    cannot run)."""
    import torch

    if smoke:
        device, device_name = torch.device("cpu"), "CPU smoke run, not a measurement"
        linears = {} if pretrain_only else time_linears(device, SMOKE_LINEAR_SHAPES, runs=2, warmup=1)
    else:
        reason = unavailable_reason()
        if reason is not None:
            print(f"\nFP8 against bf16 on a GPU: skipped, {reason}")
            return {"skipped": reason}
        device, device_name = torch.device("cuda"), torch.cuda.get_device_name(0)
        linears = {} if pretrain_only else time_linears(device, LINEAR_SHAPES)
    pretrain = {} if skip_pretrain else time_pretrain(smoke)
    text = report(linears, pretrain, device_name)
    return {"device": device_name, "linear_ms": linears, "pretrain_step_s": pretrain, "table": text}
