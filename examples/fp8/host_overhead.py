"""Host overhead of one FP8 linear layer: aten ops dispatched and host microseconds per forward + backward.

At tiny shapes (16 tokens x 64 x 64 by default) a layer's time is almost all host work: Python, autograd and the
dispatch of every aten op. On a GPU that work is what enqueues the kernels, and for one FP8 linear it takes longer
than the kernels run, so every op and every microsecond of Python counted here is step time there. The program
runs the layer the model uses (the tensor-parallel linear of a transformer layer, with its scaling states, its
step's FP8 weight cache and the FP8 region) inside `force_fp8_scaled_mm()`, so that it takes the branches it
takes on a GPU (`torch._scaled_mm`, transposed bytes from the quantizing passes), and compares it with the same
layer outside an FP8 region and with a bare `F.linear`.

    python examples/fp8/host_overhead.py [--tokens 16 --in-features 64 --out-features 64 --calls 2000]

Per row: aten ops of one forward + backward (counted with a `TorchDispatchMode`), and the host time of one call:
the CPU time of the calling thread (one torch thread), so that other processes on a shared machine do not count,
as the mean over `--calls` calls, median and minimum over `--repeats` runs. The CPU's `torch._scaled_mm` kernel takes
milliseconds even at these shapes (it converts its operands and runs a slow GEMM), which is compute, not host
work: the timed FP8 rows replace it by the allocation of its output, which is what enqueueing it costs the host
on a GPU besides the dispatch (`--real-scaled-mm` times the kernel too). The `F.linear` rows include their small
CPU GEMMs.
"""

import argparse
import contextlib
import platform
import statistics
import time

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode


class OpCounter(TorchDispatchMode):
    """Counts the aten ops dispatched while active (by overload name in `ops`)."""

    def __init__(self):
        super().__init__()
        self.ops = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        self.ops[name] = self.ops.get(name, 0) + 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self):
        return sum(self.ops.values())


def fp8_layer(recipe, tokens=16, in_features=64, out_features=64, dtype=torch.bfloat16):
    """(call, layer): `call()` runs one microbatch's forward + backward of the model's column-parallel linear
    (bias, `dtype` parameters) in an FP8 region of `recipe` (None: outside any region), as in training: the
    training loop manages the layer (its step hook ran, so the FP8 weight is cached for the step) and, under
    delayed scaling, a history has been recorded."""
    from megatron.core import fp8_utils
    from megatron.core.extensions.transformer_engine import layer_classes
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(num_layers=1, hidden_size=in_features, num_attention_heads=1, fp8="hybrid",
                               fp8_recipe=recipe or "tensorwise", params_dtype=dtype, bf16=dtype == torch.bfloat16)
    torch.manual_seed(0)
    layer = layer_classes(config)[0](in_features, out_features, config=config, init_method=torch.nn.init.normal_,
                                     bias=True)
    x = torch.randn(tokens, 1, in_features, dtype=dtype, requires_grad=True)  # [sequence, batch, hidden]
    grad = torch.randn(tokens, 1, out_features, dtype=dtype)

    def call():
        with fp8_utils.get_fp8_context(config, layer_no=0) if recipe else _null():
            out, _ = layer(x)
        out.backward(grad)

    with fp8_utils.force_fp8_scaled_mm():
        call()
        fp8_utils.reduce_fp8_amaxes([layer])  # the step hook: records the amaxes, manages the weight cache
        call()
    return call, layer


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def bare_linear(tokens=16, in_features=64, out_features=64, dtype=torch.bfloat16):
    torch.manual_seed(0)
    weight = torch.randn(out_features, in_features, dtype=dtype, requires_grad=True)
    bias = torch.zeros(out_features, dtype=dtype, requires_grad=True)
    x = torch.randn(tokens, 1, in_features, dtype=dtype, requires_grad=True)
    grad = torch.randn(tokens, 1, out_features, dtype=dtype)

    def call():
        F.linear(x, weight, bias).backward(grad)

    return call


def count_ops(call):
    """aten ops of one `call()` (forward + backward), by name."""
    from megatron.core.fp8_utils import force_fp8_scaled_mm

    with force_fp8_scaled_mm(), OpCounter() as counter:
        call()
    return counter.ops


@contextlib.contextmanager
def scaled_mm_enqueue_only():
    """`torch._scaled_mm` replaced by the allocation of its output (its host cost on a GPU, without the CPU
    kernel's compute)."""
    original = torch._scaled_mm

    def enqueue_only(a, b, *, out_dtype=None, **kwargs):
        return torch.empty((a.shape[0], b.shape[1]), dtype=out_dtype or a.dtype)

    torch._scaled_mm = enqueue_only
    try:
        yield
    finally:
        torch._scaled_mm = original


def host_microseconds(call, calls, repeats, real_scaled_mm=False):
    """(median, minimum) over `repeats` runs of the mean thread CPU time of `calls` calls, in microseconds."""
    from megatron.core.fp8_utils import force_fp8_scaled_mm

    means = []
    gemms = contextlib.nullcontext() if real_scaled_mm else scaled_mm_enqueue_only()
    with force_fp8_scaled_mm(), gemms:
        for _ in range(20):
            call()
        for _ in range(repeats):
            start = time.thread_time()
            for _ in range(calls):
                call()
            means.append((time.thread_time() - start) / calls * 1e6)
    return statistics.median(means), min(means)


def cpu_model():
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--in-features", type=int, default=64)
    parser.add_argument("--out-features", type=int, default=64)
    parser.add_argument("--calls", type=int, default=200, help="calls per timed run")
    parser.add_argument("--repeats", type=int, default=31, help="timed runs (their median and minimum are reported)")
    parser.add_argument("--show-ops", action="store_true", help="list the ops of each FP8 row")
    parser.add_argument("--real-scaled-mm", action="store_true",
                        help="time the CPU's torch._scaled_mm kernel too (milliseconds per GEMM)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    shape = dict(tokens=args.tokens, in_features=args.in_features, out_features=args.out_features)
    rows = [
        ("F.linear bf16", bare_linear(**shape)),
        ("F.linear fp32", bare_linear(**shape, dtype=torch.float32)),
        ("layer, no FP8 region (bf16)", fp8_layer(None, **shape)[0]),
        ("layer, FP8 tensorwise", fp8_layer("tensorwise", **shape)[0]),
        ("layer, FP8 delayed", fp8_layer("delayed", **shape)[0]),
    ]
    print(f"{cpu_model()}, torch {torch.__version__}, 1 thread; {args.tokens} tokens x {args.in_features} -> "
          f"{args.out_features}, bf16, torch._scaled_mm forced on the CPU")
    print(f"{'forward + backward of':32s} {'aten ops':>9s} {'host us median':>15s} {'host us min':>12s}")
    for name, call in rows:
        ops = count_ops(call)
        median, best = host_microseconds(call, args.calls, args.repeats, args.real_scaled_mm)
        print(f"{name:32s} {sum(ops.values()):9d} {median:15.1f} {best:12.1f}")
        if args.show_ops and "FP8" in name:
            for op, count in sorted(ops.items(), key=lambda item: -item[1]):
                print(f"    {count:3d} {op}")


if __name__ == "__main__":
    main()
