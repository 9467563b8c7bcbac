"""`MegatronModule`, the base of upstream Megatron-Core's model modules, and `Float16Module`, the wrapper that
runs a model in fp16 or bf16.

`MegatronModule` keeps its `config` and builds `sharded_state_dict` (from `ShardedStateModule`): checkpoint entries keyed by name, each
tensor as this rank's piece of the logical tensor (a tensor-parallel parameter, `tensor_model_parallel` with
its `partition_dim`, as its partition; everything else whole), submodules that define their own
`sharded_state_dict` asked for theirs. This code base's models (GPTModel and its layers) are plain modules with
a config; they are checkpointed by `dist_checkpointing.model_state`, which names and places the same tensors.
"""

import torch

from megatron.core.transformer.utils import module_sharded_state_dict, sharded_state_dict_default


class ShardedStateModule(torch.nn.Module):
    """A module with upstream's default `sharded_state_dict` (see `module_sharded_state_dict`)."""

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        return module_sharded_state_dict(self, prefix, sharded_offsets, metadata)


class MegatronModule(ShardedStateModule):
    """A module built from a `TransformerConfig` (kept as `self.config`), with a default `sharded_state_dict`.

    GPTModel and its layers derive from `ShardedStateModule` only: modelopt's Megatron plugin treats every
    `MegatronModule` as upstream's, annotating its (here frozen) config and storing quantizer state as module
    extra state through `torch.cuda.synchronize()`, which fails on CPU builds. Without that, quantizer state
    travels in modelopt's own state (`mto.modelopt_state`) and the amaxes as buffers of the model's state.
    """

    def __init__(self, config):
        super().__init__()
        self.config = config


def _half_dtype(config):
    if getattr(config, "fp16", False):
        return torch.float16
    if getattr(config, "bf16", False):
        return torch.bfloat16
    raise ValueError("Float16Module needs a config with fp16 or bf16 set (--fp16 / --bf16)")


def _cast_floats(value, dtype):
    if torch.is_tensor(value):
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, (list, tuple)):
        return type(value)(_cast_floats(v, dtype) for v in value)
    if isinstance(value, dict):
        return {k: _cast_floats(v, dtype) for k, v in value.items()}
    return value


class Float16Module(MegatronModule):
    """Runs `module` in fp16 (`config.fp16`) or bf16 (`config.bf16`): its parameters and buffers are cast once;
    on the first pipeline stage floating-point inputs are cast to that dtype, and on the last stage the outputs
    come back in fp32 (in the module's dtype with `fp32_output=False`, as upstream). The state dict is the wrapped
    module's (no `module.` prefix)."""

    def __init__(self, config, module: torch.nn.Module):
        super().__init__(config)
        self.dtype = _half_dtype(config)
        self.add_module("module", module.to(self.dtype))

    def set_input_tensor(self, input_tensor):
        return self.module.set_input_tensor(input_tensor)

    def forward(self, *inputs, fp32_output=True, **kwargs):
        from megatron.core import parallel_state

        initialized = parallel_state.model_parallel_is_initialized()
        if not initialized or parallel_state.is_pipeline_first_stage():
            inputs = _cast_floats(inputs, self.dtype)
            kwargs = _cast_floats(kwargs, self.dtype)
        outputs = self.module(*inputs, **kwargs)
        if fp32_output and (not initialized or parallel_state.is_pipeline_last_stage()):
            outputs = _cast_floats(outputs, torch.float32)
        return outputs

    def state_dict(self, destination=None, prefix="", keep_vars=False):
        return self.module.state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars)

    def load_state_dict(self, state_dict, strict=True, assign=False):
        return self.module.load_state_dict(state_dict, strict=strict, assign=assign)

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        return sharded_state_dict_default(self.module, prefix, sharded_offsets, metadata)
