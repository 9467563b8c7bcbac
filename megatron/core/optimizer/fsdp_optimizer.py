"""`MegatronFSDPOptimizer`: Megatron's optimizer step on the sharded main weights of Megatron-FSDP model chunks.

For each chunk of the rank (one, or one per virtual pipeline stage with an interleaved pipeline) a torch
optimizer is built from that chunk's parameters and handed to `megatron_fsdp.fully_shard_optimizer`, which
re-points it at Megatron-FSDP's main-weight views (fp32 by default; this rank's shard piece of each parameter
under ZeRO-1..3, the whole parameter under ZeRO-0; with Muon those pieces are marked as pieces of their matrix,
see muon.py) and installs the updated weights into the model after every
`step()`. A chunk without parameters (an empty pipeline stage, passing its input on) gets no optimizer: it has
nothing to step, gather or reduce. Gradients arrive attached to those views by `finish_grad_sync` (called from
`finalize_model_grads`, which also applies the tensor- and pipeline-parallel all-reduces to them). With several
chunks the per-chunk optimizers sit behind one `ChunkOptimizers` (`self.optimizer`): the statistics below, the
clipping and `zero_grad` run over the main weights of all chunks at once, so the norm is the global one.

Around that, the usual Megatron step: fp16 loss-scale unscaling with overflow agreed over every rank (a step
with inf/nan is skipped on all ranks), global grad-norm clipping and the zero count. Each gradient element is
counted once: pieces are disjoint over the data-parallel shard ranks (and the outer ranks under HFSDP), so those
groups are summed over; duplicates across tensor-parallel ranks count on TP rank 0 only and the tied embedding
on the first pipeline stage only (the `tensor_model_parallel` / `shared_embedding` attributes are carried over
to the main-weight views), summed over the model-parallel group. Expert parameters under expert parallelism are
sharded over the expert data-parallel group: their sums go over that group, the expert-parallel group and the
model-parallel group.
"""

import functools
from typing import List, NamedTuple

import torch
import torch.distributed as dist

from megatron.core.expert_parameters import expert_grad_stats_groups, model_has_expert_parameters
from megatron.core.offloading.placement import InstallTarget, mark_relocatable
from megatron.core.optimizer.muon import mark_matrix_piece
from megatron.core.optimizer.optimizer import MegatronOptimizer, copy_parallel_attributes
from megatron.core.optimizer.precision_aware_adam import optimizer_grad


def _megatron_fsdp_chunks(model_chunks):
    from megatron.core.distributed.fsdp.mcore_fsdp_adapter import MegatronFSDPAdapter

    chunks = [chunk for chunk in model_chunks if isinstance(chunk, MegatronFSDPAdapter)]
    if len(chunks) != len(model_chunks):
        raise ValueError(
            "MegatronFSDPOptimizer: every model chunk must be wrapped in megatron.core.distributed."
            "MegatronFSDPAdapter (--use-megatron-fsdp); got a mix of wrappers"
        )
    if not chunks:
        raise ValueError("MegatronFSDPOptimizer: no model chunks")
    return chunks


def let_offloaded_main_weights_move_to_host(fsdp_model, optimizer):
    """Optimizer CPU offload of Megatron-FSDP's main weights. `optimizer`: the torch optimizer that
    `fully_shard_optimizer` pointed at the main weights of `fsdp_model` (a `megatron_fsdp.MegatronFSDP`); nothing
    happens unless it is a `HybridDeviceOptimizer` (`--optimizer-cpu-offload`). The views it will step on the host
    whose group keeps its main weights in a buffer of their own (fp32 main weights under bf16 compute) get
    storages of their own (`separate_main_weights`) and are marked relocatable, and the split is built now: the
    hybrid optimizer moves them into host memory (pinned where the device can pin), so the device keeps neither
    their main weights nor their moments. After each host step it copies their new values into the compute
    weights itself (the group's `main_install_target`, cast to the compute dtype on the host, on its upload
    stream: a side stream with `--overlap-cpu-optimizer-d2h-h2d`), and the wrapper's post-step install skips them.
    Main weights that share the compute weights' storage (in the compute dtype, outside HFSDP) have nothing
    separate to move: they keep a stepped host copy."""
    planned_offload = getattr(optimizer, "planned_offload", None)
    if planned_offload is None:
        return
    offloaded = {id(view) for view in planned_offload()}
    for group in fsdp_model.groups:
        if not group.main_weights_standalone:
            continue
        indices = [index for index, view in enumerate(group.main_param_views) if id(view) in offloaded]
        if indices:
            group.separate_main_weights()
            for index in indices:
                target = group.main_install_target(index)
                mark_relocatable(group.main_param_views[index], install_into=None if target is None else InstallTarget(
                    target, functools.partial(group.note_main_installed, index)))
    optimizer.offloaded_params()  # builds the split: the marked views move to the host here


class ChunkOptimizers:
    """The torch optimizers of several Megatron-FSDP chunks (one per chunk, each from `fully_shard_optimizer`)
    behind one torch-optimizer-like object: `param_groups` is the concatenation of theirs (the same dicts, so the
    scheduler's learning rates reach every chunk), `state` their merged state, and `step` / `zero_grad` run on
    each. `state_dict()` is the list of theirs; checkpoints (torch_dist) read each chunk's optimizer through
    `MegatronFSDPOptimizer.chunk_optimizers` instead, under the logical names of its parameters."""

    def __init__(self, optimizers):
        self.optimizers = list(optimizers)

    @property
    def chained_optimizers(self):
        return self.optimizers

    @property
    def param_groups(self):
        return [group for optimizer in self.optimizers for group in optimizer.param_groups]

    @property
    def state(self):
        merged = {}
        for optimizer in self.optimizers:
            merged.update(optimizer.state)
        return merged

    def step(self, closure=None):
        if closure is not None:
            raise ValueError("MegatronFSDPOptimizer over several model chunks steps without a closure")
        for optimizer in self.optimizers:
            optimizer.step()

    def zero_grad(self, set_to_none=True):
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self):
        return {"chunk_optimizers": [optimizer.state_dict() for optimizer in self.optimizers]}

    def load_state_dict(self, state_dict):
        saved = state_dict["chunk_optimizers"]
        if len(saved) != len(self.optimizers):
            raise ValueError(f"optimizer state of {len(saved)} model chunks, this optimizer steps "
                             f"{len(self.optimizers)}")
        for optimizer, chunk_state in zip(self.optimizers, saved):
            optimizer.load_state_dict(chunk_state)


class ChunkOptimizer(NamedTuple):
    """One Megatron-FSDP chunk, the torch optimizer (from `fully_shard_optimizer`) stepping its main weights,
    and for each of that optimizer's param groups the index of the group it came from in the param groups the
    `MegatronFSDPOptimizer` was built with (a chunk without parameters of some group has no such group)."""

    chunk: object
    optimizer: torch.optim.Optimizer
    group_indices: List[int]


class MegatronFSDPOptimizer(MegatronOptimizer):
    """Steps the main weights of the `MegatronFSDPAdapter` chunks of this rank; see the module docstring.

    Args:
        param_groups: groups from `get_param_groups(model_chunks, ...)` (hyper-parameters, wd/lr multipliers).
        optimizer_factory: builds the torch optimizer from param groups (called once per chunk).
        config: `OptimizerConfig`.
        model_chunks: the Megatron-FSDP chunks of this rank (one, or one per virtual pipeline stage).
        grad_scaler: fp16 loss scaler or None.
        model_parallel_groups: groups spanning the model-parallel ranks (TP x PP) of this rank.
        data_parallel_group: every data-parallel rank of this stage (overflow is agreed on over it too).
    """

    def __init__(self, param_groups, optimizer_factory, config, model_chunks, grad_scaler=None,
                 model_parallel_groups=(), data_parallel_group=None):
        import megatron_fsdp

        self.chunks = _megatron_fsdp_chunks(list(model_chunks))
        self.chunk = self.chunks[0]
        self.model_chunks = self.chunks  # what `sharded_state_dict` checkpoints
        param_groups = list(param_groups)
        placed = set()
        self.chunk_optimizers = []
        for chunk in self.chunks:
            real_groups, group_indices = [], []
            for index, group in enumerate(param_groups):
                params = [chunk.real_parameter(param) for param in group["params"] if chunk.owns(param)]
                placed.update(id(param) for param in group["params"] if chunk.owns(param))
                if params or len(self.chunks) == 1:
                    real_groups.append({**group, "params": params})
                    group_indices.append(index)
            if not real_groups:
                continue  # a chunk without parameters (an empty pipeline stage) has nothing to step
            # The main-weight views stand in for the parameters in gradient statistics: give them their attributes.
            # Muon (`use_muon` groups) assembles each matrix from its flat pieces over the shard groups.
            for group in real_groups:
                for param in group["params"]:
                    main_param = chunk.main_param_of(param)
                    if main_param is not None:
                        copy_parallel_attributes(param, main_param)
                        piece = chunk.main_piece_of(param) if group.get("use_muon", False) else None
                        if piece is not None:
                            mark_matrix_piece(main_param, *piece)
            torch_optimizer = megatron_fsdp.fully_shard_optimizer(
                optimizer_factory(real_groups),
                preproc_state_dict_for_dcp_ckpt=chunk.ddp_config.preproc_state_dict_for_dcp_ckpt,
                install_after_step=False,  # `_copy_main_params_to_model_params` installs them, timed on its own
                step_params_without_grads=True,  # as upstream: zero gradients where no rank gave one
            )
            let_offloaded_main_weights_move_to_host(chunk.fsdp, torch_optimizer)
            self.chunk_optimizers.append(ChunkOptimizer(chunk, torch_optimizer, group_indices))
        stray = [param for group in param_groups for param in group["params"] if id(param) not in placed]
        if stray:
            raise ValueError(f"MegatronFSDPOptimizer: {len(stray)} parameter(s) of the param groups belong to none "
                             "of the model chunks")
        self.num_param_groups = len(param_groups)
        torch_optimizer = (self.chunk_optimizers[0].optimizer if len(self.chunks) == 1
                           else ChunkOptimizers(entry.optimizer for entry in self.chunk_optimizers))
        # Every chunk of a rank shards over the same groups (one stage's data-parallel mesh).
        grad_stats_groups = list(model_parallel_groups) + self.chunk.grad_shard_groups()
        found_inf_groups = list(model_parallel_groups) + ([data_parallel_group] if data_parallel_group else [])
        # Expert statistics: summed over model parallel, over the other experts (expert parallel) and over the
        # ranks sharding each expert (expert data parallel under expert parallelism, DP x CP at EP1).
        expert_groups = None
        if model_has_expert_parameters(self.chunks):
            # A chunk with expert groups of its own gives them (with an interleaved pipeline the first chunk may
            # hold no MoE layer); every chunk of a rank has the same expert data-parallel group.
            expert_chunks = [chunk for chunk in self.chunks if chunk.fsdp.expert_topology is not None]
            expert_groups = expert_grad_stats_groups() + (expert_chunks or self.chunks)[0].expert_grad_shard_groups()
        super().__init__(torch_optimizer, config, grad_scaler, grad_stats_groups, found_inf_groups, expert_groups)

    def model_params(self):
        return []

    def _device(self):
        return self.chunk.device

    def _copy_model_grads_to_main_grads(self):
        # A no-op when finalize_model_grads already finished the step's reductions.
        for chunk in self.chunks:
            chunk.finish_grad_sync()

    def _copy_main_params_to_model_params(self):
        """Cast the new main weights into the compute weights of every chunk that has an optimizer (and gather
        them under ZeRO-1/2)."""
        for entry in self.chunk_optimizers:
            entry.chunk.fsdp.install_optimized_model_weights()

    def _unscale_main_grads_and_check_for_nan(self):
        found_inf = torch.zeros(1, dtype=torch.float32, device=self._device())
        grads = [optimizer_grad(param) for param in self.main_params()
                 if optimizer_grad(param) is not None and optimizer_grad(param).numel() > 0]
        if grads:
            torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, self.grad_scaler.inv_scale.to(
                found_inf.device))
        for group in self.found_inf_groups:
            if group is not None and dist.get_world_size(group) > 1:
                dist.all_reduce(found_inf, op=dist.ReduceOp.MAX, group=group)
        return found_inf.item() > 0

    def zero_grad(self, set_to_none=True):
        """Drop the main-weight gradients and zero Megatron-FSDP's gradient buffers (of every chunk)."""
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def reload_model_params(self):
        """Nothing to do: loading the model's state dict writes Megatron-FSDP's main weights too."""
