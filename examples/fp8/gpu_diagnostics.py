"""Where an FP8 linear's time goes on one GPU: `python examples/fp8/benchmark_fp8.py --part gpu-diagnostics`.

For one linear layer (tokens x in x out, default the GPT-1.3B MLP shape 8192x2048x6144), forward + backward:
- the floor: the three GEMMs alone (forward, input gradient, weight gradient) in bf16 (`torch.matmul`) and in
  FP8 (`torch._scaled_mm` on operands already quantized and laid out), timed with CUDA events;
- the quantizing passes alone: the input and the output gradient (with their transposed bytes), the weight;
- host time against device time: how long the host takes to enqueue `fp8_linear`'s forward + backward, against
  how long the GPU takes to run them (a host time near the device time means the layer is launch-bound);
- the profiler's table of the kernels of a few steps, by device time.

`--smoke` runs it on the CPU with a tiny shape (a check of the program, not a measurement).
"""

import time

DEFAULT_SHAPE = (8192, 2048, 6144)
SMOKE_SHAPE = (64, 32, 48)


def _median_ms(step, device, runs=20, warmup=5):
    from examples.fp8.gpu_benchmark import _Timer

    return _Timer(device).measure(step, runs, warmup)


def _host_and_device_ms(step, device, runs=20):
    """(host ms to enqueue one step, device ms per step) over `runs` steps issued back to back."""
    import torch

    for _ in range(3):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
    begin = time.perf_counter()
    for _ in range(runs):
        step()
    host = 1000 * (time.perf_counter() - begin) / runs
    if device.type == "cuda":
        end.record()
        end.synchronize()
        return host, start.elapsed_time(end) / runs
    return host, host


def diagnose(device, shape, profile_rows=25):
    import torch
    import torch.nn.functional as F

    from megatron.core.fp8.linear import fp8_gemm
    from megatron.core.fp8.tensor import quantize_with_current_scale
    from megatron.core.fp8_utils import Fp8RecipeSettings, LinearScaling, fp8_linear, get_fp8_format

    tokens, in_features, out_features = shape
    hybrid = get_fp8_format("hybrid")
    generator = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(tokens, in_features, device=device, generator=generator).to(torch.bfloat16).requires_grad_(True)
    weight = (torch.randn(out_features, in_features, device=device, generator=generator) * 0.02)
    weight = weight.to(torch.bfloat16).requires_grad_(True)
    grad = torch.randn(tokens, out_features, device=device, generator=generator).to(torch.bfloat16)
    tensorwise = LinearScaling(Fp8RecipeSettings(hybrid, "tensorwise"), "none")

    lines = [f"\nFP8 linear diagnostics, {tokens}x{in_features}x{out_features} ({_device_name(device)})"]
    # The floor: GEMMs alone.
    xd, wd, gd = x.detach(), weight.detach(), grad
    bf16_gemms = {
        "forward x @ w.T": lambda: torch.matmul(xd, wd.t()),
        "dgrad g @ w": lambda: torch.matmul(gd, wd),
        "wgrad g.T @ x": lambda: torch.matmul(gd.t(), xd),
    }
    x8 = quantize_with_current_scale(xd, hybrid.forward_dtype)
    x8.transpose_data = x8.data.t().contiguous()
    w8 = quantize_with_current_scale(wd, hybrid.forward_dtype)
    w8.transpose_data = w8.data.t().contiguous()
    g8 = quantize_with_current_scale(gd, hybrid.backward_dtype)
    g8.transpose_data = g8.data.t().contiguous()
    fp8_gemms = {
        "forward x @ w.T": lambda: fp8_gemm(x8, w8.t(), torch.bfloat16),
        "dgrad g @ w": lambda: fp8_gemm(g8, w8, torch.bfloat16),
        "wgrad g.T @ x": lambda: fp8_gemm(g8.t(), x8, torch.bfloat16),
    }
    lines.append("| GEMM | bf16 ms | fp8 ms | fp8 / bf16 |")
    lines.append("|---|---|---|---|")
    totals = [0.0, 0.0]
    for name in bf16_gemms:
        bf16_ms, fp8_ms = _median_ms(bf16_gemms[name], device), _median_ms(fp8_gemms[name], device)
        totals[0] += bf16_ms
        totals[1] += fp8_ms
        lines.append(f"| {name} | {bf16_ms:.3f} | {fp8_ms:.3f} | {fp8_ms / bf16_ms:.2f} |")
    lines.append(f"| all three | {totals[0]:.3f} | {totals[1]:.3f} | {totals[1] / totals[0]:.2f} |")

    # The quantizing passes alone.
    quantizers = {
        "input (+ transpose)": lambda: tensorwise.input.quantize(xd, with_transpose=True),
        "weight": lambda: tensorwise.weight.quantize(wd),
        "weight (+ transpose)": lambda: tensorwise.weight.quantize(wd, with_transpose=True),
        "output gradient (+ transpose)": lambda: tensorwise.grad_output.quantize(gd, with_transpose=True),
    }
    lines.append("| quantizing pass | ms |")
    lines.append("|---|---|")
    for name, step in quantizers.items():
        lines.append(f"| {name} | {_median_ms(step, device):.3f} |")

    # Host against device.
    def layer_step():
        fp8_linear(x, weight, None, tensorwise).backward(grad)

    def bf16_step():
        F.linear(x, weight).backward(grad)

    def layer_step_without_triton():
        from megatron.core.fp8.tensor import triton_quantization

        with triton_quantization(False):
            layer_step()

    lines.append("| forward + backward | host ms to enqueue | device ms |")
    lines.append("|---|---|---|")
    for name, step in (("bf16 F.linear", bf16_step), ("fp8_linear tensorwise", layer_step),
                       ("fp8_linear tensorwise, no Triton kernels", layer_step_without_triton)):
        host, on_device = _host_and_device_ms(step, device)
        lines.append(f"| {name} | {host:.3f} | {on_device:.3f} |")

    # The profiler's view.
    activities = [torch.profiler.ProfilerActivity.CPU]
    sort_by = "self_cpu_time_total"
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
        sort_by = "self_cuda_time_total"
    with torch.profiler.profile(activities=activities) as profiler:
        for _ in range(5):
            layer_step()
        if device.type == "cuda":
            torch.cuda.synchronize()
    lines.append("\nprofile of 5 x fp8_linear tensorwise forward + backward")
    lines.append(profiler.key_averages().table(sort_by=sort_by, row_limit=profile_rows, max_name_column_width=60))
    text = "\n".join(lines)
    print(text)
    return text


def _device_name(device):
    import torch

    return torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU smoke run, not a measurement"


def run(smoke=False):
    import torch

    if smoke:
        return {"table": diagnose(torch.device("cpu"), SMOKE_SHAPE, profile_rows=5)}
    from examples.fp8.gpu_benchmark import unavailable_reason

    reason = unavailable_reason()
    if reason is not None:
        print(f"\nFP8 linear diagnostics: skipped, {reason}")
        return {"skipped": reason}
    return {"table": diagnose(torch.device("cuda"), DEFAULT_SHAPE)}
