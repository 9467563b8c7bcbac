"""The host part of the memory line: bytes that offloading keeps in host memory (pinned on a GPU run).

Present only when some offloading is on; counted from the storages the offloading paths put on the host, each
storage once (a tensor's bytes, its local shard for a DTensor):
- `--optimizer-cpu-offload` (`HybridDeviceOptimizer`): the host copies of the offloaded main parameters, their
  host gradients, the host optimizer's state and the compute-dtype staging buffers of uploads into an owner's
  install target (Megatron-FSDP's bf16 compute weights);
- `--megatron-fsdp-param-offload`: the shard buffers of each offloaded Megatron-FSDP group (compute shard, main
  weights, main and optimizer gradients) and the optimizer's state of its main weights;
- `--torch-fsdp2-cpu-offload`: FSDP2's parameter shards, their gradient shards and their optimizer state.
On a CPU run the host is the device: these bytes are the same memory the rest of the line counts.
"""

from typing import Optional

import torch

from megatron.core.distributed.data_parallel_base import local_tensor, storage_key, tensor_bytes


def _chunk_offloaded_tensors(chunk):
    """Tensors a model chunk's wrapper keeps in host memory, and whether it offloads at all."""
    fsdp = getattr(chunk, "fsdp", None)  # MegatronFSDPAdapter's megatron_fsdp.MegatronFSDP
    if fsdp is not None and getattr(fsdp, "offload", None) is not None:
        return True, [buffer for group in fsdp.groups if group.offload is not None
                      for buffer in (group.compute_shard, group.main_weights, group.main_grads, group.optim_grads)]
    ddp_config = getattr(chunk, "ddp_config", None)
    if ddp_config is not None and getattr(ddp_config, "torch_fsdp2_cpu_offload", False):
        return True, [tensor for param in chunk.parameters() for tensor in (param, param.grad)]
    return False, []


def _state_tensors(state):
    return [value for value in state.values() if torch.is_tensor(value)]


def host_offload_bytes(model_chunks, torch_optimizers) -> Optional[int]:
    """Bytes this rank holds in host memory for offloading (see the module docstring); None without offloading."""
    offloading, tensors = False, []
    for chunk in model_chunks:
        chunk_offloads, chunk_tensors = _chunk_offloaded_tensors(chunk)
        offloading |= chunk_offloads
        tensors += chunk_tensors
    offloaded_storages = {storage_key(tensor) for tensor in tensors if tensor is not None} - {None}
    for optimizer in torch_optimizers:
        for entry in getattr(optimizer, "offloaded", None) or []:  # HybridDeviceOptimizer's host side
            offloading = True
            tensors += [entry.host_param, entry.host_grad, getattr(entry, "staging", None)]
            tensors += _state_tensors(optimizer.state.get(entry.device_param, {}))
        # State the optimizer keeps next to offloaded main weights (created on their device: the host).
        for group in optimizer.param_groups:
            for param in group["params"]:
                if storage_key(param) in offloaded_storages:
                    tensors += _state_tensors(optimizer.state.get(param, {}))
    if not offloading:
        return None
    return _distinct_bytes(tensor for tensor in tensors if tensor is not None)


def offload_copy_bytes(torch_optimizers, select=None) -> dict:
    """Bytes `--optimizer-cpu-offload` holds beside the model's and the optimizer's own tensors, which the line's
    other counts do not reach: the host gradients of the offloaded main parameters (`grads_bytes`), and the host
    copies of the main parameters it keeps a device view of plus the compute-dtype staging buffers of uploads
    (`optimizer_state_bytes`). A relocated main parameter is its host copy: counted where the parameter is.
    `select(main_param)`, when given, keeps only the main parameters it accepts (the experts' part of the line)."""
    grads, optimizer_side = [], []
    for optimizer in torch_optimizers:
        for entry in getattr(optimizer, "offloaded", None) or []:
            if select is not None and not select(entry.device_param):
                continue
            grads.append(entry.host_grad)
            if storage_key(entry.host_param) != storage_key(entry.device_param):
                optimizer_side.append(entry.host_param)
            optimizer_side.append(getattr(entry, "staging", None))
    return {"grads_bytes": _distinct_bytes(t for t in grads if t is not None),
            "optimizer_state_bytes": _distinct_bytes(t for t in optimizer_side if t is not None)}


def _distinct_bytes(tensors) -> int:
    """Bytes of `tensors`' local parts, bytes shared between them (views of one storage, such as a group's
    main weights and its per-parameter views, or gradients that are views of one flat buffer) counted once."""
    spans_by_storage = {}
    for tensor in tensors:
        key = storage_key(tensor)
        if key is None:
            continue
        local = local_tensor(tensor)
        start = local.storage_offset() * local.element_size()
        spans_by_storage.setdefault(key, []).append((start, start + tensor_bytes(local)))
    total = 0
    for spans in spans_by_storage.values():
        covered_to = 0
        for start, end in sorted(spans):
            start = max(start, covered_to)
            if end > start:
                total += end - start
                covered_to = end
    return total


def format_host_memory(memory) -> str:
    """The line's host field (empty without offloading)."""
    if "host_offload_bytes" not in memory:
        return ""
    where = "host memory" if memory["on_gpu"] else "host memory, on CPU the same memory as the device"
    return f" offloaded ({where}): {memory['host_offload_bytes']} bytes |"
