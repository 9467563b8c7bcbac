"""Optimizer CPU offload (`--optimizer-cpu-offload`): the hybrid host/device optimizer and its host optimizer."""

import torch

from megatron.core.optimizer.cpu_offloading.hybrid_optimizer import HybridDeviceOptimizer, offload_split

__all__ = ["HybridDeviceOptimizer", "offload_split", "host_optimizer_factory", "hybrid_optimizer_factory"]


def host_optimizer_factory(config):
    """Builds the optimizer that steps the offloaded part in host memory: the precision-aware AdamW (its torch
    implementation, with the configured state dtypes), or with `use_torch_optimizer_for_cpu_offload`
    torch's multi-tensor AdamW (fp32 state)."""
    from megatron.core.optimizer.precision_aware_adam import build_precision_aware_adam

    def build(groups):
        if config.use_torch_optimizer_for_cpu_offload:
            return torch.optim.AdamW(groups, lr=config.lr, weight_decay=config.weight_decay,
                                     betas=(config.adam_beta1, config.adam_beta2), eps=config.adam_eps, foreach=True)
        return build_precision_aware_adam(groups, config, torch.device("cpu"))

    return build


def hybrid_optimizer_factory(config, device_optimizer_factory):
    """Wraps `device_optimizer_factory` (param groups -> optimizer) into one building a `HybridDeviceOptimizer`."""

    def build(groups):
        return HybridDeviceOptimizer(groups, device_optimizer_factory, host_optimizer_factory(config),
                                     offload_fraction=config.optimizer_offload_fraction,
                                     overlap_d2h_h2d=config.overlap_cpu_optimizer_d2h_h2d,
                                     pin_cpu_grads=config.pin_cpu_grads, pin_cpu_params=config.pin_cpu_params)

    return build
