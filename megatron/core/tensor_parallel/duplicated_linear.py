"""A linear layer whose whole weight every tensor-parallel rank holds (Megatron's "duplicated" parallel mode).

Multi-latent attention's down projections are small: every rank computes the full latent of its own tokens
instead of splitting the projection. The weight is initialised like the tensor-parallel layers' (a full fp32
master on the CPU from the default generator), so it is the same on every rank and at every TP size.

Gradients: without sequence parallelism every rank sees every token and the same downstream gradient (the
layers that consume the latent all-reduce their input gradient), so the ranks' weight gradients are equal.
With sequence parallelism each rank projects only its share of the sequence and its weight gradient is a
partial sum; the weight then carries `sequence_parallel=True`, which makes gradient finalisation all-reduce it
over the tensor-parallel group (as for the norms).
"""

import torch
from torch.nn.parameter import Parameter

from megatron.core import parallel_state
from megatron.core.tensor_parallel.fp8_layer_state import _Fp8LinearMixin
from megatron.core.tensor_parallel.partitioned_parameters import (
    parameter_device,
    set_tensor_model_parallel_attributes,
    zero_parameter,
)


class DuplicatedLinear(_Fp8LinearMixin, torch.nn.Module):
    """Y = XA + b with the full A on every rank; `forward(x) -> (output, None)` like the parallel layers."""

    fp8_parallel_mode = "none"

    def __init__(self, input_size, output_size, *, config, init_method, bias=False):
        super().__init__()
        self.config = config
        self.input_size = input_size
        self.output_size = output_size
        self.init_method = init_method
        self.gradient_accumulation_fusion = config.gradient_accumulation_fusion
        split_tokens = bool(config.sequence_parallel) and parallel_state.get_tensor_model_parallel_world_size() > 1
        device = parameter_device(config)
        self.weight = Parameter(torch.empty(output_size, input_size, dtype=config.params_dtype, device=device))
        params = [self.weight]
        if bias:
            self.bias = Parameter(torch.empty(output_size, dtype=config.params_dtype, device=device))
            params.append(self.bias)
        else:
            self.register_parameter("bias", None)
        for param in params:
            set_tensor_model_parallel_attributes(param, False, -1, 1)
            param.sequence_parallel = split_tokens
            param.allreduce = True
        self._init_fp8(config)
        self.reset_parameters()

    def reset_parameters(self):
        if self.config.perform_initialization and not self.weight.is_meta:
            self._initialize_weight()
        zero_parameter(self.bias)

    def _initialize_weight(self):
        master = torch.empty(self.output_size, self.input_size, dtype=torch.float32, device="cpu")
        self.init_method(master)
        with torch.no_grad():
            self.weight.copy_(master.to(dtype=self.weight.dtype))

    def forward(self, input_):
        return self._matmul(input_, self.weight, self.bias), None

    def extra_repr(self):
        return f"in_features={self.input_size}, out_features={self.output_size}, bias={self.bias is not None}"
