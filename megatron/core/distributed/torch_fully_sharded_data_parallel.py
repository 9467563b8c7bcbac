"""`TorchFSDP2`: a Megatron-Core model chunk sharded with PyTorch FSDP2 (`fully_shard`).

Upstream's name for it, `TorchFullyShardedDataParallel`, stays importable from here and from
`megatron.core.distributed`.

Each `TransformerLayer` and the embedding become their own FSDP2 unit (see
`megatron.core.distributed.fsdp_units`) (one all-gather before their forward and
backward, one reduce-scatter after their backward); everything else (final norm, output layer) belongs to the
root unit. Parameters are sharded over the data-parallel (x context-parallel) dimension of parallel_state's
device mesh; tensor parallelism stays Megatron's own (each TP rank shards its local TP slice over its DP group),
and pipeline parallelism wraps each stage's chunk on its own. Mixture-of-Experts experts (a MoE layer's
`experts`, whose parameters are all expert parameters) are units of their own, sharded over the expert
data-parallel mesh (the ranks holding the same experts).

The wrapper implements the `DataParallelWrapper` contract: `no_sync()` (FSDP2's
`set_requires_gradient_sync(False)`: unsharded gradients accumulate locally until the
last microbatch), `start_grad_sync` / `finish_grad_sync` (FSDP2 reduce-scatters inside backward; on return
every `param.grad` is this rank's reduced shard, a DTensor), `start_param_sync` / `finish_param_sync` (nothing
to do: each unit gathers in its forward pre-hook), `zero_grad_buffer`, `scale_gradients`, `broadcast_params`,
`state_bytes`, `state_dict` / `load_state_dict`.

Refused, each with a message naming the flag (the config's own rules by `DistributedDataParallelConfig`, the ones
involving the model here):
- tied input/output embeddings: the tied weight would live in the embedding's unit but be read again by the
  output layer in the root unit after the embedding unit has resharded it; use --untie-embeddings-and-output-weights;
- fp16 (Megatron's rule for FSDP2; fp16 loss scaling is not wired to FSDP2's gradient shards here);

Mixed precision (`mixed_precision_policy`), as torchtitan and upstream: a bf16 model (`config.bf16` or bf16
parameters) is sharded in fp32 (the sharded parameters are the optimizer's main weights: no second copy),
FSDP2 gathers them as bf16 for compute, and reduce-scatters gradients in fp32 with
`ddp_config.grad_reduce_in_fp32` (`--accumulate-allreduce-grads-in-fp32`, on by default under `--bf16`) or in
bf16 without it (`--grad-reduce-in-bf16`). The fp32 shards start from the bf16 model's initial values.
- the distributed optimizer and Megatron-FSDP settings: FSDP2 already shards parameters, gradients and optimizer
  state. (Hybrid sharding, --num-distributed-optimizer-instances > 1, needs one of those two and so never
  reaches FSDP2; HSDP is offered by --use-megatron-fsdp.)
"""

import dataclasses
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.debug import _clear_sharding_prop_cache

from megatron.core.distributed.data_parallel_base import DataParallelWrapper, local_tensor
from megatron.core.distributed.distributed_data_parallel_config import DistributedDataParallelConfig
from megatron.core.distributed.fsdp_units import default_fsdp_unit_modules
from megatron.core.expert_parameters import expert_data_parallel_group, is_expert_parameter
from megatron.core.offloading.fsdp2 import fsdp2_offload_policy

# Attributes Megatron code reads from parameters (grad norm de-duplication, SP / tied-embedding all-reduces,
# weight-decay and checkpoint logic). FSDP2 replaces every parameter with a new DTensor parameter, so they
# are carried over by hand.
CARRIED_PARAM_ATTRIBUTES = (
    "tensor_model_parallel",
    "partition_dim",
    "partition_stride",
    "sequence_parallel",
    "shared_embedding",
    "shared",
    "allreduce",
    "is_embedding_or_output_parameter",
    "is_embedding_parameter",
    "expert_global_index",
    "num_local_experts",
)


def data_parallel_mesh(group=None):
    """The 1-D mesh over `group`; by default this rank's data-parallel (x context-parallel) group of
    parallel_state (the world's when parallel_state is not initialised).

    Built from the group itself: one dimension, named as in parallel_state's (dp_outer, dp_shard_cp, tp) mesh."""
    from torch.distributed.device_mesh import DeviceMesh

    from megatron.core import parallel_state
    from megatron.core.device_utils import get_device_for_group

    if group is None:
        group = (parallel_state.get_data_parallel_group(with_context_parallel=True)
                 if parallel_state.model_parallel_is_initialized() else dist.group.WORLD)
    ranks = dist.get_process_group_ranks(group)
    # torch caches DTensor sharding decisions (which carry their mesh) keyed by meshes that compare equal
    # whenever their ranks and names do, whatever their process groups. A process that rebuilt its groups
    # (parallel_state torn down and initialised again) would otherwise reuse a mesh of destroyed groups.
    _clear_sharding_prop_cache()
    return DeviceMesh.from_group(group, get_device_for_group(group).type, mesh=torch.tensor(ranks, dtype=torch.int),
                                 mesh_dim_names=("dp_shard_cp",))


def expert_data_parallel_mesh():
    """The 1-D mesh of the ranks holding the same experts (parallel_state's expert data-parallel group)."""
    from torch.distributed.device_mesh import DeviceMesh

    from megatron.core.device_utils import get_device_for_group

    group = expert_data_parallel_group()
    ranks = dist.get_process_group_ranks(group)
    return DeviceMesh.from_group(group, get_device_for_group(group).type, mesh=torch.tensor(ranks, dtype=torch.int),
                                 mesh_dim_names=("expt_dp",))


def expert_modules(module):
    """The outermost submodules of `module` whose parameters are all Mixture-of-Experts expert parameters (a MoE
    layer's `experts`): FSDP2 shards them over the expert data-parallel mesh."""
    found = []

    def visit(submodule):
        params = list(submodule.parameters())
        if submodule is not module and params and all(is_expert_parameter(param) for param in params):
            found.append(submodule)
            return
        for child in submodule.children():
            visit(child)

    visit(module)
    return found


def unit_modules_children_first(module, unit_classes):
    """The submodules of `module` (not `module` itself: it is the root unit anyway) that are instances of
    `unit_classes`, every one after all of its descendants (a post-order walk; siblings keep their order): FSDP2
    must shard an inner unit before the unit around it, since `fully_shard` on the outer one takes every
    parameter not yet in a unit."""
    found, seen = [], set()

    def visit(submodule):
        if id(submodule) in seen:
            return
        seen.add(id(submodule))
        for child in submodule.children():
            visit(child)
        if submodule is not module and isinstance(submodule, unit_classes):
            found.append(submodule)

    visit(module)
    return found


def declared_unit_classes(module):
    """Module classes that submodules of `module` ask to be FSDP2 units through an `_fsdp_modules` attribute (a
    list of classes, upstream's way for a model to add its own units to the default ones)."""
    declared = []
    for submodule in module.modules():
        for unit_class in getattr(submodule, "_fsdp_modules", ()):
            if not isinstance(unit_class, type):
                raise TypeError(
                    f"{type(submodule).__name__}._fsdp_modules must list module classes, got {unit_class!r}"
                )
            declared.append(unit_class)
    return declared


def mixed_precision_policy(config, ddp_config: DistributedDataParallelConfig, module):
    """FSDP2's `MixedPrecisionPolicy` for `module`: bf16 compute over fp32 shards for a bf16 model (reduction
    in fp32 with `grad_reduce_in_fp32`, else bf16); for an fp32 model, no casts. Forward inputs are not cast:
    the fp32 RoPE angles reach each layer in fp32, as under DDP."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    is_bf16 = getattr(config, "bf16", False) or any(param.dtype == torch.bfloat16 for param in module.parameters())
    if not is_bf16:
        return MixedPrecisionPolicy()
    reduce_dtype = torch.float32 if ddp_config.grad_reduce_in_fp32 else torch.bfloat16
    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype, cast_forward_inputs=False)


def _check_model_supported(config, module):
    """The rules that involve the model (the data-parallel config's own are checked by the config)."""
    if getattr(module, "share_embeddings_and_output_weights", False):
        raise ValueError(
            "TorchFSDP2 (--use-torch-fsdp2) needs untied embeddings: the output layer would read the word "
            "embedding after its FSDP2 unit resharded it; pass --untie-embeddings-and-output-weights"
        )
    if getattr(config, "fp16", False):
        raise ValueError("TorchFSDP2 (--use-torch-fsdp2) does not support --fp16; use --bf16")
    meta_params = [name for name, param in module.named_parameters() if param.is_meta]
    if meta_params:
        raise ValueError(
            f"TorchFSDP2 (--use-torch-fsdp2) needs a materialised model, but {meta_params[0]} is on the meta "
            "device; drop --init-model-with-meta-device or use --use-megatron-fsdp"
        )


def local_shard_like(target, full, name):
    """A DTensor like `target` whose local tensor holds this rank's piece of `full` (the unsharded value).

    Only this rank's piece is copied, and straight to the device of `target`'s local tensor. `distribute_tensor`
    would first move all of `full` to the mesh's device: the GPU under --torch-fsdp2-cpu-offload, whose shards
    rest in host memory. The piece is the one FSDP2 keeps: `torch.chunk` along each sharded dimension, shorter
    or empty on the last ranks when the size does not divide."""
    unsupported = [placement for placement in target.placements if type(placement) not in (Shard, Replicate)]
    if unsupported:
        raise ValueError(
            f"cannot take this rank's piece of the full {name}: it is placed as {unsupported[0]}, and only Shard "
            "and Replicate placements can be cut locally; pass a DTensor (e.g. load a DTensor state dict) instead"
        )
    local_shape, global_offset = compute_local_shape_and_global_offset(target.shape, target.device_mesh,
                                                                       target.placements)
    piece = full
    for dim, (size, start) in enumerate(zip(local_shape, global_offset)):
        piece = piece.narrow(dim, start, size)
    shard = torch.empty_like(target)
    with torch.no_grad():
        shard.to_local().copy_(piece)
    return shard


class TorchFSDP2(DataParallelWrapper):
    """Wraps `module` (one pipeline stage's model chunk) with FSDP2; see the module docstring.

    Args:
        config: the model's TransformerConfig (read: fp16, calculate_per_token_loss).
        ddp_config: the data-parallel config; kept with `use_torch_fsdp2=True`, so that the config checks its
            FSDP2 rules (e.g. no distributed optimizer) even when the caller left that flag unset.
        module: the model chunk, already on the mesh's device.
        sub_modules_to_wrap: module classes that become units (upstream's name; `fsdp_unit_modules` is the
            same); default `default_fsdp_unit_modules(embedding_unit=True)`. Classes listed in a submodule's
            `_fsdp_modules` attribute are added, as upstream does. Units may nest (e.g. `ColumnParallelLinear`
            inside `TransformerLayer`): inner ones are sharded first.
        process_group: the group to shard over (upstream's name); default parallel_state's data-parallel
            (x context-parallel) group. Give this or `device_mesh`, not both.
        reshard_after_forward: free gathered parameters after each unit's forward and regather them for
            backward (True, less memory) or keep them until backward (False,
            --torch-fsdp2-no-reshard-after-forward: one all-gather per unit per step fewer); default
            `ddp_config.torch_fsdp2_reshard_after_forward`.
        device_mesh: a 1-D mesh to shard over; default the mesh over `process_group`.
    """

    def __init__(self, config, ddp_config: DistributedDataParallelConfig, module, sub_modules_to_wrap=None,
                 process_group=None, *, fsdp_unit_modules=None, reshard_after_forward=None, device_mesh=None):
        if not ddp_config.use_torch_fsdp2:
            ddp_config = dataclasses.replace(ddp_config, use_torch_fsdp2=True)  # re-validates the config
        super().__init__(config, ddp_config)
        from torch.distributed.fsdp import fully_shard

        _check_model_supported(config, module)
        if sub_modules_to_wrap is not None and fsdp_unit_modules is not None:
            raise ValueError("TorchFSDP2: sub_modules_to_wrap and fsdp_unit_modules name the same setting; give one")
        if process_group is not None and device_mesh is not None:
            raise ValueError("TorchFSDP2: give process_group or device_mesh, not both")
        if process_group is not None and not isinstance(process_group, dist.ProcessGroup):
            raise TypeError(f"TorchFSDP2: process_group must be a torch.distributed ProcessGroup, got "
                            f"{type(process_group).__name__} (reshard_after_forward is a keyword argument)")
        if reshard_after_forward is None:
            reshard_after_forward = ddp_config.torch_fsdp2_reshard_after_forward
        self.reshard_after_forward = reshard_after_forward
        self.device_mesh = device_mesh if device_mesh is not None else data_parallel_mesh(process_group)
        if self.device_mesh.ndim != 1:
            raise ValueError(f"TorchFSDP2 shards over a 1-D mesh, got {self.device_mesh.ndim} dims")
        self.data_parallel_group = self.device_mesh.get_group()
        if sub_modules_to_wrap is None:
            sub_modules_to_wrap = fsdp_unit_modules
        if sub_modules_to_wrap is None:
            sub_modules_to_wrap = default_fsdp_unit_modules(embedding_unit=True)
        unit_classes = (*sub_modules_to_wrap, *declared_unit_classes(module))

        carried = {
            name: {key: getattr(param, key) for key in CARRIED_PARAM_ATTRIBUTES if hasattr(param, key)}
            for name, param in module.named_parameters()
        }
        self.mixed_precision_policy = mixed_precision_policy(config, ddp_config, module)
        if self.mixed_precision_policy.param_dtype is not None:
            # The shards are the main weights: fp32, with FSDP2 casting the gathered copies for compute.
            for param in module.parameters():
                if param.dtype == torch.bfloat16:
                    param.data = param.data.float()
        # Children before parents, as FSDP2 requires: a unit's parameters leave the enclosing unit's group.
        self.fsdp_units = unit_modules_children_first(module, unit_classes)
        # --torch-fsdp2-cpu-offload: shards and gradient shards rest in host memory (see megatron.core.offloading).
        self.offload_policy = fsdp2_offload_policy(ddp_config.torch_fsdp2_cpu_offload, self.device_mesh.device_type)
        # Experts first (they sit inside the layers): sharded over the ranks holding the same experts. Their
        # gradients are summed over that mesh and divided by DP x CP, like the dense ones: each expert's gradient
        # already sums the tokens every expert-parallel rank sent it.
        self.expert_units = expert_modules(module)
        # A unit class inside an expert unit would take expert parameters off the expert mesh: it stays in that unit.
        inside_experts = {id(submodule) for unit in self.expert_units for submodule in unit.modules()}
        self.fsdp_units = [unit for unit in self.fsdp_units if id(unit) not in inside_experts]
        if self.expert_units:
            self.expert_mesh = expert_data_parallel_mesh()
            data_parallel_size = self.device_mesh.size()
            for unit in self.expert_units:
                fully_shard(unit, mesh=self.expert_mesh, reshard_after_forward=reshard_after_forward,
                            mp_policy=self.mixed_precision_policy, offload_policy=self.offload_policy)
                unit.set_gradient_divide_factor(float(data_parallel_size))
                # SUM, then one division by the factor. On a one-rank mesh FSDP2 skips the collective and divides
                # by the factor itself, and would divide again after a forced SUM: not forced there.
                unit.set_force_sum_reduction_for_comms(self.expert_mesh.size() > 1)
        for unit in self.fsdp_units:
            fully_shard(unit, mesh=self.device_mesh, reshard_after_forward=reshard_after_forward,
                        mp_policy=self.mixed_precision_policy, offload_policy=self.offload_policy)
        # The root's parameters (final norm, output layer) are needed right after the last layer's backward
        # starts, so the root never reshards between forward and backward.
        fully_shard(module, mesh=self.device_mesh, reshard_after_forward=False, mp_policy=self.mixed_precision_policy,
                    offload_policy=self.offload_policy)
        self.module = module
        for name, param in module.named_parameters():
            for key, value in carried[name].items():
                setattr(param, key, value)
        if getattr(config, "calculate_per_token_loss", False):
            # Per-token losses are divided by the global token count in finalize_model_grads: sum, not average.
            # A plain SUM collective (a divide factor alone would ask for PREMUL_SUM, which gloo lacks).
            for unit in [*self.expert_units, *self.fsdp_units, module]:
                unit.set_gradient_divide_factor(1.0)
                unit.set_force_sum_reduction_for_comms(True)
        self._requires_gradient_sync = True

    # ---- what the training loop uses -------------------------------------------------------------------------
    @contextmanager
    def no_sync(self):
        """Accumulate unsharded gradients locally; the first backward outside the context reduce-scatters them."""
        self.module.set_requires_gradient_sync(False)
        self._requires_gradient_sync = False
        try:
            yield
        finally:
            self.module.set_requires_gradient_sync(True)
            self._requires_gradient_sync = True

    def start_grad_sync(self, *unused):
        """Nothing to start: FSDP2 reduce-scatters each unit's gradients inside backward, as soon as they exist."""

    def finish_grad_sync(self):
        """Nothing left to wait for: FSDP2's end-of-backward callback has completed every reduce-scatter, so
        each `param.grad` already holds this rank's reduced shard. Called outside `no_sync()` only."""
        if not self._requires_gradient_sync:
            raise RuntimeError(
                "TorchFSDP2.finish_grad_sync() inside no_sync(): gradients were only "
                "accumulated locally; run the last microbatch's backward outside no_sync()"
            )

    def zero_grad_buffer(self):
        """Drop every gradient (sharded and accumulated-unsharded) before the next step."""
        for param in self.module.parameters():
            param.grad = None

    @torch.no_grad()
    def scale_gradients(self, scaling_factor):
        for param in self.module.parameters():
            if param.grad is not None:
                local_tensor(param.grad).mul_(scaling_factor)

    def start_param_sync(self, *unused, force_sync=False):
        """Nothing to start: each FSDP2 unit all-gathers its parameters in its own forward pre-hook."""

    def finish_param_sync(self):
        """Nothing to wait for: FSDP2 waits for each unit's all-gather before that unit runs."""

    def broadcast_params(self):
        """Every parameter is stored once, sharded over the data-parallel group, so data-parallel ranks cannot
        hold different values and there is nothing to broadcast (unlike DDP's replicas)."""

    # ---- state ------------------------------------------------------------------------------------------------
    def load_state_dict(self, state_dict, strict=True):
        """Loads DTensors as they are and full (unsharded) tensors by taking this rank's shard of them (copied
        straight to where the shard lives: host memory under --torch-fsdp2-cpu-offload)."""
        own = self.module.state_dict()
        converted = {}
        for key, value in state_dict.items():
            target = own.get(key)
            if isinstance(target, DTensor) and torch.is_tensor(value) and not isinstance(value, DTensor):
                if tuple(value.shape) != tuple(target.shape):
                    raise ValueError(
                        f"TorchFSDP2.load_state_dict: {key} has shape {tuple(value.shape)}, "
                        f"the model expects {tuple(target.shape)}"
                    )
                value = local_shard_like(target, value, key)
            converted[key] = value
        return self.module.load_state_dict(converted, strict=strict)

    def state_bytes(self):
        """Bytes this rank holds in parameters and gradients, by kind: the storages behind their local shards,
        each once. FSDP2 pads every parameter's shards to the same row count, so a rank whose rows fall short
        (the last ones when the rows do not divide by the data-parallel size) holds more than its shard's
        elements; the padding is counted with the shard it belongs to."""
        params = list(self.module.parameters())
        return {
            "params_bytes": _storage_bytes(params),
            "grads_bytes": _storage_bytes(p.grad for p in params if p.grad is not None),
        }


def _storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors`' local parts (meta tensors hold none)."""
    sizes = {}
    for tensor in tensors:
        local = local_tensor(tensor)
        if not local.is_meta:
            storage = local.untyped_storage()
            sizes[(local.device, storage.data_ptr())] = storage.nbytes()
    return sum(sizes.values())


# Upstream Megatron-Core's name for the FSDP2 wrapper.
TorchFullyShardedDataParallel = TorchFSDP2
