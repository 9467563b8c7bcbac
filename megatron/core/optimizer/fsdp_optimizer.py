"""`MegatronFSDPOptimizer`: Megatron's optimizer step on the sharded main weights of a Megatron-FSDP model chunk.

The torch optimizer is built from the chunk's parameters and handed to `megatron_fsdp.fully_shard_optimizer`,
which re-points it at Megatron-FSDP's main-weight views (fp32 by default; this rank's shard piece of each
parameter under ZeRO-1..3, the whole parameter under ZeRO-0) and installs the updated weights into the model
after every `step()`. Gradients arrive attached to those views by `finish_grad_sync` (called from
`finalize_model_grads`, which also applies the tensor- and pipeline-parallel all-reduces to them).

Around that, the usual Megatron step: fp16 loss-scale unscaling with overflow agreed over every rank (a step
with inf/nan is skipped on all ranks), global grad-norm clipping and the zero count. Each gradient element is
counted once: pieces are disjoint over the data-parallel shard ranks (and the outer ranks under HFSDP), so those
groups are summed over; duplicates across tensor-parallel ranks count on TP rank 0 only and the tied embedding
on the first pipeline stage only (the `tensor_model_parallel` / `shared_embedding` attributes are carried over
to the main-weight views), summed over the model-parallel group.
"""

import torch
import torch.distributed as dist

from megatron.core.optimizer.optimizer import MegatronOptimizer, copy_parallel_attributes


def _megatron_fsdp_chunk(model_chunks):
    from megatron.core.distributed.fsdp.mcore_fsdp_adapter import MegatronFSDPAdapter

    chunks = [chunk for chunk in model_chunks if isinstance(chunk, MegatronFSDPAdapter)]
    if len(chunks) != len(model_chunks):
        raise ValueError(
            "MegatronFSDPOptimizer: every model chunk must be wrapped in megatron.core.distributed."
            "MegatronFSDPAdapter (--use-megatron-fsdp); got a mix of wrappers"
        )
    if len(chunks) != 1:
        raise ValueError(
            f"MegatronFSDPOptimizer steps one Megatron-FSDP model chunk per rank, got {len(chunks)} (virtual "
            "pipeline stages are not supported with --use-megatron-fsdp)"
        )
    return chunks[0]


class MegatronFSDPOptimizer(MegatronOptimizer):
    """Steps a `MegatronFSDPAdapter` chunk's main weights; see the module docstring.

    Args:
        param_groups: groups from `get_param_groups(model_chunks, ...)` (hyper-parameters, wd/lr multipliers).
        optimizer_factory: builds the torch optimizer from param groups.
        config: `OptimizerConfig`.
        model_chunks: [the Megatron-FSDP chunk of this rank].
        grad_scaler: fp16 loss scaler or None.
        model_parallel_groups: groups spanning the model-parallel ranks (TP x PP) of this rank.
        data_parallel_group: every data-parallel rank of this stage (overflow is agreed on over it too).
    """

    def __init__(self, param_groups, optimizer_factory, config, model_chunks, grad_scaler=None,
                 model_parallel_groups=(), data_parallel_group=None):
        import megatron_fsdp

        self.chunk = _megatron_fsdp_chunk(list(model_chunks))
        real_groups = []
        for group in param_groups:
            params = [self.chunk.real_parameter(param) for param in group["params"]]
            real_groups.append({**group, "params": params})
        # The main-weight views stand in for the parameters in gradient statistics: give them their attributes.
        for group in real_groups:
            for param in group["params"]:
                main_param = self.chunk.main_param_of(param)
                if main_param is not None:
                    copy_parallel_attributes(param, main_param)
        torch_optimizer = megatron_fsdp.fully_shard_optimizer(
            optimizer_factory(real_groups),
            preproc_state_dict_for_dcp_ckpt=self.chunk.ddp_config.preproc_state_dict_for_dcp_ckpt,
        )
        grad_stats_groups = list(model_parallel_groups) + self.chunk.grad_shard_groups()
        found_inf_groups = list(model_parallel_groups) + ([data_parallel_group] if data_parallel_group else [])
        super().__init__(torch_optimizer, config, grad_scaler, grad_stats_groups, found_inf_groups)

    def model_params(self):
        return []

    def _device(self):
        return self.chunk.device

    def _copy_model_grads_to_main_grads(self):
        # A no-op when finalize_model_grads already finished the step's reductions.
        self.chunk.finish_grad_sync()

    def _copy_main_params_to_model_params(self):
        """Done by `fully_shard_optimizer`'s step: the new main weights are cast into the compute weights (and
        gathered under ZeRO-1/2) right after the torch optimizer steps."""

    def _unscale_main_grads_and_check_for_nan(self):
        found_inf = torch.zeros(1, dtype=torch.float32, device=self._device())
        grads = [param.grad for param in self.main_params() if param.grad is not None and param.grad.numel() > 0]
        if grads:
            torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, self.grad_scaler.inv_scale.to(
                found_inf.device))
        for group in self.found_inf_groups:
            if group is not None and dist.get_world_size(group) > 1:
                dist.all_reduce(found_inf, op=dist.ReduceOp.MAX, group=group)
        return found_inf.item() > 0

    def zero_grad(self, set_to_none=True):
        """Drop the main-weight gradients and zero Megatron-FSDP's gradient buffers."""
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def reload_model_params(self):
        """Nothing to do: loading the model's state dict writes Megatron-FSDP's main weights too."""
