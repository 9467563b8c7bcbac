"""Peak device memory and step time of one GPU with and without offloading: a program, not a test.

    python examples/offloading/benchmark.py            # one GPU: a GPT of 24 layers x 2048 (1.34B parameters)
    python examples/offloading/benchmark.py --tiny     # the same arms on the CPU with a tiny GPT (a smoke run)

Arms (each on the same initial weights and batches, in one process, one after the other):
- `no offload`: Megatron DDP with the distributed optimizer and the precision-aware AdamW (fp32 state);
- `optimizer offload 1.0`: the same with `--optimizer-cpu-offload --optimizer-offload-fraction 1.0
  --overlap-cpu-optimizer-d2h-h2d`: main parameters and moments on the host (12 bytes per parameter);
- `FSDP2`: PyTorch FSDP2 (bf16 compute over fp32 shards), the reference of the next arm;
- `FSDP2 parameter offload`: the same with `--torch-fsdp2-cpu-offload`.
On request (`--arms`): `Megatron-FSDP ZeRO-3` and `Megatron-FSDP parameter offload` (`--megatron-fsdp-param-offload`).

Printed per arm: the peak device memory over the timed steps (`torch.cuda.max_memory_allocated`; "n/a" on the CPU,
where host and device are the same memory), its saving against the arm's reference, the median step time and
its ratio to the reference ("-" where `--arms` leaves the reference out), and the last loss (arms of one reference
train the same numbers). The targets: the optimizer-offload arm saves at least 12 bytes per parameter at <= 1.3x
the step time.
"""

import argparse
import copy
import dataclasses
import gc
import os
import statistics
import sys
import time
import weakref
from typing import List, Optional

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

GIB = 1024 ** 3


@dataclasses.dataclass(frozen=True)
class Shape:
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    vocab_size: int
    seq_length: int
    micro_batch_size: int


H100_RUN = Shape(num_layers=24, hidden_size=2048, num_attention_heads=16, vocab_size=32768, seq_length=1024,
                 micro_batch_size=1)
TINY = Shape(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=128, seq_length=32, micro_batch_size=2)


@dataclasses.dataclass(frozen=True)
class Arm:
    name: str
    reference: str  # the arm this one is compared with
    wrapper: str  # "distributed_optimizer" or "torch_fsdp2"
    optimizer_offload: bool = False
    parameter_offload: bool = False


ARMS = (
    Arm("no offload", "no offload", "distributed_optimizer"),
    Arm("optimizer offload 1.0", "no offload", "distributed_optimizer", optimizer_offload=True),
    Arm("FSDP2", "FSDP2", "torch_fsdp2"),
    Arm("FSDP2 parameter offload", "FSDP2", "torch_fsdp2", parameter_offload=True),
    Arm("Megatron-FSDP ZeRO-3", "Megatron-FSDP ZeRO-3", "megatron_fsdp"),
    Arm("Megatron-FSDP parameter offload", "Megatron-FSDP ZeRO-3", "megatron_fsdp", parameter_offload=True),
)
DEFAULT_ARMS = tuple(arm.name for arm in ARMS[:4])  # the table; the Megatron-FSDP arms on request


@dataclasses.dataclass
class ArmResult:
    arm: Arm
    peak_bytes: Optional[int]
    step_seconds: List[float]
    losses: List[float]
    num_params: int


def _setup(device):
    from megatron.core import parallel_state, tensor_parallel

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29517")
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel()
    tensor_parallel.model_parallel_cuda_manual_seed(1234)


def build_model(shape: Shape, bf16: bool):
    """The GPT of `shape` on the CPU (untied embeddings, as FSDP2 needs); arms copy it to their device."""
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(num_layers=shape.num_layers, hidden_size=shape.hidden_size,
                               num_attention_heads=shape.num_attention_heads, hidden_dropout=0.0,
                               attention_dropout=0.0, init_seed=1234, bf16=bf16,
                               params_dtype=torch.bfloat16 if bf16 else torch.float32)
    return GPTModel(config, vocab_size=shape.vocab_size, max_sequence_length=shape.seq_length,
                    share_embeddings_and_output_weights=False)


def _batch(shape: Shape, step: int, device):
    generator = torch.Generator().manual_seed(step)
    stream = torch.randint(0, shape.vocab_size, (shape.micro_batch_size, shape.seq_length + 1), generator=generator)
    positions = torch.arange(shape.seq_length).expand(shape.micro_batch_size, shape.seq_length)
    return stream[:, :-1].to(device), positions.to(device), stream[:, 1:].to(device)


def _wrap(arm: Arm, model, bf16: bool):
    from megatron.core.distributed import DistributedDataParallelConfig, wrap_data_parallel
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    if arm.wrapper == "distributed_optimizer":
        ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=True, grad_reduce_in_fp32=True)
        optimizer_config = OptimizerConfig(lr=1e-4, bf16=bf16, use_distributed_optimizer=True,
                                           use_precision_aware_optimizer=True,
                                           optimizer_cpu_offload=arm.optimizer_offload,
                                           overlap_cpu_optimizer_d2h_h2d=arm.optimizer_offload)
    elif arm.wrapper == "torch_fsdp2":
        ddp_config = DistributedDataParallelConfig(use_torch_fsdp2=True, grad_reduce_in_fp32=True,
                                                   torch_fsdp2_cpu_offload=arm.parameter_offload)
        optimizer_config = OptimizerConfig(lr=1e-4, bf16=bf16)
    else:
        ddp_config = DistributedDataParallelConfig(use_megatron_fsdp=True, use_distributed_optimizer=True,
                                                   data_parallel_sharding_strategy="optim_grads_params",
                                                   grad_reduce_in_fp32=True,
                                                   megatron_fsdp_param_offload=arm.parameter_offload)
        optimizer_config = OptimizerConfig(lr=1e-4, bf16=bf16, use_distributed_optimizer=True)
    chunk = wrap_data_parallel(model.config, ddp_config, model)
    return chunk, get_megatron_optimizer(optimizer_config, [chunk])


def _synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _release(chunk):
    """Let the arm's model and wrapper be freed once the last reference goes. DDP's and Megatron-FSDP's
    post-accumulate-grad hooks hold their wrapper and are kept in the parameters' C++ autograd data, out of the
    garbage collector's sight: without removing them the wrapper and its buffers (6 bytes per parameter under bf16
    with fp32 gradients) are never freed and count in the peaks of every later arm."""
    for handle in getattr(chunk, "_hook_handles", ()):  # DistributedDataParallel
        handle.remove()
    for module in chunk.modules():
        schedule = getattr(module, "schedule", None)
        if hasattr(schedule, "remove_hooks"):  # MegatronFSDP
            schedule.remove_hooks()


def run_arm(arm: Arm, cpu_model, shape: Shape, device, steps: int, warmup: int, bf16: bool) -> ArmResult:
    """Train `steps` steps of `arm` from a copy of `cpu_model`; the first `warmup` are not measured. The peak is
    the arm's own: device memory still allocated when the arm starts is not counted, and the arm must leave none
    of its model behind (a `RuntimeError` otherwise, since it would distort the arms measured after it)."""
    resident = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    model = copy.deepcopy(cpu_model).to(device)
    num_params = sum(param.numel() for param in model.parameters())
    chunk, optimizer = _wrap(arm, model, bf16)
    model_alive, optimizer_alive = weakref.ref(model), weakref.ref(optimizer)
    seconds, losses, peak = [], [], None
    for step in range(steps):
        if step == warmup and device.type == "cuda":
            _synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
        _synchronize(device)
        start = time.perf_counter()
        chunk.zero_grad_buffer()
        optimizer.zero_grad()
        tokens, positions, labels = _batch(shape, step, device)
        loss = chunk(tokens, positions, labels=labels).float().mean()
        loss.backward()
        chunk.finish_grad_sync()
        optimizer.step()
        _synchronize(device)
        if step >= warmup:
            seconds.append(time.perf_counter() - start)
        losses.append(loss.item())
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device) - resident
    _release(chunk)
    del chunk, optimizer, model, loss
    gc.collect()
    for what, alive in (("model", model_alive), ("optimizer", optimizer_alive)):
        if alive() is not None:
            raise RuntimeError(f"arm {arm.name!r}: its {what} is still referenced after the arm ended; its device "
                               "memory would count in the peaks of the arms measured after it")
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return ArmResult(arm, peak, seconds, losses, num_params)


def format_table(results: List[ArmResult]) -> str:
    by_name = {result.arm.name: result for result in results}
    header = ("| arm | peak device memory (GiB) | saved vs reference (bytes/param) | step time (s) | step time ratio "
              "| last loss |")
    lines = [header, "|---|---|---|---|---|---|"]
    for result in results:
        reference = by_name.get(result.arm.reference)  # "-" where the reference arm was not run
        step = statistics.median(result.step_seconds)
        ratio = f"{step / statistics.median(reference.step_seconds):.2f}" if reference else "-"
        if result.peak_bytes is None:
            peak = saved = "n/a"
        else:
            peak = f"{result.peak_bytes / GIB:.2f}"
            saved = f"{(reference.peak_bytes - result.peak_bytes) / result.num_params:.1f}" if reference else "-"
        lines.append(f"| {result.arm.name} | {peak} | {saved} | {step:.3f} | {ratio} | {result.losses[-1]:.6f} |")
    return "\n".join(lines)


def main(argv=None) -> List[ArmResult]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="a tiny GPT in fp32 on the CPU (checks the program)")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--num-layers", type=int, default=None, help="override the model's depth")
    parser.add_argument("--arms", default=",".join(DEFAULT_ARMS),
                        help=f"comma-separated arm names of {[arm.name for arm in ARMS]} (default: the first four)")
    args = parser.parse_args(argv)
    if args.steps <= args.warmup:
        parser.error(f"--steps ({args.steps}) must exceed --warmup ({args.warmup})")
    if not args.tiny and not torch.cuda.is_available():
        parser.error("no GPU: the default model (24 layers x 2048, 1.34B parameters) is measured on one GPU; "
                     "pass --tiny to run the same arms on the CPU with a tiny GPT")
    device = torch.device("cpu") if args.tiny else torch.device("cuda", 0)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    shape = TINY if args.tiny else H100_RUN
    if args.num_layers is not None:
        shape = dataclasses.replace(shape, num_layers=args.num_layers)
    bf16 = device.type == "cuda"  # bf16 compute on a GPU (fp32 is the fast dtype on a CPU)
    names = args.arms.split(",")
    unknown = sorted(set(names) - {arm.name for arm in ARMS})
    if unknown:
        raise ValueError(f"--arms: unknown arm(s) {unknown}; choose from {[arm.name for arm in ARMS]}")
    _setup(device)
    cpu_model = build_model(shape, bf16)
    results = []
    for arm in ARMS:
        if arm.name in names:
            results.append(run_arm(arm, cpu_model, shape, device, args.steps, args.warmup, bf16))
            print(f"{arm.name}: losses {results[-1].losses}", flush=True)
    print(f"device: {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}; "
          f"{results[0].num_params:,} parameters; {shape}")
    print(format_table(results), flush=True)
    return results


if __name__ == "__main__":
    main()
