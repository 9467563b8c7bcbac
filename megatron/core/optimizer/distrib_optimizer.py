"""`DistributedOptimizer`: ZeRO-1 over the data-parallel group (expert parameters: over the expert data-parallel
group), on top of DDP's flat buffers.

DDP (with `use_distributed_optimizer=True`) lays out parameters and gradients in flat buffers whose buckets
are split evenly over the shard group (see param_and_grad_buffer.py). This optimizer keeps main parameters and
optimizer state only for the elements this rank owns. The main parameter of an fp32 model parameter is its
shard of the parameter buffer itself (a view: the step updates the buffer in place, no copy is kept); bf16/fp16
parameters (and FP8 weights, whose buffer values are overwritten by their gathered FP8 bytes) get a main copy
in `main_params_dtype`. A step reads the reduced gradient shard from the grad buffer, unscales/clips it (norms
are summed over the model-parallel and shard groups), steps, writes the updated copies into the parameter buffer
and all-gathers the buffer (asynchronously with `overlap_param_gather`, completed per module in the next
forward). With `--fp8-param-gather` the shards of FP8 weights are quantized into their buffer's FP8 bytes
instead, and those are gathered (see `megatron.core.fp8.params`); the model starts from its FP8 weights, gathered
once at construction.

With Muon (`--optimizer muon`) each main parameter of a hidden weight matrix is marked as a piece of that matrix
over the shard group (`mark_matrix_piece`), and a rank owning none of its elements steps an empty piece of it, so
that Newton-Schulz sees the whole matrix on every rank (see muon.py).

Checkpoints: `state_dict()` holds this rank's shards and can be loaded back on the same data-parallel layout.
`gathered_state_dict()` assembles full, unsharded tensors per parameter (a collective; every rank gets the
same result) and `load_gathered_state_dict()` takes the local shard out of it, so it moves across DP sizes.
"""

import torch
import torch.distributed as dist

from megatron.core.device_utils import get_current_device
from megatron.core.distributed.distributed_data_parallel import DistributedDataParallel
from megatron.core.offloading.placement import mark_relocatable
from megatron.core.optimizer.muon import mark_matrix_piece
from megatron.core.optimizer.optimizer import MegatronOptimizer, copy_parallel_attributes, fp32_grad
from megatron.core.optimizer.precision_aware_adam import MOMENT_KEYS


def steps_buffer_in_place(model_param, buffer, main_dtype) -> bool:
    """Whether the main parameter of `model_param`'s shard is a view of `buffer`'s parameter values (fp32 model
    and main dtype, no FP8 bytes gathered over the values) rather than a copy."""
    return (model_param.dtype == torch.float32 and main_dtype == torch.float32
            and buffer.param_data is not None and getattr(buffer, "fp8_storage", None) is None)


class _ParamShard:
    """The elements `[param_start, param_end)` of `model_param` owned by this rank, and the main parameter the
    optimizer steps for them: their place in the parameter buffer (`is_buffer_view`), or a copy in `main_dtype`."""

    def __init__(self, model_param, buffer, param_start, param_end, buffer_start, main_dtype=torch.float32):
        self.model_param = model_param
        self.buffer = buffer
        self.param_start = param_start
        self.param_end = param_end
        self.buffer_start = buffer_start
        self.is_buffer_view = steps_buffer_in_place(model_param, buffer, main_dtype)
        if self.is_buffer_view:
            # A parameter whose `.data` is the view has a version counter of its own (a view made directly would
            # share the whole buffer's): it counts the writes made through it (steps, loads, reloads) and not the
            # parameter all-gather's, which rewrites this shard with its own values (on gloo from a background
            # thread). CPU offload compares it with its host copy's version to know when that copy is stale.
            self.main_param = torch.nn.Parameter(torch.empty(0, dtype=main_dtype, device=model_param.device))
            self.main_param.data = self.param_buffer_view()
        else:
            flat = model_param.detach().reshape(-1)[param_start:param_end]
            self.main_param = torch.nn.Parameter(flat.clone().to(main_dtype))
            # A clone only this optimizer reads: CPU offload may move it to the host. A buffer view stays, since
            # the buffer is what gets gathered; offload steps a host copy of it and writes the result back.
            mark_relocatable(self.main_param)
        copy_parallel_attributes(model_param, self.main_param)

    def grad_view(self):
        return self.model_param.main_grad.reshape(-1)[self.param_start:self.param_end]

    def param_buffer_view(self):
        return self.buffer.param_data[self.buffer_start:self.buffer_start + self.param_end - self.param_start]


class DistributedOptimizer(MegatronOptimizer):
    """Shards main parameters and optimizer state of `model_chunks` (DDP modules) over their shard groups."""

    def __init__(self, param_groups, optimizer_factory, config, model_chunks, grad_scaler=None,
                 grad_stats_groups=None, found_inf_groups=None, expert_grad_stats_groups=None):
        self.model_chunks = list(model_chunks)
        param_to_buffer = {}
        for chunk in self.model_chunks:
            if not isinstance(chunk, DistributedDataParallel) or not chunk.ddp_config.use_distributed_optimizer:
                raise ValueError(
                    "DistributedOptimizer needs every model chunk wrapped in DistributedDataParallel with "
                    "DistributedDataParallelConfig(use_distributed_optimizer=True) (--use-distributed-optimizer)."
                )
            for buffer in chunk.buffers:
                param_to_buffer.update({param: buffer for param in buffer.params})

        self._model_params = []
        self._shards = []
        self._empty_matrix_pieces = []  # Muon: this rank's (empty) pieces of the matrices it owns no element of
        main_groups = []
        for group in param_groups:
            main_group_params = []
            for param in group["params"]:
                self._model_params.append(param)
                buffer = param_to_buffer[param]
                ranges = buffer.local_shard_ranges(param)
                if ranges is not None:
                    shard = _ParamShard(param, buffer, *ranges, main_dtype=config.main_params_dtype)
                    self._shards.append(shard)
                    main_param, start, end = shard.main_param, shard.param_start, shard.param_end
                elif group.get("use_muon", False):
                    main_param, start, end = self._empty_piece(param, config.main_params_dtype), 0, 0
                else:
                    continue
                if group.get("use_muon", False):
                    # Newton-Schulz needs the whole matrix: Muon assembles it from the pieces of the shard group.
                    # Under several instances the same piece is held once per instance: they share the work.
                    outer = [buffer.groups.outer_group] if buffer.groups.outer_group is not None else []
                    mark_matrix_piece(main_param, param.shape, start, end, [buffer.groups.shard_group], outer)
                main_group_params.append(main_param)
            main_groups.append({**group, "params": main_group_params})
        super().__init__(optimizer_factory(main_groups), config, grad_scaler, grad_stats_groups, found_inf_groups,
                         expert_grad_stats_groups)
        self._install_fp8_weights()

    def _empty_piece(self, param, dtype):
        """An empty main parameter standing for `param` on a rank that owns none of its elements."""
        piece = torch.nn.Parameter(torch.empty(0, dtype=dtype, device=param.device))
        copy_parallel_attributes(param, piece)
        self._empty_matrix_pieces.append(piece)
        return piece

    def _install_fp8_weights(self):
        """With FP8 parameters: quantize the main weights and gather them now, so the model computes with them."""
        if self.holds_fp8_parameters():
            self._copy_main_params_to_model_params()
            for chunk in self.model_chunks:
                chunk.finish_param_sync()

    def holds_fp8_parameters(self) -> bool:
        """Whether some DDP buffer stores FP8 weights (`--fp8-param-gather`), quantized from the main weights."""
        return any(getattr(buffer, "fp8_storage", None) is not None
                   for chunk in self.model_chunks for buffer in chunk.buffers)

    def model_params(self):
        return list(self._model_params)

    def _device(self):
        # Main parameters may rest in host memory (--optimizer-cpu-offload); statistics run on the model's device.
        return self._model_params[0].device if self._model_params else super()._device()

    def _copy_model_grads_to_main_grads(self):
        for shard in self._shards:
            if self.config.use_precision_aware_optimizer:
                # The buffer's view when it holds --main-grads-dtype (no copy; the precision-aware Adam computes in
                # fp32 itself), else a copy in that dtype: bf16 buffers (--grad-reduce-in-bf16) under fp32 main
                # gradients would otherwise be clipped in bf16, unlike the plain distributed optimizer's.
                shard.main_param.decoupled_grad = shard.grad_view().to(self.config.main_grads_dtype)
            else:
                shard.main_param.grad = fp32_grad(shard.grad_view())
        for piece in self._empty_matrix_pieces:
            piece.grad = torch.zeros_like(piece)
        for param in self._model_params:
            param.grad = None

    @torch.no_grad()
    def _copy_main_params_to_model_params(self):
        from megatron.core.fp8.params import quantize_main_params_into_fp8_buffers

        for shard in quantize_main_params_into_fp8_buffers(self.model_chunks, self._shards):
            if not shard.is_buffer_view:
                shard.param_buffer_view().copy_(shard.main_param)
        for chunk in self.model_chunks:
            chunk.start_param_sync()

    @torch.no_grad()
    def reload_model_params(self):
        for shard in self._shards:
            # Also for a buffer view (then a copy onto itself): it counts as a write of the main parameter, which
            # tells holders of a copy of it (CPU offload's host copy) that the model's weights changed.
            shard.main_param.copy_(shard.model_param.detach().reshape(-1)[shard.param_start:shard.param_end])
        self._install_fp8_weights()

    # ---- checkpoints --------------------------------------------------------------------------------------------
    def _layout_signature(self):
        index_of = {id(param): index for index, param in enumerate(self._model_params)}
        return [(index_of[id(shard.model_param)], shard.param_start, shard.param_end) for shard in self._shards]

    def state_dict(self):
        state = super().state_dict()
        state["fp32_main_params"] = [shard.main_param.detach().clone() for shard in self._shards]
        state["shard_layout"] = self._layout_signature()
        return state

    def load_torch_state_dict(self, state_dict):
        if state_dict.get("shard_layout") != self._layout_signature():
            raise ValueError(
                "DistributedOptimizer.load_state_dict: the checkpoint was sharded differently (another data-parallel "
                "size or model layout); save it with gathered_state_dict() and load with load_gathered_state_dict()."
            )
        super().load_torch_state_dict(state_dict)
        with torch.no_grad():
            for shard, saved in zip(self._shards, state_dict["fp32_main_params"], strict=True):
                shard.main_param.copy_(saved)
        self._copy_main_params_to_model_params()

    def gathered_state_dict(self):
        """Full fp32 main params and optimizer state per model parameter (in param-group order); collective."""
        shard_of = {id(shard.model_param): shard for shard in self._shards}
        param_states = []
        for param in self._model_params:
            shard = shard_of.get(id(param))
            local = {"main_param": None if shard is None else shard.main_param.detach()}
            if shard is not None:
                for key, value in self.optimizer.state.get(shard.main_param, {}).items():
                    if key != "step" and torch.is_tensor(value) and value.shape == shard.main_param.shape:
                        local[key] = self._state_value(shard.main_param, key, value).detach()
            keys = sorted(key for key in local if local[key] is not None)
            param_states.append(self._assemble(param, shard, keys, local))
        return {
            "param_states": param_states,
            "step": self._local_step(),
            "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups],
            "grad_scaler": None if self.grad_scaler is None else self.grad_scaler.state_dict(),
        }

    def _state_value(self, main_param, key, stored):
        """The value of a state tensor: an optimizer that stores moments scaled (fp16) unscales them."""
        get_unscaled_state = getattr(self.optimizer, "get_unscaled_state", None)
        return stored if get_unscaled_state is None or key not in MOMENT_KEYS else get_unscaled_state(main_param, key)

    def _assemble(self, param, shard, keys, local_values):
        group = self._shard_group_of(param)
        # Ranks may own different state keys for a parameter (or none at all): agree on the union first.
        gathered_keys = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered_keys, keys, group=group)
        all_keys = sorted({key for rank_keys in gathered_keys for key in rank_keys})
        full = {}
        for key in all_keys:
            flat = torch.zeros(param.numel(), dtype=torch.float32, device=param.device)
            if shard is not None:
                source = shard.main_param if key == "main_param" else local_values[key]
                flat[shard.param_start:shard.param_end] = source.detach().float()
            if dist.get_world_size(group) > 1:
                dist.all_reduce(flat, group=group)
            full[key] = flat.view(param.shape).cpu()
        return full

    def _shard_group_of(self, param):
        for chunk in self.model_chunks:
            for buffer in chunk.buffers:
                if param in buffer.param_index_map:
                    return buffer.groups.shard_group
        raise KeyError("parameter not found in any DDP buffer")

    def _local_step(self):
        """The optimizer's step count; ranks owning no elements ask the others."""
        steps = [float(state["step"]) for state in self.optimizer.state.values() if "step" in state]
        step = torch.tensor([max(steps, default=0.0)])
        if dist.is_initialized():
            step = step.to(get_current_device())
            dist.all_reduce(step, op=dist.ReduceOp.MAX)
        return step.item()

    def load_gathered_state_dict(self, state_dict):
        """Take this rank's shards out of `gathered_state_dict()` output (saved at any DP size)."""
        param_states = state_dict["param_states"]
        if len(param_states) != len(self._model_params):
            raise ValueError(
                f"load_gathered_state_dict: checkpoint has {len(param_states)} parameters, model has "
                f"{len(self._model_params)}."
            )
        index_of = {id(param): index for index, param in enumerate(self._model_params)}
        with torch.no_grad():
            for shard in self._shards:
                full = param_states[index_of[id(shard.model_param)]]
                local = {key: value.reshape(-1)[shard.param_start:shard.param_end] for key, value in full.items()}
                shard.main_param.copy_(local.pop("main_param"))
                state = self.optimizer.state[shard.main_param]
                state_dtypes = getattr(self.optimizer, "state_dtypes", {})
                set_scaled_state = getattr(self.optimizer, "set_scaled_state", None)
                for key, value in local.items():
                    if key in MOMENT_KEYS and set_scaled_state is not None:  # stored in its dtype (fp16 scaled)
                        set_scaled_state(shard.main_param, key, value.to(shard.main_param.device, torch.float32))
                        continue
                    dtype = state_dtypes.get(key, shard.main_param.dtype)
                    state[key] = value.to(shard.main_param.device, dtype).clone()
                state["step"] = torch.tensor(float(state_dict["step"]))
        # As the other loads: hyperparameters from the checkpoint, except the keys this run's flags set (Muon's
        # `settings_from_flags`) and the parameters themselves.
        kept = getattr(self.optimizer, "settings_from_flags", ())
        for group, saved in zip(self.optimizer.param_groups, state_dict["param_groups"], strict=True):
            group.update({key: value for key, value in saved.items() if key != "params" and key not in kept})
        if self.grad_scaler is not None and state_dict.get("grad_scaler") is not None:
            self.grad_scaler.load_state_dict(state_dict["grad_scaler"])
        self._copy_main_params_to_model_params()
