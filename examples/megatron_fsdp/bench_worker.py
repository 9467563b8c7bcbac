"""What one rank does for one measurement of one arm: build, train N steps, measure, return a JSON-able dict.

The process group must already exist. Collectives are counted per step (the counter is reset before each
step), state bytes are read after the last optimizer step (gradients still held), and peak RSS comes from both
the lifetime high-water mark and a sampler started just before the model is built.
"""

import gc
import os
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

from examples.megatron_fsdp import comm_counter
from examples.megatron_fsdp.bench_arms import (
    ARMS,
    MegatronFSDPUnavailable,
    build_arm,
    package_communication_report,
    package_memory_report,
)
from examples.megatron_fsdp.bench_model import MODEL_PRESETS, build_model, mock_batches, rank_micro_batch
from examples.megatron_fsdp.memory_probe import RssSampler, held_state_bytes, lifetime_peak_rss_bytes

DATA_SEED_OFFSET = 1


def device_for_backend():
    """cuda:LOCAL_RANK under NCCL, cpu otherwise: the device follows the process group, not the machine."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def synchronize(device):
    if device.type != "cpu":
        getattr(torch, device.type).synchronize(device)


def init_process_group_from_env(timeout_s):
    """Join the group described by torchrun-style env vars; NCCL when CUDA is usable, gloo otherwise."""
    backend = "nccl" if torch.cuda.is_available() and os.environ.get("BENCH_BACKEND", "") != "gloo" else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend=backend, timeout=timedelta(seconds=timeout_s))


def _last_step_difference(cumulative_reports):
    """Per-kind bytes of the last step from cumulative reports (None when the arm has no such report)."""
    if not cumulative_reports or cumulative_reports[-1] is None:
        return None
    last = cumulative_reports[-1]
    before = cumulative_reports[-2] if len(cumulative_reports) > 1 else {}
    return {kind: value - before.get(kind, 0) for kind, value in last.items() if isinstance(value, (int, float))}


def run_arm(arm_name, model_name, steps, warmup_steps, seed, lr):
    """Train one arm on this rank; returns measurements, or `{"error": ...}` if the arm could not run."""
    spec = ARMS[arm_name]
    config = MODEL_PRESETS[model_name]
    device = device_for_backend()
    rank, world_size = dist.get_rank(), dist.get_world_size()
    counter = comm_counter.install()
    all_tokens = mock_batches(config, steps, seed + DATA_SEED_OFFSET)
    gc.collect()
    sampler = RssSampler().start()
    result = {"arm": arm_name, "rank": rank, "world_size": world_size, "error": None}
    model = optimizer = None
    try:
        model = build_model(config, seed, device)
        train_model, optimizer = build_arm(spec, model, device, lr)
        step_times, phase_times, losses, comm_per_step, package_comm_per_step = [], [], [], [], []
        for step in range(steps):
            tokens, labels = rank_micro_batch(all_tokens, step, rank, world_size, device)
            counter.reset()
            synchronize(device)
            started = time.perf_counter()
            with counter.counting():
                optimizer.zero_grad()
                loss = train_model(tokens, labels)
                synchronize(device)
                forward_done = time.perf_counter()
                loss.backward()
                synchronize(device)
                backward_done = time.perf_counter()
                optimizer.step()
            synchronize(device)
            finished = time.perf_counter()
            step_times.append(finished - started)
            phase_times.append([forward_done - started, backward_done - forward_done, finished - backward_done])
            losses.append(loss.item())
            comm_per_step.append(counter.snapshot())
            package_comm_per_step.append(package_communication_report(train_model))  # cumulative, or None
        result.update(
            step_times=step_times,
            phase_times=phase_times,
            losses=losses,
            comm_per_step=comm_per_step,
            state_bytes=held_state_bytes(train_model, optimizer),
            package_memory=package_memory_report(train_model),
            package_comm_last_step=_last_step_difference(package_comm_per_step),
        )
    except MegatronFSDPUnavailable as error:
        result["error"] = str(error)
    except Exception as error:
        label = "megatron_fsdp failed" if spec.is_megatron_fsdp else "failed"
        result["error"] = f"{label}: {type(error).__name__}: {error}"
        result["traceback"] = traceback.format_exc()
    finally:
        model = optimizer = train_model = None  # noqa: F841 - release before the RSS reading below
        sampler.stop()
    result.update(
        rss_baseline=sampler.baseline,
        rss_arm_peak=sampler.peak,
        rss_lifetime_peak=max(sampler.lifetime_peak_at_start, lifetime_peak_rss_bytes()),
        warmup_steps=warmup_steps,
        malloc_mmap_threshold=os.environ.get("MALLOC_MMAP_THRESHOLD_"),
        threads=torch.get_num_threads(),
        backend=dist.get_backend(),
        device=str(device),
    )
    gc.collect()
    return result
