"""`HybridDeviceOptimizer` (`--optimizer-cpu-offload`): one optimizer whose first `offload_fraction` of the
parameters steps in host memory and the rest on the device.

Split: parameters are walked in parameter-group order and whole tensors go to the host until the host's element
count reaches `offload_fraction` of the total (the tensor that crosses it goes too; `offload_split`, pure
arithmetic, upstream's rule), so the offloaded parameters are a prefix.
Each offloaded parameter's main values live in host memory (`HostPlacement`: pinned where the compute device
can use it), where a host optimizer steps them with their optimizer state next to them. A main parameter its
owner marked relocatable (`mark_relocatable`: the distributed optimizer's fp32 main copies of bf16/fp16 shards,
clones nobody else reads) is moved there outright: the parameter object keeps its identity but its storage is the
host buffer, its device storage is released, and the owner's usual copy of main into model parameters
(`_copy_main_params_to_model_params`) uploads the updated values into the model's device weights. So under the
distributed optimizer with a bf16 model and fp32 Adam the device keeps none of the 12 bytes per offloaded parameter
(master weight and both moments). Megatron-FSDP's fp32 main weights under bf16 compute are relocated the same way:
`MegatronFSDPOptimizer` asks for the split (`planned_offload`), has the wrapper give the views it names storages of
their own (`separate_main_weights`) and marks them relocatable with an `InstallTarget` (their place in the compute
weights), into which this optimizer uploads their new values after the host step (cast to the target's dtype on
the host). A main parameter that is a view its owner keeps reading stays where it is: its host copy is stepped and
the result copied back into it. Such are the distributed optimizer's main parameters of fp32 weights (their shards
of its parameter buffer, which it all-gathers) and Megatron-FSDP's main weights in the model's dtype (the model's
weights themselves).

A step: the offloaded parameters' gradients are copied device -> host (and a kept device view's host copy is
refreshed first if someone wrote the view since the last step, e.g. a checkpoint load; detected from the
tensor's version counter), the device optimizer steps while those copies run, then the host optimizer steps and
the updated values of kept views (and of relocated parameters with an install target) are copied host -> device.
With `overlap_d2h_h2d` on CUDA the copies run on side streams and each offloaded parameter has its own host
optimizer, so one parameter's host step overlaps the next one's gradient copy and the previous one's upload;
otherwise (and always on the CPU) copies are synchronous and one host optimizer steps all offloaded parameters.
The device parameters hold the updated values when `step()` returns (device kernels queued afterwards see them).

Outside, it looks like the optimizer it replaces: `param_groups` hold the parameters it was given (wrappers may
re-point them before the first step, as Megatron-FSDP does; the split is rebuilt then), `state` is keyed by
those parameters (the host optimizer's state dicts are the same objects, so writes through `state` reach it),
and `state_dict()` / `load_state_dict()` are torch's, so checkpoints have the same keys and values with or
without offload and load across offload settings. State loaded onto the device is moved to the host at the
next step; `state_dtypes` (the precision-aware optimizer's moment dtypes) are kept through loads, with the
scales of fp16 moments (`get_unscaled_state` / `set_scaled_state` read and write moments by value, as the
precision-aware optimizer's do).
"""

from typing import Callable, List, Sequence

import torch

from megatron.core.offloading.host_transfers import CopyStream
from megatron.core.offloading.placement import HostPlacement, install_target_of, is_relocatable
from megatron.core.optimizer.precision_aware_adam import (MOMENT_KEYS, checked_stored_moments, fresh_state,
                                                        optimizer_grad, restore_moments, store_moment,
                                                        unscaled_moment)


def offload_split(numels: Sequence[int], fraction: float) -> List[bool]:
    """Whether each parameter (by element count, in order) is offloaded: whole tensors, in order, until the
    offloaded total reaches `fraction` of all elements. Empty tensors stay on the device (nothing to copy)."""
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"offload fraction {fraction} must lie in [0, 1] (--optimizer-offload-fraction)")
    threshold = fraction * sum(numels)
    offloaded, result = 0, []
    for numel in numels:
        goes_to_host = numel > 0 and offloaded < threshold
        offloaded += numel if goes_to_host else 0
        result.append(goes_to_host)
    return result


class _OffloadedParam:
    """A main parameter, the host tensor stepped for it and its host gradient, and the version of the parameter
    the host tensor reflects. `relocated`: the parameter itself now lives in the host tensor's storage (no
    device copy left; uploaded after each step into its owner's `install` target if it named one, in the
    target's dtype through the host buffer `staging` when the dtypes differ); otherwise the host tensor is a copy
    uploaded into the parameter after each step."""

    def __init__(self, device_param, group_index, grads_by_attribute, placement: HostPlacement,
                 grad_placement: HostPlacement):
        self.device_param = device_param
        self.group_index = group_index
        self.placement = placement
        self.grad_placement = grad_placement
        self.relocated = is_relocatable(device_param)
        self.install = self.staging = None
        if self.relocated:
            self.host_param = placement.relocate_to_host(device_param)
            self.install = install_target_of(device_param)
            if self.install is not None and self.install.tensor.dtype != self.host_param.dtype:
                self.staging = placement.empty_like(self.install.tensor)
        else:
            self.host_param = placement.copy_of(device_param)
        self.host_grad = None
        self.grads_by_attribute = grads_by_attribute
        self.synced_version = device_param._version
        self.pending = []

    def attach_host_grad(self, device_grad):
        """The host buffer for `device_grad`: in its own dtype for an optimizer that reads `decoupled_grad`,
        else in the parameter's (torch optimizers want `.grad` in the parameter's dtype)."""
        dtype = device_grad.dtype if self.grads_by_attribute else self.host_param.dtype
        if self.host_grad is None or self.host_grad.dtype != dtype:
            self.host_grad = self.grad_placement.empty_like(self.host_param, dtype)
        if self.grads_by_attribute:
            self.host_param.decoupled_grad = self.host_grad
        else:
            self.host_param.grad = self.host_grad
        return self.host_grad

    def detach_host_grad(self):
        self.host_param.grad = None
        self.host_param.decoupled_grad = None


def _reads_decoupled_grads(optimizer) -> bool:
    from megatron.core.optimizer.precision_aware_adam import PrecisionAwareAdamW

    return isinstance(optimizer, PrecisionAwareAdamW)


class HybridDeviceOptimizer(torch.optim.Optimizer):
    """See the module docstring.

    Args:
        param_groups: torch param groups of device tensors (hyper-parameters per group).
        device_optimizer_factory: builds the optimizer of the device part from param groups.
        host_optimizer_factory: builds a host optimizer from param groups of host tensors.
        offload_fraction: share of the elements stepped on the host (`--optimizer-offload-fraction`).
        overlap_d2h_h2d: side-stream copies and per-parameter host optimizers (`--overlap-cpu-optimizer-d2h-h2d`).
        pin_cpu_grads, pin_cpu_params: pin the host gradients, and the host parameters and their state, where the
            compute device can use pinned memory (upstream's `OptimizerConfig` fields; False: pageable memory).
    """

    def __init__(self, param_groups, device_optimizer_factory: Callable, host_optimizer_factory: Callable,
                 offload_fraction: float = 1.0, overlap_d2h_h2d: bool = False, pin_cpu_grads: bool = True,
                 pin_cpu_params: bool = True):
        param_groups = list(param_groups)
        first = next(param for group in param_groups for param in group["params"])
        # The defaults of the optimizer being replaced, so param groups (and checkpoints) carry the same keys.
        probe = device_optimizer_factory([{"params": [torch.zeros(1, device=first.device)]}])
        super().__init__(param_groups, dict(probe.defaults))
        self.device = first.device
        self.placement = HostPlacement.for_device(self.device, can_pin=None if pin_cpu_params else False)
        self.grad_placement = HostPlacement.for_device(self.device, can_pin=None if pin_cpu_grads else False)
        self.offload_fraction = offload_fraction
        self.overlap_d2h_h2d = overlap_d2h_h2d
        self.state_dtypes = dict(getattr(probe, "state_dtypes", {}))
        self._device_optimizer_factory = device_optimizer_factory
        self._host_optimizer_factory = host_optimizer_factory
        self._built_for = None
        offload_split(  # reject a bad fraction now rather than at the first step
            [param.numel() for group in param_groups for param in group["params"]], offload_fraction)

    # ---- the split ------------------------------------------------------------------------------------------
    def _param_identity(self):
        return tuple(id(param) for group in self.param_groups for param in group["params"])

    def planned_offload(self):
        """The parameters the current param groups put on the host, in order (the split alone: nothing is built
        or moved), so their owner can prepare them (e.g. `mark_relocatable`) before the first step."""
        params = [param for group in self.param_groups for param in group["params"]]
        return [param for param, goes_to_host in zip(params, offload_split([param.numel() for param in params],
                                                                          self.offload_fraction)) if goes_to_host]

    def _ensure_built(self):
        if self._built_for == self._param_identity():
            return
        indexed = [(index, param) for index, group in enumerate(self.param_groups) for param in group["params"]]
        on_host = offload_split([param.numel() for _, param in indexed], self.offload_fraction)
        device_groups = [[] for _ in self.param_groups]
        self.offloaded = []
        host_reads_decoupled = _reads_decoupled_grads(
            self._host_optimizer_factory([{"params": [torch.zeros(1)]}]))
        for (index, param), goes_to_host in zip(indexed, on_host):
            if goes_to_host:
                self.offloaded.append(_OffloadedParam(param, index, host_reads_decoupled, self.placement,
                                                      self.grad_placement))
            else:
                device_groups[index].append(param)
        self.device_optimizer = self._build(self._device_optimizer_factory, device_groups)
        if self.overlap_d2h_h2d:
            self.host_steps = []
            for entry in self.offloaded:
                groups = [[] for _ in self.param_groups]
                groups[entry.group_index].append(entry.host_param)
                self.host_steps.append((self._build(self._host_optimizer_factory, groups), [entry]))
        else:
            groups = [[] for _ in self.param_groups]
            for entry in self.offloaded:
                groups[entry.group_index].append(entry.host_param)
            host_optimizer = self._build(self._host_optimizer_factory, groups)
            self.host_steps = [(host_optimizer, list(self.offloaded))] if host_optimizer is not None else []
        self._download = CopyStream(self.device, overlap=self.overlap_d2h_h2d)
        self._upload = CopyStream(self.device, overlap=self.overlap_d2h_h2d)
        self._built_for = self._param_identity()

    def _build(self, factory, params_per_group):
        """An optimizer over the non-empty groups of `params_per_group` (None if all are empty); remembers which
        of this optimizer's groups each of its groups mirrors."""
        indices = [index for index, params in enumerate(params_per_group) if params]
        if not indices:
            return None
        optimizer = factory([{**self._hyper_parameters(index), "params": params_per_group[index]}
                             for index in indices])
        optimizer._hybrid_group_indices = indices
        return optimizer

    def _hyper_parameters(self, index):
        return {key: value for key, value in self.param_groups[index].items() if key != "params"}

    def sub_optimizers(self):
        """The device optimizer (if any part stays on the device) and the host optimizers."""
        self._ensure_built()
        device = [self.device_optimizer] if self.device_optimizer is not None else []
        return device + [optimizer for optimizer, _ in self.host_steps]

    def offloaded_params(self):
        """The device parameters stepped on the host, in order."""
        self._ensure_built()
        return [entry.device_param for entry in self.offloaded]

    def initialize_state(self):
        """Create every parameter's state as a first step of the precision-aware optimizer would (step 0, zero
        moments in their dtypes) without stepping or building the split, so that a loader that fills the
        optimizer's existing state (Megatron-FSDP's checkpoints) finds it. The planned offloaded parameters' state
        is allocated in host memory. An optimizer of another kind keeps its state lazily."""
        if set(self.state_dtypes) != set(MOMENT_KEYS):
            return
        on_host = {id(param) for param in self.planned_offload()}
        for group in self.param_groups:
            for param in group["params"]:
                state = self.state[param]
                if not state:
                    state.update(fresh_state(param, self.state_dtypes,
                                             self.placement.empty_like if id(param) in on_host else None))

    # ---- state shared with the sub-optimizers ----------------------------------------------------------------
    def _link(self):
        """Give the sub-optimizers this step's hyper-parameters and make their state dicts ours."""
        for optimizer in self.sub_optimizers():
            for sub_group, index in zip(optimizer.param_groups, optimizer._hybrid_group_indices):
                sub_group.update(self._hyper_parameters(index))
        if self.device_optimizer is not None:
            for group in self.device_optimizer.param_groups:
                for param in group["params"]:
                    self.device_optimizer.state[param] = self.state[param]
        for optimizer, entries in self.host_steps:
            for entry in entries:
                state = self.state[entry.device_param]
                for key, value in list(state.items()):
                    if torch.is_tensor(value) and value.dim() > 0 and value.device != entry.host_param.device:
                        state[key] = value.to(entry.host_param.device)
                optimizer.state[entry.host_param] = state

    def load_state_dict(self, state_dict):
        """torch's loader, then the moments (and scales) back in their configured dtypes (it casts them to the
        parameter's) and the offloaded parameters' state moved to the host."""
        super().load_state_dict(state_dict)
        params = [param for group in self.param_groups for param in group["params"]]
        for index, saved in state_dict["state"].items():
            restore_moments(self.state[params[index]], saved, self.state_dtypes, params[index].device)
        self._ensure_built()
        self._link()

    def get_unscaled_state(self, param, state_name):
        """The value of `param`'s moment `state_name`: fp32 for an fp16 (scaled) moment, else as stored."""
        state = self.state[param]
        checked_stored_moments(state, self.state_dtypes, state[state_name].device)  # after a loader's write
        return unscaled_moment(state, state_name)

    def set_scaled_state(self, param, state_name, unscaled_state):
        """Store `unscaled_state` as `param`'s moment `state_name` in its configured dtype (fp16 scaled), where
        the moment is kept now."""
        state = self.state[param]
        device = state[state_name].device if state_name in state else param.device
        store_moment(state, state_name, unscaled_state.to(device), self.state_dtypes.get(state_name,
                                                                                          unscaled_state.dtype))

    # ---- the step ---------------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._ensure_built()
        self._link()
        for entry in self.offloaded:
            self._start_download(entry)
        if self.device_optimizer is not None:
            self.device_optimizer.step()  # runs while the gradients travel to the host
        uploads = []
        for host_optimizer, entries in self.host_steps:
            for entry in entries:
                for handle in entry.pending:
                    handle.wait_on_host()
            host_optimizer.step()
            uploads += [self._start_upload(entry) for entry in entries
                        if entry.pending and (not entry.relocated or entry.install is not None)]
        for handle in uploads:
            handle.wait_on_device(self.device)
        for entry in self.offloaded:
            entry.synced_version = entry.device_param._version
            entry.pending = []
        return loss

    def _start_upload(self, entry):
        """Queue the copy of `entry`'s new values to the device: into the parameter (a host copy of it), or into
        its owner's install target (a relocated parameter), cast on the host first when the target's dtype
        differs (half the bytes to move for a bf16 target), and tell the owner."""
        if not entry.relocated:
            return self._upload.copy(entry.device_param, entry.host_param)
        source = entry.host_param
        if entry.staging is not None:
            # Not read by an upload still in flight: the previous one finished before this step's gradient copy.
            source = entry.staging.view(entry.host_param.shape).copy_(entry.host_param)
        handle = self._upload.copy(entry.install.tensor, source.view(entry.install.tensor.shape))
        entry.install.on_installed()
        return handle

    def _start_download(self, entry):
        """Queue the copies the host step of `entry` needs: its gradient, and its value if the device
        parameter was written since the host copy was made (a load, a reload of the model's weights)."""
        entry.pending = []
        grad = optimizer_grad(entry.device_param)
        if grad is None:
            entry.detach_host_grad()
            return
        if not entry.relocated and entry.device_param._version != entry.synced_version:
            entry.pending.append(self._download.copy(entry.host_param, entry.device_param.detach()))
        entry.pending.append(self._download.copy(entry.attach_host_grad(grad), grad))
