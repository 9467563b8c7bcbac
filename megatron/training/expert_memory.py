"""The Mixture-of-Experts part of the memory line: bytes this rank holds for its expert parameters.

Each expert-parallel rank holds only its local experts, so these are 1/EP of all experts' bytes (and, where a
wrapper shards them over the expert data-parallel group, the distributed optimizer's main weights and state or
FSDP2's parameters and gradients, a further 1/expert-DP of that).

Counted from the model chunks' expert parameters (their local part: a DTensor's shard), their `main_grad` (DDP
buffer view) or `.grad`, and the torch optimizers' state of expert main parameters plus those main parameters
that are not the model's own tensors (fp32 copies, distributed-optimizer shards), and `--optimizer-cpu-offload`'s
host gradients and host copies of expert main parameters, as the line's totals count them. Megatron-FSDP keeps its
parameters in flat buffers it accounts for itself: its chunks report their expert part (`expert_state_bytes()`).
"""

import torch

from megatron.core.distributed.data_parallel_base import local_tensor, storage_key, tensor_bytes
from megatron.core.expert_parameters import is_expert_parameter
from megatron.training.host_memory import offload_copy_bytes


def _grad_of(param):
    main_grad = getattr(param, "main_grad", None)
    return main_grad if main_grad is not None else param.grad


def expert_memory_usage(model_chunks, torch_optimizers):
    """{"expert_params_bytes", "expert_grads_bytes", "expert_optimizer_state_bytes"} of this rank, or {} when its
    chunks hold no expert parameters (or are bare Megatron-FSDP package wrappers, see the module docstring)."""
    from megatron.core.dist_checkpointing.fsdp_state import is_fsdp_chunk

    if any(is_fsdp_chunk(chunk) for chunk in model_chunks):
        if not all(hasattr(chunk, "expert_state_bytes") for chunk in model_chunks):
            return {}
        reports = [report for report in (chunk.expert_state_bytes() for chunk in model_chunks) if report]
        return _with_offload_copies({key: sum(report[key] for report in reports) for key in reports[0]},
                                    torch_optimizers) if reports else {}
    experts = [param for chunk in model_chunks for param in chunk.parameters() if is_expert_parameter(param)]
    if not experts:
        return {}
    model_storages = {storage_key(param) for chunk in model_chunks for param in chunk.parameters()} - {None}
    optimizer_bytes = 0
    for torch_optimizer in torch_optimizers:
        for group in torch_optimizer.param_groups:
            for main_param in group["params"]:
                if not is_expert_parameter(main_param):
                    continue
                state = torch_optimizer.state.get(main_param, {})
                optimizer_bytes += sum(tensor_bytes(value) for value in state.values()
                                       if torch.is_tensor(value) and local_tensor(value).dim() > 0)
                if storage_key(main_param) not in model_storages:
                    optimizer_bytes += tensor_bytes(main_param)
    return _with_offload_copies({
        "expert_params_bytes": sum(tensor_bytes(param) for param in experts),
        "expert_grads_bytes": sum(tensor_bytes(_grad_of(param)) for param in experts
                                  if _grad_of(param) is not None),
        "expert_optimizer_state_bytes": optimizer_bytes,
    }, torch_optimizers)


def _with_offload_copies(memory, torch_optimizers):
    """`memory` plus `--optimizer-cpu-offload`'s host gradients and host main-parameter copies of the experts."""
    copies = offload_copy_bytes(torch_optimizers, select=is_expert_parameter)
    return {**memory, "expert_grads_bytes": memory["expert_grads_bytes"] + copies["grads_bytes"],
            "expert_optimizer_state_bytes": memory["expert_optimizer_state_bytes"] + copies["optimizer_state_bytes"]}


def format_expert_memory(memory) -> str:
    """The line's expert fields (empty without them)."""
    if "expert_params_bytes" not in memory:
        return ""
    return (f" experts: params {memory['expert_params_bytes']} bytes, grads {memory['expert_grads_bytes']} bytes, "
            f"optimizer state {memory['expert_optimizer_state_bytes']} bytes |")
