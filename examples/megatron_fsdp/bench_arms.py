"""The arms of the benchmark: how each one wraps the same model and builds its optimizer.

Every arm gets a freshly built `BenchGPT` with identical weights and returns `(train_model, optimizer)` where
`train_model(tokens, labels)` gives the local mean loss, `loss.backward()` leaves synchronised gradients behind
(or queued, for Megatron-FSDP whose `optimizer.step()` finishes them), and `optimizer.step()` updates weights.
"""

import dataclasses
import importlib

import torch

from examples.megatron_fsdp.bench_model import TransformerBlock


@dataclasses.dataclass(frozen=True)
class ArmSpec:
    name: str
    label: str
    family: str  # "ddp" | "fsdp2" | "megatron_fsdp"
    zero_strategy: int  # ZeRO level the arm implements, for the theory columns
    reshard_after_forward: bool = True
    overlap: bool = True

    @property
    def is_megatron_fsdp(self):
        return self.family == "megatron_fsdp"


ARMS = {
    spec.name: spec
    for spec in (
        ArmSpec("ddp", "torch DDP", "ddp", 0),
        ArmSpec("fsdp2", "torch FSDP2, fully_shard per block + root", "fsdp2", 3),
        ArmSpec(
            "fsdp2_no_reshard", "torch FSDP2, reshard_after_forward=False", "fsdp2", 3, reshard_after_forward=False
        ),
        ArmSpec("mfsdp0", "megatron_fsdp no_shard (0)", "megatron_fsdp", 0),
        ArmSpec("mfsdp1", "megatron_fsdp optim (1)", "megatron_fsdp", 1),
        ArmSpec("mfsdp2", "megatron_fsdp optim_grads (2)", "megatron_fsdp", 2),
        ArmSpec("mfsdp3", "megatron_fsdp optim_grads_params (3)", "megatron_fsdp", 3),
        ArmSpec("mfsdp3_no_overlap", "megatron_fsdp 3, overlap off", "megatron_fsdp", 3, overlap=False),
    )
}


class MegatronFSDPUnavailable(RuntimeError):
    """megatron_fsdp cannot be imported or lacks the entry points the benchmark calls."""


def regathered_param_bytes(spec, param_bytes):
    """Parameter bytes all-gathered a second time, for backward, under ZeRO-3: all of them unless the arm
    keeps parameters gathered from forward to backward (FSDP2 re-gathers its root unit too, measured)."""
    if spec.zero_strategy != 3 or not spec.reshard_after_forward:
        return 0
    return param_bytes


def _adamw(params, lr):
    return torch.optim.AdamW(params, lr=lr, weight_decay=0.01)


def _build_ddp(model, device, lr):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel

    device_ids = [device.index] if device.type == "cuda" else None
    wrapped = DistributedDataParallel(model, device_ids=device_ids)
    # The stock hook all-reduces each bucket through dist.all_reduce, where the collective counter sees it.
    wrapped.register_comm_hook(None, default_hooks.allreduce_hook)
    return wrapped, _adamw(wrapped.parameters(), lr)


def _build_fsdp2(model, spec, lr):
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:
        fully_shard(block, reshard_after_forward=spec.reshard_after_forward)
    fully_shard(model, reshard_after_forward=spec.reshard_after_forward)
    return model, _adamw(model.parameters(), lr)


def load_megatron_fsdp_entry_points():
    """(fully_shard_model, fully_shard_optimizer) from the installed package, or MegatronFSDPUnavailable."""
    try:
        package = importlib.import_module("megatron_fsdp")
    except Exception as error:  # any import failure makes the arm unavailable, not the benchmark
        raise MegatronFSDPUnavailable(f"megatron_fsdp not available: {type(error).__name__}: {error}") from error
    entry_points = []
    for name in ("fully_shard_model", "fully_shard_optimizer"):
        function = getattr(package, name, None)
        if function is None:
            try:
                function = getattr(importlib.import_module("megatron_fsdp.fully_shard"), name, None)
            except Exception:
                function = None
        if function is None:
            raise MegatronFSDPUnavailable(f"megatron_fsdp not available: it has no `{name}`")
        entry_points.append(function)
    return tuple(entry_points)


def _build_megatron_fsdp(model, spec, device, lr):
    fully_shard_model, fully_shard_optimizer = load_megatron_fsdp_entry_points()
    wrapped = fully_shard_model(
        model,
        fsdp_unit_modules=[TransformerBlock],
        zero_dp_strategy=spec.zero_strategy,
        device=device,
        overlap_grad_reduce=spec.overlap,
        overlap_param_gather=spec.overlap,
    )
    optimizer = fully_shard_optimizer(_adamw(wrapped.parameters(), lr))
    return wrapped, optimizer


def build_arm(spec, model, device, lr):
    if spec.family == "ddp":
        return _build_ddp(model, device, lr)
    if spec.family == "fsdp2":
        return _build_fsdp2(model, spec, lr)
    if spec.family == "megatron_fsdp":
        return _build_megatron_fsdp(model, spec, device, lr)
    raise ValueError(f"unknown arm family {spec.family!r}")


def _json_safe(value):
    if isinstance(value, dict):
        return {str(key): _json_safe(item) for key, item in value.items()}
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    return value if isinstance(value, (bool, int, float, str, type(None))) else repr(value)


def package_memory_report(model):
    """Megatron-FSDP's own account of the bytes this rank holds (`memory_report()`), or None for other arms."""
    method = getattr(model, "memory_report", None)
    return _json_safe(method()) if callable(method) else None


def package_communication_report(model):
    """Megatron-FSDP's cumulative bytes sent by this rank per collective kind, or None for other arms."""
    method = getattr(model, "communication_report", None)
    return _json_safe(method()) if callable(method) else None


def state_from_memory_report(report):
    """(params, grads, optimizer) bytes from a Megatron-FSDP memory report: compute + main weights are params."""
    return {
        "params": report.get("compute_weights", 0) + report.get("main_weights", 0),
        "grads": report.get("grads", 0),
        "optimizer": report.get("optimizer_state", 0),
    }
