"""`MegatronFSDPAdapter`: a Megatron-Core model chunk sharded by Megatron-FSDP (ZeRO-0..3).

Upstream's name for it, `FullyShardedDataParallel`, stays importable from here, from
`megatron.core.distributed.fsdp` and from `megatron.core.distributed`; it is unrelated to torch's FSDP1 class
of the same name and to FSDP2 (`TorchFSDP2`).

The chunk (one pipeline stage's model) is wrapped with `megatron_fsdp.MegatronFSDP` on parallel_state's device
mesh: parameters, gradients and optimizer state are sharded over `dp_shard_cp` (data x context parallel), the
`tp` dim tells the checkpoint code how tensor-parallel partitions fit together, and with
`--num-distributed-optimizer-instances N > 1` the `dp_outer` dim replicates (HSDP, `outer_dp_sharding_strategy
="no_shard"`) or further shards the optimizer side (HFSDP, `"optim"`). Each `TransformerLayer` is one unit of
communication; the embedding, the final norm and the output layer form the root groups (see
`megatron.core.distributed.fsdp_units`).

With expert parallelism (`--expert-model-parallel-size` > 1) the Mixture-of-Experts expert parameters (see
`megatron.core.expert_parameters`) are grouped apart and sharded, gathered and reduced over the expert
data-parallel ranks (the ranks holding the same experts; the package's `expt_device_mesh`, with the `tp` dim
too under tensor parallelism), the dense ones over DP x CP as above. Their gradients count each expert once in
the gradient norm (`expert_grad_shard_groups()`), and the checkpoint names them by global expert index, so a
checkpoint saved at one expert-parallel size loads at another. Under HSDP / HFSDP
(`--num-distributed-optimizer-instances N` > 1) the expert mesh has a `dp_outer` dim too: expert parameters are
sharded over the expert data-parallel ranks of one instance (`parallel_state.get_expert_data_parallel_group(
partial_expert_data_parallel=True)`) and their gradients reduced (HFSDP: their optimizer side split) across the
instances over `get_outer_expert_data_parallel_group()`; N must divide the expert data-parallel size.

Training uses it through the `DataParallelWrapper` contract it implements, like Megatron's
`DistributedDataParallel`. Gradients live in Megatron-FSDP's buffers, not in `param.main_grad`:
`optimizer_grad_pieces()` hands
`finalize_model_grads` and the optimizer the gradient tensors the optimizer steps with (this rank's shard
piece of each parameter), with the process groups over which the pieces of one parameter are spread.

With `--fp8-param-gather` (`ddp_config.fp8_param_gather`, strategy 3 only) the linear weights that run in FP8
regions are all-gathered as FP8 bytes through Megatron-FSDP's gather codec hook (`megatron.core.fp8.fsdp_gather`):
after a gather each holds its dequantized value and, under `--transformer-impl local`, carries
`weight.fp8_weight` (Transformer Engine's layers take the dequantized value and quantize it again); the fp32 main
weights stay sharded and are quantized with a scale agreed over the shard and tensor-parallel groups after every
step.
"""

from contextlib import contextmanager
from typing import Callable, List, NamedTuple, Optional

import torch
import torch.distributed as dist

from megatron.core.distributed.data_parallel_base import DataParallelWrapper
from megatron.core.distributed.distributed_data_parallel_config import DistributedDataParallelConfig
from megatron.core.distributed.fsdp_units import default_fsdp_unit_modules


def _is_expert_parameter(param) -> bool:
    from megatron.core.expert_parameters import is_expert_parameter

    return is_expert_parameter(param)


class GradPiece(NamedTuple):
    """The gradient the optimizer reads for elements `[param_start, param_end)` of the flattened `param`."""

    param: torch.nn.Parameter
    grad: torch.Tensor
    param_start: int
    param_end: int


def _mixed_precision_policy(config, ddp_config: DistributedDataParallelConfig):
    """The package's dtype policy from the `--megatron-fsdp-*-dtype` fields (None there means "auto"): the
    gradients are kept and reduced in fp32 with `grad_reduce_in_fp32` (under --bf16 by default), else in the
    model's dtype (--grad-reduce-in-bf16, --fp16 without --accumulate-allreduce-grads-in-fp32), as under DDP."""
    import megatron_fsdp

    params_dtype = getattr(config, "params_dtype", torch.float32)
    main_params_dtype = ddp_config.megatron_fsdp_main_params_dtype or params_dtype
    main_grads_dtype = ddp_config.megatron_fsdp_main_grads_dtype
    if main_grads_dtype is None:
        main_grads_dtype = torch.float32 if ddp_config.grad_reduce_in_fp32 else params_dtype
    return megatron_fsdp.MixedPrecisionPolicy(
        main_params_dtype=main_params_dtype,
        main_grads_dtype=main_grads_dtype,
        grad_comm_dtype=ddp_config.megatron_fsdp_grad_comm_dtype,
    )


def _package_ddp_config(ddp_config: DistributedDataParallelConfig):
    import megatron_fsdp

    return megatron_fsdp.DistributedDataParallelConfig(
        grad_reduce_in_fp32=ddp_config.grad_reduce_in_fp32,
        overlap_grad_reduce=ddp_config.overlap_grad_reduce,
        overlap_param_gather=ddp_config.overlap_param_gather and ddp_config.overlap_grad_reduce,
        use_distributed_optimizer=True,
        use_megatron_fsdp=True,
        data_parallel_sharding_strategy=ddp_config.data_parallel_sharding_strategy,
        outer_dp_sharding_strategy=ddp_config.outer_dp_sharding_strategy,
        num_distributed_optimizer_instances=ddp_config.num_distributed_optimizer_instances,
        check_for_nan_in_grad=ddp_config.check_for_nan_in_grad,
        bucket_size=ddp_config.bucket_size,
        average_in_collective=ddp_config.average_in_collective,
        fsdp_double_buffer=ddp_config.fsdp_double_buffer,
        fsdp_db_use_persist_buf_on_alloc_fail=ddp_config.fsdp_db_use_persist_buf_on_alloc_fail,
        preproc_state_dict_for_dcp_ckpt=ddp_config.preproc_state_dict_for_dcp_ckpt,
        param_offload=ddp_config.megatron_fsdp_param_offload,
    )


def _nccl_user_buffers(ddp_config: DistributedDataParallelConfig):
    """`--use-nccl-ub` and its options for Megatron-FSDP (megatron_fsdp.nccl_allocator), or None without it."""
    if not ddp_config.nccl_ub:
        return None
    from megatron_fsdp.nccl_allocator import NcclUserBuffers

    return NcclUserBuffers(manual_registration=ddp_config.fsdp_manual_registration,
                           symmetric=not ddp_config.disable_symmetric_registration)


def _fp8_gather_codec(config, ddp_config: DistributedDataParallelConfig, module):
    """The gather codec policy of `--fp8-param-gather`, or None without it (its rules are the config's)."""
    if not ddp_config.fp8_param_gather:
        return None
    from megatron.core.fp8.fsdp_gather import fp8_gather_codec_policy

    return fp8_gather_codec_policy(module, config)


class _Mesh(NamedTuple):
    device_mesh: object
    dp_shard_dim: Optional[str]
    dp_outer_dim: Optional[str]
    tp_dim: Optional[str]
    hybrid_fsdp_group: object
    data_parallel_group: object  # every data-parallel (x context-parallel) rank of this stage
    expert_device_mesh: object = None  # the expert data-parallel (x tp) mesh under expert parallelism
    expert_hybrid_fsdp_group: object = None  # HSDP / HFSDP: every expert data-parallel rank (outer x shard)


def _mesh_from_parallel_state(ddp_config: DistributedDataParallelConfig, module) -> _Mesh:
    """parallel_state's (dp_outer, dp_shard_cp, tp) mesh of this pipeline stage; the world without one."""
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        if ddp_config.num_distributed_optimizer_instances > 1:
            raise ValueError(
                "MegatronFSDPAdapter: num_distributed_optimizer_instances > 1 (--num-distributed-optimizer-"
                "instances) needs parallel_state.initialize_model_parallel(num_distributed_optimizer_instances=N)"
            )
        return _Mesh(None, None, None, None, None, dist.group.WORLD)
    instances = parallel_state.get_num_distributed_optimizer_instances()
    if instances != ddp_config.num_distributed_optimizer_instances:
        raise ValueError(
            f"MegatronFSDPAdapter: ddp_config.num_distributed_optimizer_instances="
            f"{ddp_config.num_distributed_optimizer_instances} but parallel_state was initialised with {instances}; "
            "pass the same --num-distributed-optimizer-instances to both"
        )
    hybrid = instances > 1
    tensor_parallel = parallel_state.get_tensor_model_parallel_world_size() > 1
    data_parallel_group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    expert_device_mesh = expert_hybrid_fsdp_group = None
    if _shards_experts_apart(module):
        expert_device_mesh = _expert_device_mesh(parallel_state.get_expert_tensor_parallel_world_size() > 1, hybrid)
        if hybrid:
            expert_hybrid_fsdp_group = parallel_state.get_expert_data_parallel_group()
    return _Mesh(
        device_mesh=parallel_state.get_device_mesh(),
        dp_shard_dim="dp_shard_cp",
        dp_outer_dim="dp_outer" if hybrid else None,
        tp_dim="tp" if tensor_parallel else None,
        hybrid_fsdp_group=data_parallel_group if hybrid else None,
        data_parallel_group=data_parallel_group,
        expert_device_mesh=expert_device_mesh,
        expert_hybrid_fsdp_group=expert_hybrid_fsdp_group,
    )


def _shards_experts_apart(module) -> bool:
    """Whether `module`'s expert parameters need groups of their own: under expert parallelism, or an expert
    tensor-parallel size other than the tensor-parallel size, the ranks holding the same experts (expert data
    parallel) are not the DP x CP ranks. At EP1 with ETP = TP every rank holds every expert, split like the dense
    parameters, and they are sharded like them."""
    from megatron.core import parallel_state
    from megatron.core.expert_parameters import is_expert_parameter

    if (parallel_state.get_expert_model_parallel_world_size() == 1
            and parallel_state.get_expert_tensor_parallel_world_size()
            == parallel_state.get_tensor_model_parallel_world_size()):
        return False
    return any(is_expert_parameter(param) for param in module.parameters())


def _expert_device_mesh(tensor_parallel: bool, hybrid: bool):
    """This rank's expert data-parallel mesh, dims named like parallel_state's dense mesh: under HSDP / HFSDP
    `dp_outer` (the instances), `dp_shard_cp` (the expert data-parallel group, of one instance under HSDP /
    HFSDP) and, under expert tensor parallelism, `tp` (the expert tensor-parallel group). Built on the existing
    groups: no new process groups."""
    from torch.distributed.device_mesh import DeviceMesh

    from megatron.core import parallel_state
    from megatron.core.device_utils import get_device_for_group

    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    # torch caches DTensor sharding decisions (which carry their mesh) keyed by meshes that compare equal whenever
    # their ranks do: a process that rebuilt its groups (parallel_state torn down and initialised again) would
    # otherwise run the expert DTensors' collectives on a mesh of destroyed groups.
    _clear_sharding_prop_cache()
    expert_dp_ranks = dist.get_process_group_ranks(parallel_state.get_expert_data_parallel_group())
    shard_group = parallel_state.get_expert_data_parallel_group(partial_expert_data_parallel=hybrid)
    device_type = get_device_for_group(shard_group).type
    # The expert data-parallel ranks as (instance, position within it): the instances are consecutive chunks.
    per_instance = dist.get_world_size(shard_group)
    peers = [expert_dp_ranks[start:start + per_instance] for start in range(0, len(expert_dp_ranks), per_instance)]
    groups, names = [shard_group], ["dp_shard_cp"]
    if hybrid:
        groups, names = [parallel_state.get_outer_expert_data_parallel_group()] + groups, ["dp_outer"] + names
    else:
        peers = peers[0]
    if tensor_parallel:
        tp_group = parallel_state.get_expert_tensor_parallel_group()
        tp_ranks = dist.get_process_group_ranks(tp_group)
        # The ranks form a regular grid (rank = base + i * expert-dp stride + j * etp stride): entry (..., i, j)
        # is the i-th expert data-parallel peer moved to the j-th expert tensor-parallel position.
        me = dist.get_rank()
        peers = torch.tensor(peers, dtype=torch.int)
        peers = peers.unsqueeze(-1) + torch.tensor(tp_ranks, dtype=torch.int) - me
        groups, names = groups + [tp_group], names + ["tp"]
    return DeviceMesh.from_group(groups if len(groups) > 1 else groups[0], device_type,
                                 mesh=torch.as_tensor(peers, dtype=torch.int), mesh_dim_names=tuple(names))


class MegatronFSDPAdapter(DataParallelWrapper):
    """Wraps `module` (one pipeline stage's Megatron-Core model) with Megatron-FSDP; see the module docstring.

    Args:
        config: the model's TransformerConfig (read: params_dtype, calculate_per_token_loss,
            init_model_with_meta_device).
        ddp_config: `DistributedDataParallelConfig` with `use_megatron_fsdp=True`; its
            `data_parallel_sharding_strategy` is the ZeRO level.
        module: the model chunk, on this process's device or (with `init_model_with_meta_device`) on meta.
        fsdp_unit_modules: classes (or dotted names) whose instances become units; default
            `default_fsdp_unit_modules()` (the transformer layers).
    """

    def __init__(self, config, ddp_config: DistributedDataParallelConfig, module, fsdp_unit_modules=None):
        super().__init__(config, ddp_config)
        import megatron_fsdp

        if not ddp_config.use_megatron_fsdp:
            raise ValueError(
                "MegatronFSDPAdapter needs DistributedDataParallelConfig(use_megatron_fsdp=True) "
                "(--use-megatron-fsdp); build the wrapper with megatron.core.distributed.wrap_data_parallel, "
                "which picks the one the config selects"
            )
        mesh = _mesh_from_parallel_state(ddp_config, module)
        self.data_parallel_group = mesh.data_parallel_group
        meta = any(param.is_meta for param in module.parameters())
        if meta and not getattr(config, "init_model_with_meta_device", False):
            raise ValueError(
                "MegatronFSDPAdapter: the model has meta-device parameters but config."
                "init_model_with_meta_device is False; build it with --init-model-with-meta-device"
            )
        self.module = megatron_fsdp.MegatronFSDP(
            module,
            _package_ddp_config(ddp_config),
            device_mesh=mesh.device_mesh,
            dp_shard_dim=mesh.dp_shard_dim,
            dp_outer_dim=mesh.dp_outer_dim,
            tp_dim=mesh.tp_dim,
            hybrid_fsdp_group=mesh.hybrid_fsdp_group,
            fsdp_unit_modules=fsdp_unit_modules if fsdp_unit_modules is not None else default_fsdp_unit_modules(),
            mixed_precision_policy=_mixed_precision_policy(config, ddp_config),
            init_model_with_meta_device=meta,
            calculate_per_token_loss=getattr(config, "calculate_per_token_loss", False),
            report_nan_in_param_grad=ddp_config.check_for_nan_in_grad,
            gather_codec=_fp8_gather_codec(config, ddp_config, module),
            expt_device_mesh=mesh.expert_device_mesh,
            expt_hybrid_fsdp_group=mesh.expert_hybrid_fsdp_group,
            is_expert_param=_is_expert_parameter,
            nccl_user_buffers=_nccl_user_buffers(ddp_config),
        )

    # ---- what the training loop and the schedules use ---------------------------------------------------------
    @property
    def fsdp(self):
        """The `megatron_fsdp.MegatronFSDP` wrapper (same object as `self.module`)."""
        return self.module

    @property
    def unwrapped_module(self) -> torch.nn.Module:
        """The Megatron-Core model inside the `megatron_fsdp.MegatronFSDP` wrapper."""
        return self.module.module

    @property
    def device(self) -> torch.device:
        return self.module.device

    @contextmanager
    def no_sync(self):
        """Accumulate this rank's gradients without communicating them (ZeRO-0/1); ZeRO-2/3 reduce-scatter every
        microbatch into their gradient shards, which is what keeps them from holding full gradients."""
        with self.module.no_sync():
            yield

    def start_grad_sync(self, *unused):
        self.module.start_grad_sync()

    def finish_grad_sync(self):
        """Complete every reduction of the step; afterwards `optimizer_grad_pieces()` holds reduced gradients."""
        self.module.finish_grad_sync()

    def zero_grad_buffer(self):
        self.module.zero_grad_buffer()

    def scale_gradients(self, scaling_factor: float):
        self.module.scale_gradients(scaling_factor)

    def start_param_sync(self, *unused, force_sync: bool = False):
        self.module.start_param_sync(force_sync=force_sync)

    def finish_param_sync(self):
        """ZeRO-1/2: wait for the post-step all-gather of the updated weights. ZeRO-3 keeps weights sharded between
        steps and each unit waits for its own gather in its forward pre-hook, so there is nothing to wait for."""
        self.module.finish_param_sync()

    def broadcast_params(self):
        """Make every data-parallel replica hold data-parallel rank 0's weights."""
        self.module.broadcast_params()

    def state_dict(self, *args, **kwargs):
        """Parameter name -> DTensor over the data-parallel (and TP) mesh; loadable at another DP size."""
        return self.module.state_dict(*args, **kwargs)

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        """This rank's shards of the chunk's tensors, keyed by logical name (as `GPTModel.sharded_state_dict`):
        what `dist_checkpointing.save` writes and `dist_checkpointing.load` fills, at any data-parallel size."""
        from megatron.core.dist_checkpointing.logical_tensor import ShardedLogicalTensor

        if sharded_offsets:
            raise NotImplementedError("sharded_offsets: Megatron-FSDP chunks name layers by their global index "
                                      "instead; call sharded_state_dict() without offsets")
        names = self._logical_names()
        return {f"{prefix}{names(key)}": ShardedLogicalTensor.from_local(value)
                for key, value in self.module.state_dict().items() if torch.is_tensor(value)}

    def _logical_names(self):
        """state-dict key -> its name in the logical model (`dist_checkpointing.fsdp_state.logical_names`)."""
        from megatron.core.dist_checkpointing.fsdp_state import logical_names

        return logical_names(self)

    def load_state_dict(self, state_dict, strict: bool = True):
        """Load `state_dict()`'s DTensors, or what `dist_checkpointing.load(model.sharded_state_dict(), ...)`
        returns (logical names, this rank's shard of each tensor)."""
        from torch.distributed.tensor import DTensor

        from megatron.core.dist_checkpointing.logical_tensor import ShardedLogicalTensor

        template = {key: value for key, value in self.module.state_dict().items() if torch.is_tensor(value)}
        def whole(key, value):  # a DTensor, or a full tensor of the module's own key (not this rank's piece)
            return isinstance(value, DTensor) or not torch.is_tensor(value) or (
                key in template and tuple(value.shape) == tuple(template[key].shape))

        if set(state_dict) <= set(template) and all(whole(key, value) for key, value in state_dict.items()):
            return self.module.load_state_dict(state_dict, strict=strict)
        names = self._logical_names()
        key_of = {names(key): key for key in template}
        unexpected = sorted(set(state_dict) - set(key_of))
        missing = sorted(set(key_of) - set(state_dict))
        if strict and (unexpected or missing):
            raise RuntimeError(f"Megatron-FSDP chunk: state dict keys do not match the model's logical names "
                               f"(missing: {missing[:5]}, unexpected: {unexpected[:5]}); pass strict=False to "
                               "load a subset")
        loaded = {}
        for name, value in state_dict.items():
            if name not in key_of:
                continue
            key = key_of[name]
            target = ShardedLogicalTensor.from_local(template[key]).pieces  # views of this rank's shard
            given = value.pieces if isinstance(value, ShardedLogicalTensor) else [(None, value)] if target else []
            if len(given) != len(target) or any(a.shape != b.shape for (_, a), (_, b) in zip(target, given)):
                raise ValueError(f"{name}: the given shard {[tuple(t.shape) for _, t in given]} is not this rank's "
                                 f"{[tuple(t.shape) for _, t in target]}; load the dict that "
                                 "dist_checkpointing.load returned for this model")
            with torch.no_grad():
                for (_, destination), (_, source) in zip(target, given):
                    destination.copy_(source)
            loaded[key] = template[key]
        self.module.load_state_dict(loaded, strict=len(loaded) == len(template))
        return torch.nn.modules.module._IncompatibleKeys(missing, unexpected)

    @contextmanager
    def gathered_parameters(self):
        """Between steps, the wrapped model with every parameter holding its full weights; in-place writes made
        inside persist (the same on every rank; see MegatronFSDP.gathered_parameters)."""
        with self.module.gathered_parameters() as model:
            yield model

    # ---- gradients, for finalize_model_grads and the optimizer ------------------------------------------------------
    @property
    def strategy(self):
        return self.module.strategy

    def grad_shard_groups(self) -> List[object]:
        """Process groups over which the optimizer's gradient pieces of one parameter are spread (disjoint
        pieces): the shard group under ZeRO-1..3, and the outer group too under HFSDP. HSDP's outer ranks hold
        identical copies, ZeRO-0's data-parallel ranks full ones."""
        return self._optimizer_shard_groups(self.module.topology)

    def _optimizer_shard_groups(self, topology) -> List[object]:
        """The groups `topology` spreads optimizer pieces over: its data-parallel group unless nothing is sharded,
        and its outer group where the outer ranks shard the optimizer too (HFSDP)."""
        import megatron_fsdp

        groups = []
        if self.module.strategy != megatron_fsdp.ShardingStrategy.no_shard and topology.dp_size > 1:
            groups.append(topology.dp_group)
        if topology.outer_shards_optimizer and topology.outer_size > 1:
            groups.append(topology.outer_group)
        return groups

    def expert_grad_shard_groups(self) -> List[object]:
        """Process groups over which the optimizer's gradient pieces of one expert parameter are spread: the
        expert data-parallel group (of one instance under HSDP / HFSDP) under expert parallelism (ZeRO-1..3), and
        under HFSDP the expert ranks across the instances too; else those of `grad_shard_groups()`."""
        topology = self.module.expert_topology
        if topology is None:
            return self.grad_shard_groups()
        return self._optimizer_shard_groups(topology)

    def optimizer_grad_pieces(self, predicate: Optional[Callable[[torch.nn.Parameter], bool]] = None
                              ) -> List[GradPiece]:
        """This rank's pieces of the gradients the optimizer steps with, after `finish_grad_sync()`, for the
        trainable parameters `predicate(param)` accepts (the real parameters, with their Megatron attributes).
        ZeRO-0 pieces are whole parameters in their own shape; ZeRO-1..3 pieces are flat and may be empty."""
        import megatron_fsdp

        whole = self.module.strategy == megatron_fsdp.ShardingStrategy.no_shard
        pieces = []
        for group in self.module.groups:
            grads = group.optimizer_grad_views()
            if not grads:
                continue
            for index, param in enumerate(group.params):
                if predicate is not None and not predicate(param):
                    continue
                if whole:
                    pieces.append(GradPiece(param, grads[index], 0, param.numel()))
                else:
                    piece = group.main_pieces[index]
                    pieces.append(GradPiece(param, grads[index], piece.param_start, piece.param_end))
        return pieces

    def main_param_of(self, param) -> Optional[torch.Tensor]:
        """The main-weight view the optimizer steps on for `param` (a module parameter or its at-rest
        placeholder); None for frozen parameters."""
        group, index = self.module.param_to_group[id(param)]
        return group.main_param_views[index]

    def main_piece_of(self, param):
        """`(shape, start, end, groups, replica_groups)`: the main-weight view of `param` holds elements
        `[start, end)` of the flattened parameter of `shape`, the views over `groups` are disjoint and make up the
        parameter, and the ranks of `replica_groups` (HSDP's outer group) hold the same view; None when the view is
        the whole parameter (ZeRO-0) or `param` is frozen."""
        import megatron_fsdp

        group, index = self.module.param_to_group[id(param)]
        if self.module.strategy == megatron_fsdp.ShardingStrategy.no_shard or group.main_param_views[index] is None:
            return None
        piece = group.main_pieces[index]
        topology = group.topology
        replica_groups = [] if topology.outer_shards_optimizer or topology.outer_size == 1 else [topology.outer_group]
        return (group.layout.shapes[index], piece.param_start, piece.param_end, self._optimizer_shard_groups(topology),
                replica_groups)

    def owns(self, param) -> bool:
        """Whether `param` (a module parameter or its at-rest placeholder) is one this chunk shards."""
        return id(param) in self.module.param_to_group

    def real_parameter(self, param) -> torch.nn.Parameter:
        """The parameter object Megatron-FSDP manages for `param` (itself, or the one an at-rest ZeRO-3
        placeholder stands in for)."""
        group, index = self.module.param_to_group[id(param)]
        return group.params[index]

    # ---- reports --------------------------------------------------------------------------------------------------
    def state_bytes(self) -> dict:
        """Persistent bytes this rank holds: compute weights (`params_bytes`), gradient buffers (`grads_bytes`)
        and the optimizer's side (`optimizer_state_bytes`: main weights not aliasing the compute weights plus the
        optimizer's state tensors). See `megatron.training.training_log.memory_usage`."""
        report = self.module.memory_report()
        # A ZeRO-3 shard whose main weights have the compute dtype is one tensor serving as both: count it as
        # parameters, so that `optimizer_state_bytes` only holds what exists for the optimizer's sake.
        shared_shards = sum(group.main_weights.numel() * group.main_weights.element_size()
                            for group in self.module.groups
                            if group.main_weights is not None and group.compute_shard is group.main_weights)
        return {
            "params_bytes": report["compute_weights"] + shared_shards,
            "grads_bytes": report["grads"],
            "optimizer_state_bytes": report["main_weights"] - shared_shards + report["optimizer_state"],
        }

    def expert_state_bytes(self) -> dict:
        """The part of `state_bytes()` that belongs to Mixture-of-Experts expert parameters, per parameter (the
        padding of the flat buffers is no parameter's): `expert_params_bytes` (this rank's compute weights of
        them, with their FP8 wire shard under `--fp8-param-gather`), `expert_grads_bytes` and
        `expert_optimizer_state_bytes` (main weights not aliasing the compute weights plus the optimizer's state
        tensors); {} when the chunk holds no expert parameters."""
        from megatron.core.expert_parameters import is_expert_parameter

        import megatron_fsdp

        fsdp = self.module
        optimizer_state = fsdp.optimizer.state if fsdp.optimizer is not None else {}
        sharded = fsdp.strategy == megatron_fsdp.ShardingStrategy.optim_grads_params
        grads_sharded = fsdp.strategy >= megatron_fsdp.ShardingStrategy.optim_grads
        totals = {"expert_params_bytes": 0, "expert_grads_bytes": 0, "expert_optimizer_state_bytes": 0}
        found = False
        for group in fsdp.groups:
            for index, param in enumerate(group.params):
                if not is_expert_parameter(param):
                    continue
                found = True
                shard_numel = group.pieces[index].numel
                params_numel = shard_numel if sharded else param.numel()
                totals["expert_params_bytes"] += params_numel * group.param_dtype.itemsize
                if group.wire_shard is not None:  # the encoded (FP8) form of the shard: compute weights too
                    totals["expert_params_bytes"] += shard_numel * group.wire_shard.element_size()
                main = group.main_param_views[index]
                if main is None:
                    continue
                grads_numel = shard_numel if grads_sharded else param.numel()
                totals["expert_grads_bytes"] += grads_numel * group.grad_dtype.itemsize
                main_is_compute = group.main_dtype == group.param_dtype and not group.outer_sharded
                if not main_is_compute:
                    totals["expert_optimizer_state_bytes"] += main.numel() * main.element_size()
                totals["expert_optimizer_state_bytes"] += sum(
                    value.numel() * value.element_size() for value in optimizer_state.get(main, {}).values()
                    if torch.is_tensor(value) and value.dim() > 0)
        return totals if found else {}

    def communication_report(self) -> dict:
        return self.module.communication_report()


# Upstream Megatron-Core's name for the Megatron-FSDP wrapper of a Megatron-Core model chunk.
FullyShardedDataParallel = MegatronFSDPAdapter
