"""`DataParallelWrapper`: the one interface every data-parallel wrapper of a model chunk offers training.

Three wrappers implement it, and `wrapper_factory.wrap_data_parallel` picks one from the config:
- `DistributedDataParallel` (Megatron DDP; with `use_distributed_optimizer` also the layout the
  `DistributedOptimizer` steps on),
- `MegatronFSDPAdapter` (Megatron-FSDP, ZeRO-0..3; upstream name `FullyShardedDataParallel`),
- `TorchFSDP2` (PyTorch FSDP2 `fully_shard`; upstream name `TorchFullyShardedDataParallel`).

What training, the pipeline schedules, `finalize_model_grads`, the optimizers, the memory log line and the
checkpoint code may rely on:

    gradients    no_sync(), start_grad_sync(), finish_grad_sync(), scale_gradients(f), zero_grad_buffer()
    parameters   start_param_sync(force_sync=False), finish_param_sync(), broadcast_params()
    accounting   state_bytes() -> {"params_bytes", "grads_bytes"[, "optimizer_state_bytes"]} of this rank
    state        state_dict(), load_state_dict(), unwrapped_module (the model whose names are saved)
    attributes   config, ddp_config, module, data_parallel_group

Anything else is looked up on the wrapped model (`__getattr__`, defined here only), so that e.g.
`set_input_tensor` or `shared_embedding_or_output_weight` work through any wrapper.

Rules about `DistributedDataParallelConfig` fields are checked in its `__post_init__` (and so, for the command
line, when argument validation builds it); the wrappers do not check them again.
"""

import abc
import sys

import torch


PER_TOKEN_AVERAGE_MESSAGE = (
    "--calculate-per-token-loss (config.calculate_per_token_loss) and --ddp-average-in-collective "
    "(ddp_config.average_in_collective) are exclusive: per-token gradients are summed over the data-parallel ranks "
    "and divided by the global token count, and an average in the collective would divide them by the "
    "data-parallel size once more; drop --ddp-average-in-collective"
)


class DataParallelWrapper(torch.nn.Module, abc.ABC):
    """Base of the data-parallel wrappers; see the module docstring for the contract.

    Subclasses set `self.module` (the wrapped model, or the wrapper library's module around it) and
    `self.data_parallel_group` in their constructor, after calling `super().__init__(config, ddp_config)`.
    """

    def __init__(self, config, ddp_config):
        if getattr(config, "calculate_per_token_loss", False) and ddp_config.average_in_collective:
            # A rule between the model config and the data-parallel one: neither config sees the other.
            raise ValueError(PER_TOKEN_AVERAGE_MESSAGE)
        super().__init__()
        self.config = config
        self.ddp_config = ddp_config

    def __setattr__(self, name, value):
        super().__setattr__(name, value)
        if name == "module" and getattr(self.ddp_config, "keep_fp8_transpose_cache", False):
            for submodule in value.modules():
                if hasattr(submodule, "_fp8_keep_transpose"):  # the FP8-capable linear layers
                    submodule._fp8_keep_transpose = True

    # ---- forward and the wrapped model ---------------------------------------------------------------------------
    def forward(self, *inputs, **kwargs):
        return self.module(*inputs, **kwargs)

    @property
    def unwrapped_module(self) -> torch.nn.Module:
        """The model this wrapper was built around: the module whose parameter names checkpoints use."""
        return self.module

    def __getattr__(self, name):
        """Fall back to the wrapped model for what the wrapper does not define itself."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == "module" or "module" not in self.__dict__.get("_modules", {}):
                raise
            return getattr(self.unwrapped_module, name)

    # ---- gradients ---------------------------------------------------------------------------------------------
    @abc.abstractmethod
    def no_sync(self):
        """Context manager: backward passes inside only accumulate this rank's gradients; the first backward
        outside it (the last microbatch) reduces them."""

    @abc.abstractmethod
    def start_grad_sync(self, *unused):
        """Start the data-parallel gradient reductions not started yet (asynchronously where possible). Positional
        arguments (the parameters the schedules pass to `config.grad_sync_func`) are ignored."""

    @abc.abstractmethod
    def finish_grad_sync(self):
        """Complete every gradient reduction of the step; afterwards the gradients the optimizer reads are
        reduced over the data-parallel ranks."""

    @abc.abstractmethod
    def scale_gradients(self, scaling_factor: float):
        """Multiply the step's gradients by `scaling_factor` (e.g. 1 / token count for per-token losses)."""

    @abc.abstractmethod
    def zero_grad_buffer(self):
        """Drop this step's gradients and communication state (call before each step)."""

    # ---- parameters --------------------------------------------------------------------------------------------
    @abc.abstractmethod
    def start_param_sync(self, *unused, force_sync: bool = False):
        """Start gathering the parameters the optimizer just updated (synchronously with `force_sync`). Positional
        arguments (the parameters the schedules pass to `config.param_sync_func`) are ignored."""

    @abc.abstractmethod
    def finish_param_sync(self):
        """Wait for gathers started by `start_param_sync`; afterwards the model reads the updated weights."""

    @abc.abstractmethod
    def broadcast_params(self):
        """Make every data-parallel rank hold data-parallel rank 0's weights (`--data-parallel-random-init`)."""

    # ---- accounting --------------------------------------------------------------------------------------------
    @abc.abstractmethod
    def state_bytes(self) -> dict:
        """Persistent bytes this rank holds for the model: `params_bytes` and `grads_bytes`, plus
        `optimizer_state_bytes` when the wrapper owns the optimizer's side (otherwise the memory line counts the
        torch optimizer's tensors). Read by `megatron.training.training_log.memory_usage`."""

    # ---- state -------------------------------------------------------------------------------------------------
    def state_dict(self, *args, **kwargs):
        """The wrapped model's state dict, with the model's own parameter names (no wrapper prefix)."""
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True):
        return self.module.load_state_dict(state_dict, strict=strict)


# Upstream Megatron-Core's name for the base class.
_BaseDataParallel = DataParallelWrapper


def _package_wrapper_class():
    """`megatron_fsdp.MegatronFSDP` when that package is loaded (a bare package wrapper has `.module` too);
    looked up without importing it."""
    wrapper_module = sys.modules.get("megatron_fsdp.megatron_fsdp")
    return getattr(wrapper_module, "MegatronFSDP", None) if wrapper_module is not None else None


def unwrap_model(model):
    """Strip the data-parallel wrappers (and a bare `megatron_fsdp.MegatronFSDP`) from a model chunk, or from
    each chunk of a list, returning the module(s) whose parameter names checkpoints use."""
    if isinstance(model, (list, tuple)):
        return [unwrap_model(chunk) for chunk in model]
    package_wrapper = _package_wrapper_class()
    while True:
        if isinstance(model, DataParallelWrapper):
            model = model.unwrapped_module
        elif package_wrapper is not None and isinstance(model, package_wrapper):
            model = model.module
        else:
            return model


def is_dtensor(tensor) -> bool:
    """Whether `tensor` is a DTensor, without importing torch.distributed.tensor (slow to import): no DTensor
    exists before that module is loaded."""
    dtensor = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)
    return dtensor is not None and isinstance(tensor, dtensor)


def local_tensor(tensor):
    """The part of `tensor` this rank stores: a DTensor's local shard, a plain tensor itself."""
    return tensor.to_local() if is_dtensor(tensor) else tensor


def storage_key(tensor):
    """Identifies the memory behind the part of `tensor` this rank stores: its local tensor's untyped storage
    address (a DTensor's own `data_ptr()` is 0 for every DTensor, so it cannot tell two apart); None on meta."""
    local = local_tensor(tensor)
    if local.is_meta:
        return None
    return (local.device, local.untyped_storage().data_ptr())


def tensor_bytes(tensor) -> int:
    """Bytes of the part of `tensor` this rank stores."""
    local = local_tensor(tensor)
    return local.numel() * local.element_size()


def parameter_and_grad_bytes(module) -> dict:
    """`params_bytes` and `grads_bytes` this rank holds for `module`'s parameters: their local parts, and each
    parameter's `main_grad` (a DDP buffer view) or else its `.grad`."""
    params_bytes = grads_bytes = 0
    for param in module.parameters():
        params_bytes += tensor_bytes(param)
        main_grad = getattr(param, "main_grad", None)
        if main_grad is not None:
            grads_bytes += tensor_bytes(main_grad)
        elif param.grad is not None:
            grads_bytes += tensor_bytes(param.grad)
    return {"params_bytes": params_bytes, "grads_bytes": grads_bytes}
