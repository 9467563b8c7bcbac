"""Which dtypes the sharded training state uses: main weights, main gradients and gradient communication."""

import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """Dtypes of the optimizer-facing state; compute always runs in the model's own parameter dtype.

    main_params_dtype: dtype of the sharded main weights the optimizer updates (fp32 by default). None: the
        compute weights act as the main weights (no separate copy; the optimizer steps in the model's dtype).
    main_grads_dtype: dtype in which gradients are accumulated across microbatches and handed to the optimizer.
        None: fp32 when the main weights are fp32 (a bf16 model then reduces and accumulates its gradients in
        fp32, as its fp32 main weights deserve), else the model parameter's dtype.
    grad_comm_dtype: dtype in which gradients are reduced; None means the main grads dtype.
    """

    main_params_dtype: torch.dtype = torch.float32
    main_grads_dtype: Optional[torch.dtype] = None
    grad_comm_dtype: Optional[torch.dtype] = None

    def __post_init__(self):
        for flag in ("main_params_dtype", "main_grads_dtype", "grad_comm_dtype"):
            value = getattr(self, flag)
            if value is None:
                continue
            if value not in _FLOAT_DTYPES:
                raise ValueError(
                    f"MixedPrecisionPolicy.{flag}={value} is not supported; use one of "
                    f"{[str(d) for d in _FLOAT_DTYPES]} or None"
                )

    def with_grad_reduce_in_fp32(self, grad_reduce_in_fp32: bool) -> "MixedPrecisionPolicy":
        """This policy with DistributedDataParallelConfig.grad_reduce_in_fp32 applied: fp32 reduction (and, unless
        main_grads_dtype says otherwise, fp32 accumulation)."""
        if not grad_reduce_in_fp32:
            return self
        if self.grad_comm_dtype not in (None, torch.float32):
            raise ValueError(f"grad_reduce_in_fp32=True contradicts MixedPrecisionPolicy.grad_comm_dtype="
                             f"{self.grad_comm_dtype}; set one of them")
        return dataclasses.replace(self, main_grads_dtype=self.main_grads_dtype or torch.float32,
                                   grad_comm_dtype=torch.float32)

    def main_dtype_for(self, param_dtype: torch.dtype) -> torch.dtype:
        return self.main_params_dtype or param_dtype

    def grads_dtype_for(self, param_dtype: torch.dtype) -> torch.dtype:
        if self.main_grads_dtype is not None:
            return self.main_grads_dtype
        return torch.float32 if self.main_params_dtype == torch.float32 else param_dtype

    def comm_dtype_for(self, param_dtype: torch.dtype) -> torch.dtype:
        return self.grad_comm_dtype or self.grads_dtype_for(param_dtype)
