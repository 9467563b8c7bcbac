"""`MegatronFSDP`: the module wrapper that shards a model's parameters, gradients and optimizer state."""

import collections
import contextlib
import warnings
from typing import Callable, Optional

import torch
import torch.nn as nn

from . import collectives
from .distributed_data_parallel_config import DistributedDataParallelConfig, ShardingStrategy
from .distributed_index import FSDPDistributedIndex, apply_upstream_keywords
from .expert_topology import expert_topology
from .gather_codec import GatherCodecPolicy
from .gathered_writes import adopt_full_weight_writes, snapshot_on_entry, write_back_gathered_rows
from .offload import ShardOffload
from .fsdp2_methods import Fsdp2MethodNames
from .grad_clearing import GradClearing
from .grouping import plan_groups
from .layout import GroupLayout
from .meta_init import materialize_meta_model
from .nccl_allocator import NcclUserBuffers, buffer_allocator_for
from .mixed_precision import MixedPrecisionPolicy
from .param_and_grad_buffer import DoubleBufferPool, ParamGroup
from .param_grads import ParamGrads
from .resting_parameters import RestingParameters
from .scalar_slots import mirror_from_rank0, mirror_known
from .schedule import Schedule, Unit
from .tensor_parallel_dtensors import install_dtensor_forward_hooks, localize_tensor_parallel_dtensors
from .state_dict import gather_rows_written_through_state_dict, load_model_state_dict, model_state_dict
from .topology import DataParallelTopology
from .trainability import refuse_trainability_changes, trainability_at_wrap
from .utils import (WRAPPED_ATTR, called_from_torch_state_dict_helpers, parameter_owners, replace_parameter,
                    resolve_module_classes, run_eagerly, tensor_bytes, unit_call_module)


class MegatronFSDP(Fsdp2MethodNames, nn.Module):
    """Wraps `module`; sharding follows `ddp_config.data_parallel_sharding_strategy` (ZeRO-0..3).

    Use through `fully_shard_model` / `fully_shard`. The wrapped model is `self.module`; its parameters become
    views into flat per-group buffers (see `param_and_grad_buffer.py`) and the hooks in `schedule.py` move
    them between their sharded and gathered forms.

    Mixture-of-Experts expert parameters under expert parallelism: with `expt_device_mesh` (the mesh of the
    ranks holding the same experts, the expert data-parallel ranks, with a tp dim named like `device_mesh`'s when
    the experts are split over tensor-parallel ranks, which need not be the dense ones) the parameters
    `is_expert_param` accepts go to groups of their own, sharded, gathered and reduced over that mesh
    (`self.expert_topology`) while the others use `device_mesh` (`self.topology`).
    `is_expert_param` defaults to Megatron's marking of expert parameters (`param.allreduce is False`).
    Without `expt_device_mesh` expert parameters are sharded like the others, which is right only when every
    rank holds every expert. Under HSDP / HFSDP (`dp_outer_dim`) the expert mesh needs a dim of the same name
    (the same replicas, across which expert gradients are reduced and, under HFSDP, expert main weights split)
    and `expt_hybrid_fsdp_group`, the group spanning its outer x shard ranks (all the expert data-parallel ranks).
    """

    def __init__(self, module: nn.Module, ddp_config: Optional[DistributedDataParallelConfig] = None, *,
                 device_mesh=None, dp_shard_dim=None, dp_outer_dim=None, tp_dim=None, hybrid_fsdp_group=None,
                 fsdp_unit_modules=None, mixed_precision_policy: Optional[MixedPrecisionPolicy] = None,
                 device: Optional[torch.device] = None, init_model_with_meta_device: bool = False,
                 sync_model_each_microbatch: bool = True, disable_bucketing: bool = False,
                 calculate_per_token_loss: bool = False, report_nan_in_param_grad: bool = False,
                 gather_codec: Optional[GatherCodecPolicy] = None, expt_device_mesh=None,
                 is_expert_param: Optional[Callable[[nn.Parameter], bool]] = None,
                 nccl_user_buffers: Optional[NcclUserBuffers] = None, expt_hybrid_fsdp_group=None,
                 dist_index: Optional[FSDPDistributedIndex] = None, nccl_ub: bool = False,
                 disable_symmetric_registration: bool = False, fsdp_double_buffer: Optional[bool] = None,
                 keep_fp8_transpose_cache: bool = False, enable_fine_grained_param_gather_hook: bool = False):
        """`gather_codec`: parameters whose weights travel through the all-gather encoded (see gather_codec.py;
        strategy 3 only). `nccl_user_buffers`: allocate the buffers from a memory pool registered with NCCL
        (nccl_allocator.py; plain allocations on CPU / gloo). `dist_index` (upstream's `FSDPDistributedIndex`, in
        place of the mesh keywords) and the keywords after it: upstream's (see distributed_index.py)."""
        super().__init__()
        if dist_index is not None:
            outer_dp_shards = ddp_config is not None and ShardingStrategy.parse(
                ddp_config.outer_dp_sharding_strategy) != ShardingStrategy.no_shard
            device_mesh, dp_shard_dim, dp_outer_dim, tp_dim, hybrid_fsdp_group, expt_device_mesh = (
                dist_index.mesh_arguments(dict(
                    device_mesh=device_mesh, dp_shard_dim=dp_shard_dim, dp_outer_dim=dp_outer_dim, tp_dim=tp_dim,
                    hybrid_fsdp_group=hybrid_fsdp_group, expt_device_mesh=expt_device_mesh), outer_dp_shards))
        if isinstance(module, MegatronFSDP) or module.__dict__.get(WRAPPED_ATTR) is not None:
            raise ValueError("this module is already wrapped by MegatronFSDP; wrap each model once")
        if any(getattr(p, WRAPPED_ATTR, None) is not None for p in module.parameters()):
            raise ValueError("some parameters of this module already belong to a MegatronFSDP model; wrap once")
        config = ddp_config or DistributedDataParallelConfig(
            data_parallel_sharding_strategy=ShardingStrategy.optim_grads_params)
        self.ddp_config = config
        nccl_user_buffers = apply_upstream_keywords(
            module, config, nccl_user_buffers, nccl_ub=nccl_ub,
            disable_symmetric_registration=disable_symmetric_registration, fsdp_double_buffer=fsdp_double_buffer,
            keep_fp8_transpose_cache=keep_fp8_transpose_cache,
            enable_fine_grained_param_gather_hook=enable_fine_grained_param_gather_hook)
        self.strategy = ShardingStrategy.parse(config.data_parallel_sharding_strategy)
        if init_model_with_meta_device and self.strategy == ShardingStrategy.no_shard:
            raise ValueError("init_model_with_meta_device=True needs a sharded strategy; zero_dp_strategy="
                             "'no_shard' would materialise the whole model on every rank")
        if gather_codec is not None and self.strategy != ShardingStrategy.optim_grads_params:
            raise ValueError(f"gather_codec needs zero_dp_strategy='optim_grads_params' (3), got "
                             f"'{self.strategy.name}': the other strategies gather full compute weights after the "
                             "optimizer step from shards that alias the main weights")
        self.gather_codec = gather_codec
        self.topology = DataParallelTopology(
            device_mesh, dp_shard_dim, dp_outer_dim, tp_dim, hybrid_fsdp_group,
            data_parallel_sharding_strategy=self.strategy,
            outer_dp_sharding_strategy=config.outer_dp_sharding_strategy,
            num_distributed_optimizer_instances=config.num_distributed_optimizer_instances, device=device)
        self.expert_topology = expert_topology(self.topology, self.strategy, expt_device_mesh, dp_shard_dim,
                                               dp_outer_dim, expt_hybrid_fsdp_group, config)
        self.is_expert_param = None
        if self.expert_topology is not None:
            self.is_expert_param = is_expert_param or _marked_expert_parameter
        self.policy = (mixed_precision_policy or MixedPrecisionPolicy()).with_grad_reduce_in_fp32(
            config.grad_reduce_in_fp32)
        self.device = self.topology.device
        self.offload = self._shard_offload(config)
        expert_groups = [] if self.expert_topology is None else [self.expert_topology.dp_group,
                                                                 self.expert_topology.outer_group]
        self.buffer_allocator = buffer_allocator_for(
            nccl_user_buffers, [self.topology.dp_group, self.topology.outer_group] + expert_groups, self.device)
        self.module = module
        self.calculate_per_token_loss = calculate_per_token_loss
        self.counter = collectives.CommunicationCounter()
        self.optimizer = None  # the last optimizer passed to fully_shard_optimizer
        self.grad_clearing = GradClearing()  # every optimizer over the model: when its gradient buffers are cleared
        self.steps_recorded = 0

        # torch tensor parallelism (parallelize_module): DTensor parameters become Megatron-style TP partitions
        tensor_parallel_specs = localize_tensor_parallel_dtensors(module, self.topology, init_model_with_meta_device)
        meta = any(p.is_meta for p in module.parameters())
        if meta and not init_model_with_meta_device:
            raise ValueError("the module has meta-device parameters; pass init_model_with_meta_device=True")
        self._build_groups(resolve_module_classes(fsdp_unit_modules), config, disable_bucketing, meta)
        self.buffer_allocator.buffers_built()
        for buffer_owner in module.modules():
            for name, buffer in buffer_owner._buffers.items():
                if buffer is not None and not buffer.is_meta and buffer.device != self.device:
                    buffer_owner._buffers[name] = buffer.to(self.device)

        total_dp = self.topology.dp_size * self.topology.outer_size
        average = config.average_in_collective and not calculate_per_token_loss
        grad_scale = 1.0 if (average or calculate_per_token_loss) else 1.0 / total_dp
        # The gradient of an expert is summed over its expert data-parallel ranks, which together saw every
        # data-parallel rank's tokens: the sum is over the same tokens as a dense one, so it gets the same
        # 1 / total_dp. An average in the collective divides it by the expert data-parallel size only: the rest
        # of the factor is applied before (with an outer dim: by the expert data-parallel ranks of all replicas).
        expert_grad_scale = grad_scale
        if average and self.expert_topology is not None:
            expert_grad_scale = self.expert_topology.dp_size * self.expert_topology.outer_size / total_dp
        self.schedule = Schedule(
            units=self.units, root_groups=self.root_groups, strategy=self.strategy,
            dp_group=self.topology.dp_group, outer_group=self.topology.outer_group, counter=self.counter,
            grad_scale=grad_scale, expert_grad_scale=expert_grad_scale,
            expert_group=self.expert_topology.dp_group if self.expert_topology is not None else None,
            average_in_collective=average, overlap_grad_reduce=config.overlap_grad_reduce,
            overlap_param_gather=config.overlap_param_gather, sync_model_each_microbatch=sync_model_each_microbatch,
            report_nan_in_param_grad=report_nan_in_param_grad or config.check_for_nan_in_grad, pool=self.pool,
            tp_group=self.topology.tp_group, device=self.device)
        self.schedule.register_hooks()
        # torch.compile of the wrapper (or of a module around it) breaks its graphs at these (see run_eagerly)
        self._root_pre_forward = run_eagerly(self._checked_root_pre_forward)
        self._root_post_forward = run_eagerly(self.schedule.root_post_forward)
        self.schedule.before_backward = self._clear_grads_due_before_backward
        if self.strategy == ShardingStrategy.optim_grads_params:
            self._install_resting_placeholders()
        self.schedule.hook_handles.extend(install_dtensor_forward_hooks(tensor_parallel_specs))
        self._trainable_at_wrap = trainability_at_wrap(self.groups, getattr(self.schedule, "resting", None))
        outer_mesh_of = None
        if self.topology.optimizer_outer_size > 1:
            # HFSDP: each group's `.grad` lives on its topology's (outer, ..., shard) mesh; built here, on every rank
            outer_meshes = {id(group.topology): group.topology.checkpoint_mesh().mesh for group in self.groups}
            outer_mesh_of = lambda group: outer_meshes[id(group.topology)]  # noqa: E731
        self.schedule.param_grads = ParamGrads(self.groups, self.strategy, _shard_mesh_of,
                                               resting=self.schedule.resting, outer_mesh_of=outer_mesh_of)
        module.__dict__[WRAPPED_ATTR] = self  # a plain attribute: not registered as a submodule
        mirror_from_rank0(self)  # strategy 3: 0-dim parameters rest Replicate(); state_dict() needs no collective
        self.register_load_state_dict_post_hook(self._drop_inner_missing_keys)

    # ---- construction ---------------------------------------------------------------------------------------------
    def _topology_of(self, plan) -> DataParallelTopology:
        return self.expert_topology if plan.expert else self.topology

    def _shard_offload(self, config) -> Optional[ShardOffload]:
        """param_offload's host placement of the shard buffers (offload.py), or None without it."""
        if not getattr(config, "param_offload", False):
            return None
        if self.topology.outer_size > 1:
            raise ValueError("param_offload=True works over one data-parallel dimension: the outer reductions and "
                             "gathers of HSDP / HFSDP would run on host buffers; drop the outer dim or the offload")
        if self.gather_codec is not None:
            raise ValueError("param_offload=True does not encode gathers (gather_codec, e.g. FP8 parameter "
                             "gathers): drop one of the two")
        return ShardOffload.for_device(self.device)

    def _build_groups(self, unit_classes, config, disable_bucketing, meta):
        unit_modules, plans = plan_groups(self.module, unit_classes, config.bucket_size, disable_bucketing,
                                          root_buckets_unit_sized=self.strategy == ShardingStrategy.optim_grads_params,
                                          encodes=self.gather_codec.encodes if self.gather_codec else None,
                                          is_expert=self.is_expert_param)
        owners = parameter_owners(self.module)
        self.pool = self._double_buffer_pool(plans, len(unit_modules), config) if config.fsdp_double_buffer else None
        pool_offsets = [0] * len(unit_modules)
        groups_by_unit = {index: [] for index in range(len(unit_modules))}
        self.root_groups, self.groups = [], []
        for plan in plans:
            compute_buffer = None
            if self.pool is not None and plan.unit_index is not None:
                compute_buffer = self.pool.view(plan.unit_index % 2, pool_offsets[plan.unit_index],
                                                self._padded_numel(plan), plan.params[0].dtype)
                pool_offsets[plan.unit_index] += DoubleBufferPool.aligned(tensor_bytes(compute_buffer))
            topology = self._topology_of(plan)
            with self.buffer_allocator.buffers():
                group = ParamGroup(plan.params, plan.names, strategy=self.strategy, dp_rank=topology.dp_rank,
                                   dp_size=topology.dp_size, device=self.device, policy=self.policy,
                                   unit_index=plan.unit_index, compute_buffer=compute_buffer,
                                   outer_rank=topology.optimizer_outer_rank,
                                   outer_size=topology.optimizer_outer_size,
                                   gather_codec=self.gather_codec.make_codec() if plan.encoded else None,
                                   offload=self.offload, transient_allocation=self.buffer_allocator.transient)
            group.topology, group.expert = topology, plan.expert
            for index, param in enumerate(group.params):
                view = group.param_view(index)
                if param.is_meta:
                    # Point .data at the view rather than wrapping it: a wrapped view would share the flat
                    # buffer's version counter, and every later gather would then look like an in-place change
                    # to weights that autograd saved.
                    new_param = nn.Parameter(torch.empty(0, dtype=view.dtype, device=view.device),
                                             requires_grad=param.requires_grad)
                    new_param.data = view
                    new_param.__dict__.update(param.__dict__)
                    replace_parameter(owners[id(param)], new_param)
                    group.params[index] = new_param
                else:
                    with torch.no_grad():
                        view.copy_(param.detach())
                    param.data = view
            if not meta:
                group.commit_compute_to_shards()
                group.release_compute()
            for param in group.params:
                setattr(param, WRAPPED_ATTR, self)
            self.groups.append(group)
            (groups_by_unit[plan.unit_index] if plan.unit_index is not None else self.root_groups).append(group)
        self.units = [Unit(i, m, groups_by_unit[i], unit_call_module(self.module, m))
                      for i, m in enumerate(unit_modules)]
        self.param_to_group = {id(p): (g, i) for g in self.groups for i, p in enumerate(g.params)}
        if meta:
            for group in self.groups:
                group.release_compute()
            materialize_meta_model(self.module, unit_modules, groups_by_unit, self.root_groups, self.device,
                                   release=lambda groups: [g.release_compute() for g in groups])

    def _install_resting_placeholders(self):
        """Strategy 3: released groups show Shard(0) DTensors of this rank's rows in the module until gathered
        (see resting_parameters), on the mesh of the group's shard ranks."""
        resting = RestingParameters(self.groups, parameter_owners(self.module), _shard_mesh_of)
        for param_id, placeholder in resting.placeholders().items():
            # An optimizer built from module.parameters() after wrapping holds the resting ones: map them too.
            self.param_to_group[id(placeholder)] = self.param_to_group[param_id]
        self.schedule.resting = resting
        for group in self.groups:
            if not group.gathered:
                resting.hide(group)
        if self.root_groups:
            self.schedule.hook_handles.append(
                self.module.register_forward_pre_hook(run_eagerly(self._refuse_resting_root_call)))

    def _refuse_resting_root_call(self, module, args):
        """The root's own parameters are gathered by this wrapper's forward, not by a hook on the module: a
        direct `model.module(...)` would compute with the resting shards."""
        if not all(group.gathered for group in self.root_groups):
            raise RuntimeError(
                "the module inside MegatronFSDP (ZeRO-3, optim_grads_params) was called directly while its "
                "parameters rest as shards; call the wrapper instead (`model(...)`, which gathers them; "
                "`model.generate(...)` for the module's generate), or "
                "between steps run the full module inside `with model.gathered_parameters() as module: module(...)`")

    def _padded_numel(self, plan) -> int:
        """The flat size a group built from `plan` pads to (what ParamGroup's layout computes)."""
        topology = self._topology_of(plan)
        return GroupLayout([tuple(p.shape) for p in plan.params], topology.dp_size,
                           topology.optimizer_outer_size).padded_numel

    def _double_buffer_pool(self, plans, num_units, config):
        """The double-buffer pool, from the registered pool with NCCL user buffers. If allocating it runs out of
        memory and `fsdp_db_use_persist_buf_on_alloc_fail` is set, None: each group then gets its own buffer."""
        try:
            with self.buffer_allocator.buffers():
                return self._make_pool(plans, num_units)
        except torch.OutOfMemoryError:
            if not getattr(config, "fsdp_db_use_persist_buf_on_alloc_fail", False):
                raise
            warnings.warn("fsdp_double_buffer: the double-buffer pool does not fit in memory; each parameter "
                          "group gathers into a buffer of its own (fsdp_db_use_persist_buf_on_alloc_fail)")
            return None

    def _make_pool(self, plans, num_units):
        unit_bytes = [0] * num_units
        for plan in plans:
            if plan.unit_index is None:
                continue
            numel = self._padded_numel(plan)
            unit_bytes[plan.unit_index] += DoubleBufferPool.aligned(numel * plan.params[0].element_size())
        return DoubleBufferPool(max(unit_bytes, default=0), self.device) if num_units else None

    def __deepcopy__(self, memo):
        raise TypeError("copy.deepcopy() of a MegatronFSDP model is not supported: its parameters are views into "
                        "sharded buffers tied to process groups and hooks. Build a second model, wrap it with "
                        "fully_shard_model, and load this one's state into it: "
                        "new_model.load_state_dict(model.state_dict())")

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            inner = self.__dict__.get("_modules", {}).get("module")
            if inner is None or name.startswith("_") or not hasattr(inner, name):
                raise
        # Attributes of the wrapped module are not forwarded (as under torch's DDP): say where they are.
        raise AttributeError(
            f"'MegatronFSDP' object has no attribute '{name}'; the wrapped {type(inner).__name__} has it: use "
            f"`model.module.{name}`. Under zero_dp_strategy 3 (optim_grads_params) its parameters rest as Shard(0) "
            "DTensors between steps: run the module through `model(...)` / `model.generate(...)`, and save a "
            "Hugging Face model with `model.module.save_pretrained(path, state_dict=dict(full))`, `full` being "
            "`get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))`") from None

    # ---- forward ----------------------------------------------------------------------------------------------------
    def _checked_root_pre_forward(self):
        refuse_trainability_changes(self._trainable_at_wrap)  # trainability.py
        gather_rows_written_through_state_dict(self)  # strategies 0-2: `dcp.load(model.state_dict())` in place
        if self.schedule.resting is not None:
            self.schedule.resting.carry_gradient_hooks()
        self.schedule.root_pre_forward()

    def forward(self, *args, **kwargs):
        self._root_pre_forward()
        output = self.module(*args, **kwargs)
        self._root_post_forward(output)
        return output

    @torch.no_grad()
    def generate(self, *args, **kwargs):
        """The wrapped module's `generate` (a Hugging Face `GenerationMixin`), e.g. greedy decoding after training.

        The root groups (embedding, final norm, output layer) stay gathered for the whole call, since generation
        calls the module once per token; under strategy 3 each unit is gathered for its forward and released
        after it, as in an eval forward, so at most the root groups and two units are gathered at a time."""
        generate = getattr(self.module, "generate", None)
        if generate is None:
            raise AttributeError(f"the wrapped {type(self.module).__name__} has no generate(); call the model "
                                 "(`model(...)`) in a decoding loop of your own")
        if self.strategy != ShardingStrategy.optim_grads_params:
            self.schedule.wait_gathered(self.groups)  # strategies 1/2: the post-step all-gather may be in flight
            gather_rows_written_through_state_dict(self)
            return generate(*args, **kwargs)
        self.schedule.ensure_gathered(self.root_groups)
        try:
            return generate(*args, **kwargs)
        finally:
            self.schedule.release(self.root_groups)

    # ---- torch.nn.Module methods that would bypass the flat buffers ------------------------------------------------
    def apply(self, fn):
        """`nn.Module.apply` after wrapping (`model.apply(init_fn)`): `fn` sees the parameters as they are between
        steps (strategy 3: this rank's rows as Shard(0) DTensors, on which torch's init functions and in-place ops
        work; strategies 0-2: the full weights on every rank, so seed the ranks alike for a random init), and what
        it writes becomes the weights the optimizer steps from (the fp32 main weights of a bf16 model too)."""
        self.schedule.wait_gathered(self.groups)  # strategies 1/2: a post-step all-gather would overwrite fn's writes
        self.schedule.refresh_compute_shards(self.groups, async_op=False)  # HFSDP
        gather_rows_written_through_state_dict(self)
        super().apply(fn)
        for group in self.groups:
            if self.strategy == ShardingStrategy.optim_grads_params and not group.gathered:
                group.commit_compute_shard_to_main()
            else:
                group.commit_compute_to_shards()
        mirror_from_rank0(self)  # strategy 3: rank 0's 0-dim values, whatever `fn` drew on the others
        return self

    def _apply(self, fn, recurse=True):
        """`model.to(...)`, `.cuda()`, `.half()`, `.to_empty()` ... : a no-op on parameters is passed on (to the
        buffers); moving or casting a parameter would take it out of its flat buffer, so that is refused."""
        for name, param in self.module.named_parameters():
            if fn(param) is not param:
                raise ValueError(
                    f"this call would move or cast parameter '{name}' ({param.dtype}, {param.device}) out of "
                    "Megatron-FSDP's sharded buffers. Place and cast the module before wrapping it: build it on "
                    "the target device or pass fully_shard(..., device=...), build it in bf16 for bf16 compute "
                    "(MixedPrecisionPolicy(main_params_dtype=...) sets the main weights' dtype)")
        for owner in self.module.modules():
            for name, buffer in owner._buffers.items():
                if buffer is not None:
                    owner._buffers[name] = fn(buffer)
        return self

    # ---- gradient and weight synchronisation ------------------------------------------------------------------------
    @contextlib.contextmanager
    def no_sync(self):
        """Skip gradient communication (strategies 0-1) for the microbatches run inside this context."""
        previous = self.schedule.sync_enabled
        self.schedule.sync_enabled = False
        try:
            yield
        finally:
            self.schedule.sync_enabled = previous

    @contextlib.contextmanager
    def sync(self):
        """Force gradient communication for the microbatches run inside this context."""
        previous = self.schedule.sync_enabled
        self.schedule.sync_enabled = True
        try:
            yield
        finally:
            self.schedule.sync_enabled = previous

    def set_model_auto_sync(self, sync_model: bool = True):
        """Whether gradients are reduced in every microbatch's backward (True, `sync_model_each_microbatch`) or,
        under strategies 0/1, only by `finish_grad_sync` (which `optimizer.step()` calls). Switch it off for the
        microbatches of a step and on again for its last one, as upstream scripts do; strategies 2/3 reduce
        every microbatch regardless, since their gradients live only as shards. Either way `.grad` stays None
        until a backward with sync on (or `finish_grad_sync`) has completed the step's reductions (param_grads.py)."""
        self.schedule.sync_model_each_microbatch = bool(sync_model)

    @contextlib.contextmanager
    def gathered_parameters(self):
        """Between steps, make every parameter of `self.module` hold its full current weights, to read or write.

        Strategy 3 gathers each group (transiently, all at once) and releases them again on exit; other
        strategies hold full weights already. In-place writes made inside (`p.data.mul_(0.5)`, `p.copy_(...)`
        under `torch.no_grad()`, `layer.reset_parameters()`) persist, as with torch FSDP1's
        `summon_full_params(writeback=True)`: on exit each rank keeps its own rows of them (in its shard, and in
        the main weights the optimizer steps), so the next forward, the optimizer step and `state_dict()` see
        them. Every rank must enter the context (a collective) and make the same writes: each keeps only its
        rows, so writes that differ between ranks would leave a model made of different ones. A body that
        raises writes nothing back under strategy 3."""
        if self.strategy != ShardingStrategy.optim_grads_params:
            self.schedule.wait_gathered(self.groups)  # strategies 1/2: the post-step all-gather may be in flight
            gather_rows_written_through_state_dict(self)
            yield self.module
            adopt_full_weight_writes(self)  # so that the optimizer's state dict holds the writes before the step
            return
        if self.pool is not None:
            raise ValueError("gathered_parameters() gathers every unit at once, but fsdp_double_buffer=True bounds "
                             "the gathered units to two; read the weights with state_dict() instead")
        self.schedule.ensure_gathered(self.groups)
        self.schedule.held_gathered = frozenset(id(group) for group in self.groups)  # a forward inside keeps them
        try:
            snapshot = snapshot_on_entry(self.groups)
            yield self.module
            write_back_gathered_rows(self, self.groups, snapshot)
        finally:
            self.schedule.held_gathered = frozenset()
            self.schedule.release(self.groups)

    def start_grad_sync(self):
        self.schedule.start_grad_sync()

    def finish_grad_sync(self):
        self.adopt_written_weights()
        if self.schedule.finish_grad_sync():
            self.steps_recorded += 1
            self.schedule.param_grads.attach()

    def adopt_written_weights(self):
        """Make in-place writes to the parameters since the last optimizer step (`p.add_`, `p.data.copy_`,
        `p.lerp_`, ... between steps) the weights the next step updates: with main weights in another dtype
        (fp32 main weights of a bf16 model) the step would otherwise overwrite them. Called by
        `finish_grad_sync` (so by `optimizer.step()`); strategies 1/2 first wait for the post-step all-gather."""
        if self.strategy in (ShardingStrategy.optim, ShardingStrategy.optim_grads):
            self.schedule.wait_gathered(self.groups)
            # Groups whose rows changed while their post-step all-gather was in flight: one host synchronisation.
            raced = [(group, flag) for group in self.groups
                     for flag in (group.take_param_sync_write_flag(),) if flag is not None]
            if raced:
                for (group, _), value in zip(raced, torch.stack([flag for _, flag in raced]).tolist()):
                    if value:
                        raise group.param_sync_write_error()
        for group in self.groups:
            if group.compute_written():
                group.adopt_written_compute_weights()

    def start_param_sync(self, force_sync: bool = False):
        self.schedule.start_param_sync(async_op=not force_sync)

    def finish_param_sync(self):
        """Strategies 1/2: wait for the post-step all-gather of the updated weights (strategy 3 gathers each unit
        in its forward; strategy 0 has none)."""
        if self.strategy != ShardingStrategy.optim_grads_params:
            self.schedule.wait_gathered(self.groups)
            gather_rows_written_through_state_dict(self)

    def zero_grad_buffer(self):
        self.grad_clearing.reset()
        self.schedule.param_grads.drop()  # the gradient storage they view is zeroed or given back
        self.schedule.zero_grad_buffer()

    def zero_grad_buffer_for(self, optimizer):
        """`optimizer.zero_grad()`: clear the gradient buffers once every optimizer over this model has asked since
        they were last cleared (grad_clearing.py); with one optimizer, at once."""
        if self.grad_clearing.request(optimizer):
            self.zero_grad_buffer()

    def _clear_grads_due_before_backward(self):
        if self.grad_clearing.check_before_backward():
            self.zero_grad_buffer()

    def zero_grad(self, set_to_none: bool = True):
        """`nn.Module.zero_grad`: the step's gradients live in the flat gradient buffers (`.grad` only views
        them), so those are zeroed too; otherwise the next step would add to this one's gradients. `.grad` is
        None afterwards with `set_to_none=False` too: it shows gradients only once a step's are synchronised."""
        self.zero_grad_buffer()
        super().zero_grad(set_to_none=set_to_none)

    def scale_gradients(self, scaling_factor: float):
        """Multiply the step's gradients by `scaling_factor`, before or after `finish_grad_sync`."""
        # With overlap_grad_reduce the last reductions of backward may still be in flight; they accumulate
        # into the buffers when waited for, so they must land before the scaling.
        self.schedule.wait_reduces()
        self.schedule.wait_outer_reductions()
        for group in self.groups:
            group.scale_grads(scaling_factor)

    def install_optimized_model_weights(self):
        self.schedule.install_optimized_model_weights()
        if self.schedule.resting is not None:
            # HFSDP: the resting parameters view the compute shards, rebuilt from the outer ranks' main weights
            self.schedule.refresh_compute_shards(self.groups, async_op=False)
        mirror_from_rank0(self, [group for group in self.groups if group.trainable])

    def broadcast_params(self):
        """Make every data-parallel replica hold DP-rank 0's weights (no-op for the shards of strategy 3)."""
        if self.strategy == ShardingStrategy.optim_grads_params:
            if self.topology.outer_group is not None:  # each group over its own outer ranks (expert or dense)
                self.schedule.refresh_compute_shards(self.groups, async_op=False)
                for group in self.groups:
                    collectives.broadcast(group.compute_shard, group.topology.outer_group, self.counter)
                    group.commit_compute_shard_to_main()
            return
        self.schedule.wait_gathered(self.groups)  # a post-step all-gather in flight would overwrite the broadcast
        gather_rows_written_through_state_dict(self)
        for group in self.groups:
            for process_group in [group.topology.dp_group] + ([group.topology.outer_group]
                                                              if group.topology.outer_group else []):
                collectives.broadcast(group.compute_buffer, process_group, self.counter)
                group.commit_compute_to_shards()

    # ---- reports -----------------------------------------------------------------------------------------------------
    def memory_report(self) -> dict:
        """Bytes this rank holds, by kind; transient = gathered weights and in-flight gradient buffers now."""
        report = {"compute_weights": 0, "main_weights": 0, "grads": 0}
        for group in self.groups:
            for kind, value in group.persistent_bytes().items():
                report[kind] += value
        state_bytes = 0
        for optimizer in self.grad_clearing.optimizers():
            for state in optimizer.state.values():
                state_bytes += sum(tensor_bytes(v) for v in state.values() if isinstance(v, torch.Tensor))
        report["optimizer_state"] = state_bytes
        report["transient_now"] = sum(group.transient_bytes() for group in self.groups) + (
            self.pool.total_bytes() if self.pool is not None else 0)
        report["transient_peak"] = max(self.schedule.peak_transient_bytes, report["transient_now"])
        report["total_persistent"] = sum(report[k] for k in ("compute_weights", "main_weights", "grads",
                                                               "optimizer_state"))
        return report

    def communication_report(self) -> dict:
        """Bytes this rank sent since the last reset, by collective kind, plus the number of grad syncs."""
        report = self.counter.snapshot()
        report["steps"] = self.steps_recorded
        return report

    def reset_communication_counters(self):
        self.counter.reset()
        self.steps_recorded = 0

    # ---- checkpointing ----------------------------------------------------------------------------------------------
    def state_dict(self, *args, destination=None, prefix: str = "", keep_vars: bool = False):
        """Parameter name -> DTensor (full logical shape, Shard(0) rows over the data-parallel ranks); buffers
        as plain tensors. Loadable at another data-parallel size with torch.distributed.checkpoint. For an
        unwrapped module (which cannot load DTensors): `torch.distributed.checkpoint.state_dict.
        get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))` gives full plain tensors.
        `destination` and `prefix` work as in `nn.Module.state_dict` (a module holding this one as a child
        calls it so), and so does the deprecated positional form; `keep_vars` has no effect (DTensors of rows).
        Issues no collective (as FSDP2's), so it may be called on some ranks only; see `refresh_scalar_replicas`
        for the one exception."""
        if args:  # nn.Module.state_dict(destination, prefix, keep_vars)
            destination, prefix = args[0], args[1] if len(args) > 1 else prefix
        state = model_state_dict(self)
        if destination is None and not prefix:
            return state
        destination = collections.OrderedDict() if destination is None else destination
        for key, value in state.items():
            destination[prefix + key] = value
        return destination

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        result = load_model_state_dict(self, state_dict, strict=strict)
        mirror_known(self)  # strategy 3: the loaded 0-dim values into every rank's slot (scalar_slots.py)
        return result

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        """`load_state_dict` of a module holding this one as a child: this model's entries (keys as `state_dict`
        gives them, or with `module.` first) load through the sharded buffers here, and are taken out of the dict
        so that the wrapped module's own loading (which would write the parameters directly) finds none of them;
        the keys it then reports missing are dropped again by `_drop_inner_missing_keys`."""
        own = {}
        for key in [key for key in state_dict if key.startswith(prefix)]:
            name = key[len(prefix):]
            own[name[len("module."):] if name.startswith("module.") else name] = state_dict.pop(key)
        result = load_model_state_dict(self, own, strict=False)
        mirror_known(self)
        missing_keys.extend(prefix + key for key in result.missing_keys)
        unexpected_keys.extend(prefix + key for key in result.unexpected_keys)
        self._nested_load_prefix = prefix

    def _drop_inner_missing_keys(self, module, incompatible_keys):
        """Load-state-dict post-hook: the wrapped module's entries were loaded (and reported) by this model."""
        prefix, self._nested_load_prefix = getattr(self, "_nested_load_prefix", None), None
        if prefix is not None:
            inner = prefix + "module."
            incompatible_keys.missing_keys[:] = [key for key in incompatible_keys.missing_keys
                                                 if not key.startswith(inner)]

    def _fqn_modifiers(self) -> dict:
        """For torch.distributed.checkpoint.state_dict (`get_model_state_dict`, `set_model_state_dict`): the
        state-dict keys leave out the `module.` that `named_parameters()` puts first, so each first key part
        (a child, parameter or buffer of `self.module`) is looked up under `module`."""
        inner = self.module
        return {name: "module" for name in [*inner._modules, *inner._parameters, *inner._buffers]}

    def named_modules(self, memo=None, prefix: str = "", remove_duplicate: bool = True):
        """`nn.Module.named_modules` (the wrapped module under `module.`), except under torch.distributed.checkpoint.
        state_dict's helpers: they match the names of `named_parameters()` (which comes here, of this model or of a
        module holding it) against the state-dict keys, which leave out the `module.` (`get_model_state_dict(...,
        options=StateDictOptions(ignore_frozen_params=True))` drops the frozen parameters' keys by them), so the
        wrapped module's submodules get the names they have in the state dict."""
        if not called_from_torch_state_dict_helpers(1, through_module_methods=True):
            return super().named_modules(memo, prefix, remove_duplicate)
        return self._named_modules_by_state_dict_keys(memo, prefix, remove_duplicate)

    def _named_modules_by_state_dict_keys(self, memo, prefix: str, remove_duplicate: bool):
        memo = set() if memo is None else memo
        if remove_duplicate:
            if self in memo:
                return
            memo.add(self)
        for name, child in self._modules.items():
            if child is not None:
                child_prefix = prefix if name == "module" else (f"{prefix}.{name}" if prefix else name)
                yield from child.named_modules(memo, child_prefix, remove_duplicate)

    def named_group_params(self):
        for group in self.groups:
            for index, name in enumerate(group.names):
                yield name, group, index


def _marked_expert_parameter(param) -> bool:
    """Megatron's marking of a Mixture-of-Experts expert parameter: its gradient is not all-reduced over the
    whole data-parallel group (`allreduce = False`), only over the ranks holding the same experts."""
    return getattr(param, "allreduce", True) is False


def _shard_mesh_of(group):
    """The 1-D mesh of the ranks `group` is sharded over (its topology's shard group)."""
    return group.topology.shard_mesh()
