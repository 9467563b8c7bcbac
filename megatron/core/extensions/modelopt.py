"""Post-training quantization of this code base's models with nvidia-modelopt.

modelopt quantizes the module types it knows. Its Megatron plugin (`modelopt.torch.quantization.plugins.megatron`,
imported with modelopt) registers the tensor-parallel linear layers: their quantized versions put an input and a
weight quantizer around the GEMM function the layers call (`tensor_parallel.layers.
linear_with_grad_accumulation_and_async_allreduce`), and calibration agrees on the quantizers' amaxes across the
data- and tensor-parallel groups. `register_tensor_parallel_layers()` checks that the plugin did.
`quantize(model, name, forward_loop)` runs PTQ with one of `QUANT_CONFIGS`; `modelopt_state(model)` / `restore(model, state)` carry modelopt's own record of what was
converted, which a fresh model needs before the quantized weights and quantizer states can be loaded.
"""

import copy

from megatron.core.optional_deps import HAVE_MODELOPT

# Configurations whose kernels run on CPUs as well as GPUs (fake quantization); the MX / NV FP4 ones need CUDA.
QUANT_CONFIGS = {
    "fp8": "FP8_DEFAULT_CFG",
    "fp8_per_channel_per_token": "FP8_PER_CHANNEL_PER_TOKEN_CFG",
    "int8": "INT8_DEFAULT_CFG",
    "int8_weight_only": "INT8_WEIGHT_ONLY_CFG",
}


def require_modelopt():
    if not HAVE_MODELOPT:
        raise RuntimeError(
            "nvidia-modelopt is not importable: install the modelopt extra (pip install -e '.[modelopt]'), which "
            "also brings the requests and huggingface_hub packages modelopt imports"
        )


def register_tensor_parallel_layers():
    """Make sure modelopt's Megatron quantization plugin registered ColumnParallelLinear and RowParallelLinear
    (it does when `modelopt.torch.quantization` is imported and the plugin's imports succeed)."""
    require_modelopt()
    import importlib

    from modelopt.torch.quantization.nn import QuantModuleRegistry

    from megatron.core.tensor_parallel import layers

    try:
        importlib.import_module("modelopt.torch.quantization.plugins.megatron")
    except Exception as exc:
        raise RuntimeError(
            f"modelopt's Megatron quantization plugin does not import against this megatron.core ({exc!r}); "
            "the tensor-parallel layers cannot be quantized without it"
        ) from exc
    for layer in (layers.ColumnParallelLinear, layers.RowParallelLinear):
        if QuantModuleRegistry.get(layer) is None:
            raise RuntimeError(f"modelopt's Megatron plugin did not register {layer.__name__}")


# The norms' own input quantizers stay off. modelopt quantizes torch's LayerNorm as a module of its own, so its
# wildcard `*input_quantizer` rule would fake-quantize the residual stream that enters each norm; in
# Megatron-Core the norm is fused into the next linear, whose input quantizer quantizes the norm's output (as
# here too). Quantizing the residual stream itself would also make the model depend on the last bits of the
# residual (an element near an FP8 rounding boundary moves by a whole step, 2**-3 relative), which differ
# between tensor-parallel sizes because row-parallel partial sums are added in another order.
NORM_QUANTIZERS_OFF = {"quantizer_name": "*layernorm*", "enable": False}


def quant_config(name):
    """A deep copy of modelopt's configuration `QUANT_CONFIGS[name]`, with the norms' quantizers off."""
    require_modelopt()
    import modelopt.torch.quantization as mtq

    if name not in QUANT_CONFIGS:
        raise ValueError(f"--quant-cfg must be one of {sorted(QUANT_CONFIGS)}, got {name!r}")
    config = copy.deepcopy(getattr(mtq, QUANT_CONFIGS[name]))
    rules = config["quant_cfg"]
    if isinstance(rules, dict):  # older modelopt: {pattern: settings}
        rules[NORM_QUANTIZERS_OFF["quantizer_name"]] = {"enable": False}
    else:
        rules.append(dict(NORM_QUANTIZERS_OFF))
    return config


def quantize(model, name, forward_loop):
    """Insert quantizers into `model` and calibrate them by running `forward_loop(model)`; returns the model."""
    register_tensor_parallel_layers()
    import modelopt.torch.quantization as mtq

    return mtq.quantize(model, quant_config(name), forward_loop)


def modelopt_state(model):
    """modelopt's record of the conversions applied to `model` (saved as `modelopt_state` in a checkpoint)."""
    require_modelopt()
    import modelopt.torch.opt as mto

    return mto.modelopt_state(model)


def restore(model, state):
    """Apply the conversions `state` records to a freshly built `model` (load its state dict afterwards)."""
    register_tensor_parallel_layers()
    import modelopt.torch.opt as mto

    return mto.restore_from_modelopt_state(model, state)
