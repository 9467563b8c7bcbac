"""The precision-aware optimizer (`--use-precision-aware-optimizer`): AdamW whose main parameters and moments are
stored in chosen dtypes (`--main-params-dtype`, `--exp-avg-dtype`, `--exp-avg-sq-dtype`) and whose gradients
may arrive in another dtype (`--main-grads-dtype`), without fp32 copies kept between steps.

`PrecisionAwareAdamW` is the torch implementation: each step reads a parameter's stored values, computes the
AdamW update in fp32 (torch's single-tensor AdamW arithmetic, so with every dtype fp32 it steps exactly like
`torch.optim.AdamW(foreach=False)`), and writes the results back in their storage dtypes. Gradients are read
from `param.decoupled_grad` when set (the distributed optimizer hands over its gradient-buffer views there, in
their own dtype, since `.grad` must match the parameter's dtype), else from `param.grad`.

Transformer Engine's `FusedAdam` does the same in one fused kernel on CUDA; `build_precision_aware_adam` uses
it where TE is installed (`HAVE_TE_FUSED_ADAM`) and the parameters are on a CUDA device.

Checkpoints keep the stored dtypes: `state_dict()` holds the moments as stored, and `load_state_dict` takes
them back as saved, in the configured dtypes (torch's loader would cast floating state to the parameter's).
"""

import torch

try:  # TE raises RuntimeError, not ImportError, where its CUDA libraries are missing.
    from transformer_engine.pytorch.optimizers import FusedAdam as TEFusedAdam

    HAVE_TE_FUSED_ADAM = True
except Exception:  # noqa: BLE001
    TEFusedAdam = None
    HAVE_TE_FUSED_ADAM = False

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
MOMENT_KEYS = ("exp_avg", "exp_avg_sq")
# Squared gradients of LM training (often below 1e-8, times 1 - beta2) are under fp16's smallest subnormal
# (6e-8): stored unscaled they flush to zero and the update divides by eps. TE's FusedAdam keeps fp16 state with
# a per-tensor scale; this implementation stores moments unscaled, so it refuses fp16 for the second moment.
FP16_SECOND_MOMENT_MESSAGE = (
    "--exp-avg-sq-dtype fp16: the second moment (squared gradients) underflows in fp16 unless it is stored with "
    "a per-tensor scale, which only Transformer Engine's FusedAdam does (on CUDA, without --optimizer-cpu-offload); "
    "use --exp-avg-sq-dtype bf16 (same bytes, fp32's range)")


def optimizer_grad(param):
    """The gradient an optimizer steps `param` with: `param.decoupled_grad` when set, else `param.grad`."""
    decoupled = getattr(param, "decoupled_grad", None)
    return decoupled if decoupled is not None else param.grad


def fresh_state(param, state_dtypes, empty_like=None):
    """The state a first step creates for `param`: step 0 and zero moments in `state_dtypes` (moment key ->
    dtype); `empty_like(param, dtype)` allocates them (default: next to `param`)."""
    if empty_like is None:
        def empty_like(tensor, dtype):
            return torch.empty_like(tensor, dtype=dtype, memory_format=torch.preserve_format)
    state = {"step": torch.tensor(0.0)}
    for key in MOMENT_KEYS:
        state[key] = empty_like(param, state_dtypes[key]).zero_()
    return state


# Host (CPU) steps run block by block: each elementwise pass then reads the block from cache instead of memory,
# about a third of the memory traffic of whole-tensor passes (which dominate an offloaded step), and the
# temporaries are one block's. The arithmetic per element is the same. Device steps take each tensor whole (one
# kernel per pass).
HOST_BLOCK_NUMEL = 1 << 20


def _blocks(param, grad, exp_avg, exp_avg_sq):
    """(param, grad, exp_avg, exp_avg_sq) views of consecutive blocks of `HOST_BLOCK_NUMEL` elements for contiguous
    host tensors, else the tensors themselves once."""
    tensors = (param, grad, exp_avg, exp_avg_sq)
    if param.device.type != "cpu" or not all(tensor.is_contiguous() for tensor in tensors):
        yield tensors
        return
    flat = [tensor.view(-1) for tensor in tensors]
    for start in range(0, param.numel(), HOST_BLOCK_NUMEL):
        yield tuple(tensor[start:start + HOST_BLOCK_NUMEL] for tensor in flat)


def _adamw_update(param, grad, exp_avg, exp_avg_sq, lr, beta1, beta2, eps, weight_decay, bias_correction1,
                  bias_correction2_sqrt):
    """One AdamW update of the stored tensors, computed in fp32 and written back in their dtypes."""
    # fp32 working copies; `.float()` of an fp32 tensor is the tensor itself (updated in place).
    grad32, param32 = grad.float(), param.float()
    exp_avg32, exp_avg_sq32 = exp_avg.float(), exp_avg_sq.float()
    param32.mul_(1 - lr * weight_decay)
    exp_avg32.lerp_(grad32, 1 - beta1)
    exp_avg_sq32.mul_(beta2).addcmul_(grad32, grad32, value=1 - beta2)
    denom = (exp_avg_sq32.sqrt() / bias_correction2_sqrt).add_(eps)
    param32.addcdiv_(exp_avg32, denom, value=-lr / bias_correction1)
    for stored, computed in ((param, param32), (exp_avg, exp_avg32), (exp_avg_sq, exp_avg_sq32)):
        if stored is not computed:
            stored.copy_(computed)


class PrecisionAwareAdamW(torch.optim.Optimizer):
    """AdamW (decoupled weight decay) with moments stored as `exp_avg_dtype` / `exp_avg_sq_dtype`; parameters
    keep their own dtype (the main-params dtype). See the module docstring."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01,
                 exp_avg_dtype=torch.float32, exp_avg_sq_dtype=torch.float32):
        if exp_avg_sq_dtype == torch.float16:
            raise ValueError(FP16_SECOND_MOMENT_MESSAGE)
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.state_dtypes = {"exp_avg": exp_avg_dtype, "exp_avg_sq": exp_avg_sq_dtype}

    def _state_of(self, param):
        state = self.state[param]
        if not state:
            state.update(fresh_state(param, self.state_dtypes))
        for key in MOMENT_KEYS:
            # A loader that writes the state itself may have cast it (Megatron-FSDP's, to the main weights' dtype).
            if state[key].dtype != self.state_dtypes[key]:
                state[key] = state[key].to(self.state_dtypes[key])
        return state

    def initialize_state(self):
        """Create every parameter's state as a first step would (step 0, zero moments) without stepping, so that
        a loader that fills the optimizer's existing state (Megatron-FSDP's checkpoints) finds it."""
        for group in self.param_groups:
            for param in group["params"]:
                self._state_of(param)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            lr, eps, weight_decay = group["lr"], group["eps"], group["weight_decay"]
            for param in group["params"]:
                grad = optimizer_grad(param)
                if grad is None:
                    continue
                state = self._state_of(param)
                state["step"] += 1
                step = state["step"].item()
                bias_correction1 = 1 - beta1**step
                bias_correction2_sqrt = (1 - beta2**step) ** 0.5
                for stored in _blocks(param, grad, state["exp_avg"], state["exp_avg_sq"]):
                    _adamw_update(*stored, lr, beta1, beta2, eps, weight_decay, bias_correction1,
                                  bias_correction2_sqrt)
        return loss

    def load_state_dict(self, state_dict):
        """torch's loader casts floating state to each parameter's dtype (bf16 moments of fp16 main parameters
        would lose their range): take the moments from `state_dict` itself, in their configured dtypes."""
        super().load_state_dict(state_dict)
        params = [param for group in self.param_groups for param in group["params"]]
        for index, saved in state_dict["state"].items():
            param = params[index]
            for key in MOMENT_KEYS:
                if key in saved:
                    self.state[param][key] = saved[key].to(param.device, self.state_dtypes[key]).clone()
        self.cast_state_to_stored_dtypes()

    @torch.no_grad()
    def cast_state_to_stored_dtypes(self):
        """Put every moment back in its configured dtype (after a loader cast it, e.g. to the parameter's)."""
        for state in self.state.values():
            for key in MOMENT_KEYS:
                if key in state and state[key].dtype != self.state_dtypes[key]:
                    state[key] = state[key].to(self.state_dtypes[key])


def build_precision_aware_adam(param_groups, config, device):
    """The precision-aware Adam for `config` (an `OptimizerConfig` with `use_precision_aware_optimizer`): TE's
    FusedAdam on CUDA where installed, else `PrecisionAwareAdamW`."""
    kwargs = dict(lr=config.lr, betas=(config.adam_beta1, config.adam_beta2), eps=config.adam_eps,
                  weight_decay=config.weight_decay)
    if HAVE_TE_FUSED_ADAM and device.type == "cuda":
        return TEFusedAdam(param_groups, adam_w_mode=True, exp_avg_dtype=config.exp_avg_dtype,
                           exp_avg_sq_dtype=config.exp_avg_sq_dtype, use_decoupled_grad=True, **kwargs)
    return PrecisionAwareAdamW(param_groups, exp_avg_dtype=config.exp_avg_dtype,
                               exp_avg_sq_dtype=config.exp_avg_sq_dtype, **kwargs)
