"""Post-training quantization of this code base's models with nvidia-modelopt.

modelopt quantizes the module types it knows. `register_tensor_parallel_layers()` teaches it the
tensor-parallel linear layers: their quantized versions put an input and a weight quantizer around the one
GEMM helper the layers call (`tensor_parallel.layers._linear`), and calibration agrees on the quantizers'
amaxes across the data- and tensor-parallel groups. `quantize(model, name, forward_loop)` runs PTQ with one
of `QUANT_CONFIGS`; `modelopt_state(model)` / `restore(model, state)` carry modelopt's own record of what was
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


_REGISTERED = []


def register_tensor_parallel_layers():
    """Register ColumnParallelLinear and RowParallelLinear with modelopt's quantized-module registry (once)."""
    require_modelopt()
    if _REGISTERED:
        return
    from modelopt.torch.quantization.nn import QuantModuleRegistry
    from modelopt.torch.quantization.plugins.custom import _ParallelLinear
    from modelopt.torch.utils.distributed import ParallelState

    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import layers

    class _QuantTensorParallelLinear(_ParallelLinear):
        _functionals_to_replace = [(layers, "_linear")]

        def _setup(self):
            if parallel_state.model_parallel_is_initialized():
                self.parallel_state = ParallelState(
                    parallel_state.get_data_parallel_group(with_context_parallel=True),
                    parallel_state.get_tensor_model_parallel_group(),
                )
            else:
                self.parallel_state = ParallelState(None, None)
            super()._setup()

    class _QuantColumnParallelLinear(_QuantTensorParallelLinear):
        _is_column_parallel = True

    class _QuantRowParallelLinear(_QuantTensorParallelLinear):
        _is_row_parallel = True

    for original, quantized in (
        (layers.ColumnParallelLinear, _QuantColumnParallelLinear),
        (layers.RowParallelLinear, _QuantRowParallelLinear),
    ):
        if QuantModuleRegistry.get(original) is None:
            QuantModuleRegistry.register({original: f"megatron_{original.__name__}"})(quantized)
    _REGISTERED.append(True)


def quant_config(name):
    """A deep copy of modelopt's configuration `QUANT_CONFIGS[name]`."""
    require_modelopt()
    import modelopt.torch.quantization as mtq

    if name not in QUANT_CONFIGS:
        raise ValueError(f"--quant-cfg must be one of {sorted(QUANT_CONFIGS)}, got {name!r}")
    return copy.deepcopy(getattr(mtq, QUANT_CONFIGS[name]))


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
