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

fp16 moments are stored scaled, per parameter tensor (as TE's FusedAdam does): the state holds `stored` (fp16)
and `<key>_scale` (a 0-dim fp32 power of two) with moment = stored * scale. Each step picks the scale from the
new moment's largest magnitude so that the stored values reach up to 2^15 (fp16's largest finite value is
65504): the moments keep fp16's 11 significant bits however small the gradients are, where unscaled fp16 would
flush squared gradients of 1e-4 and below to zero (and keep first moments below 6e-5 to few bits). The scale
is a power of two, so scaling is exact: the value `get_unscaled_state` returns (stored * scale, in fp32) is
stored again unchanged by `set_scaled_state`, and checkpoints of values round-trip exactly.

Checkpoints keep the stored dtypes: `state_dict()` holds the moments as stored, with the scales of fp16 ones,
and `load_state_dict` takes them back as saved, in the configured dtypes (torch's loader would cast floating
state to the parameter's); an fp16 moment saved without a scale (by earlier versions, unscaled) loads with
scale 1. Logical (`dist_checkpointing`) checkpoints hold each fp16 moment's value in fp32
(`get_unscaled_state`), as upstream does with TE's scaled state; a loader that writes a moment's value into the
state in another dtype has it stored (scaled) again at the next step.
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
SCALE_KEYS = {key: f"{key}_scale" for key in MOMENT_KEYS}
# Stored fp16 moments reach up to 2^15 (half of fp16's range: headroom for rounding, none needed for growth as
# each step rescales); scales stay normal fp32 numbers that keep the smallest stored subnormal (2^-24) normal too.
FP16_STORED_MAX_EXPONENT = 15
MIN_SCALE_EXPONENT, MAX_SCALE_EXPONENT = -126 + 24, 127


def moment_scale(amax):
    """The power of two (0-dim fp32, on `amax`'s device) by which a moment of largest magnitude `amax` is
    divided for fp16 storage: the smallest with amax / scale <= 2^15. 1 for a zero or non-finite `amax`."""
    amax = amax.float()
    mantissa, exponent = torch.frexp(amax)  # amax = mantissa * 2^exponent, mantissa in [0.5, 1)
    exponent = exponent - (mantissa == 0.5).to(exponent.dtype) - FP16_STORED_MAX_EXPONENT  # ceil(log2 amax) - 15
    scale = torch.ldexp(torch.ones_like(amax), exponent.clamp(MIN_SCALE_EXPONENT, MAX_SCALE_EXPONENT))
    return torch.where(torch.isfinite(amax) & (amax > 0), scale, torch.ones_like(amax))


def unscaled_moment(state, key):
    """The value of moment `key` of `state`: stored * scale in fp32 for a scaled (fp16) moment, else the stored
    tensor itself (fp32 or bf16, which need no scale)."""
    scale = state.get(SCALE_KEYS.get(key))
    if scale is None:
        return state[key]
    return state[key].float().mul_(scale.to(state[key].device))


def store_moment(state, key, value, dtype):
    """Store the moment `value` in `state` as `dtype`: fp16 divided by the scale its largest magnitude gives
    (kept under `<key>_scale`), other dtypes as they are."""
    if dtype != torch.float16:
        state[key] = value.to(dtype)
        state.pop(SCALE_KEYS[key], None)
        return
    value = value.float()
    scale = moment_scale(value.abs().amax() if value.numel() else value.new_zeros(()))
    state[key] = (value / scale).to(torch.float16)
    state[SCALE_KEYS[key]] = scale


def restore_moments(state, saved, state_dtypes, device):
    """Put the moments of a saved state (`saved`, as `state_dict()` holds them) into `state` in `state_dtypes`,
    on `device`: a stored fp16 moment and its scale exactly (scale 1 when saved without one, unscaled), other
    saved forms by value."""
    for key, dtype in state_dtypes.items():
        if key not in saved:
            continue
        scale = saved.get(SCALE_KEYS[key])
        if dtype == torch.float16 and saved[key].dtype == torch.float16:
            state[key] = saved[key].to(device).clone()
            state[SCALE_KEYS[key]] = (torch.ones(()) if scale is None else scale).to(device, torch.float32).clone()
            continue
        value = saved[key].to(device).float()
        if scale is not None and saved[key].dtype == torch.float16:
            value = value * scale.to(device, torch.float32)
        store_moment(state, key, value, dtype)


def checked_stored_moments(state, state_dtypes, device):
    """Bring the moments of `state` into their stored form for a step on `device`: a moment a loader wrote in
    another dtype (its value) is stored again; an fp16 one without a scale (unscaled) gets scale 1."""
    for key, dtype in state_dtypes.items():
        scale_key = SCALE_KEYS[key]
        if key not in state:
            continue
        if state[key].dtype != dtype:
            state.pop(scale_key, None)  # belonged to the moment the loader replaced
            store_moment(state, key, state[key], dtype)
        elif dtype == torch.float16 and scale_key not in state:
            state[scale_key] = torch.ones((), device=device)
        if scale_key in state and (state[scale_key].device != device or state[scale_key].dtype != torch.float32):
            state[scale_key] = state[scale_key].to(device, torch.float32)


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
        if state_dtypes[key] == torch.float16:
            state[SCALE_KEYS[key]] = torch.ones((), device=state[key].device)
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


def _advanced_moment(key, stored, scale, grad32, beta1, beta2):
    """Moment `key` after Adam's update by the gradient, in fp32: the stored tensor itself when fp32 (updated in
    place), else a copy. A scaled moment is its stored values times `scale`; for the second moment the scale is
    folded into the decay (scale is a power of two, so stored * (scale * beta2) rounds as (stored * scale) * beta2
    does, one pass fewer)."""
    value = stored.float()
    if key == "exp_avg":
        if scale is not None:
            value = value.mul_(scale)
        return value.lerp_(grad32, 1 - beta1)
    decay = beta2 if scale is None else scale * beta2
    return value.mul_(decay).addcmul_(grad32, grad32, value=1 - beta2)


def _largest_magnitude(key, value):
    """max |value| of moment `key` without an |value| temporary: the second moment (a decayed sum of squares) is
    never negative."""
    if key == "exp_avg_sq":
        return value.amax()
    return torch.maximum(value.amax(), value.amin().neg())


def _new_moments_amax(blocks, scales, beta1, beta2):
    """({key: largest magnitude of the moment after this step} for the scaled moments, computed block by block
    with the step's own arithmetic (so a blocked step picks the scale a whole-tensor step would); {key: the last
    block's new moment}, which its update reuses instead of computing it again)."""
    amax, last_block = {}, {}
    for _, grad, exp_avg, exp_avg_sq in blocks:
        grad32 = grad.float()
        last_block = {}
        for key, stored in zip(MOMENT_KEYS, (exp_avg, exp_avg_sq)):
            if scales[key] is not None:
                last_block[key] = _advanced_moment(key, stored, scales[key], grad32, beta1, beta2)
                block_amax = _largest_magnitude(key, last_block[key])
                amax[key] = torch.maximum(amax[key], block_amax) if key in amax else block_amax
    return amax, last_block


def _adamw_update(param, grad, exp_avg, exp_avg_sq, lr, beta1, beta2, eps, weight_decay, bias_correction1,
                  bias_correction2_sqrt, scales, new_scales=None, advanced=None):
    """One AdamW update of the stored tensors, computed in fp32 and written back in their dtypes. `scales`: the
    scale of each moment stored scaled (None for the others); the new values are stored divided by `new_scales`
    (chosen here from their largest magnitude when None). `advanced`: new moments already computed (fp32, by
    key). Returns the new scales."""
    # fp32 working copies; `.float()` of an fp32 tensor is the tensor itself (updated in place).
    grad32, param32 = grad.float(), param.float()
    advanced = advanced or {}
    exp_avg32, exp_avg_sq32 = (
        advanced[key] if key in advanced else _advanced_moment(key, stored, scales[key], grad32, beta1, beta2)
        for key, stored in zip(MOMENT_KEYS, (exp_avg, exp_avg_sq)))
    if new_scales is None:
        new_scales = {key: None if scales[key] is None else moment_scale(_largest_magnitude(key, value))
                      for key, value in zip(MOMENT_KEYS, (exp_avg32, exp_avg_sq32))}
    param32.mul_(1 - lr * weight_decay)
    denom = (exp_avg_sq32.sqrt() / bias_correction2_sqrt).add_(eps)
    param32.addcdiv_(exp_avg32, denom, value=-lr / bias_correction1)
    for key, computed in zip(MOMENT_KEYS, (exp_avg32, exp_avg_sq32)):
        if new_scales[key] is not None:
            computed.div_(new_scales[key])  # a power of two: exact
    for stored, computed in ((param, param32), (exp_avg, exp_avg32), (exp_avg_sq, exp_avg_sq32)):
        if stored is not computed:
            stored.copy_(computed)
    return new_scales


class PrecisionAwareAdamW(torch.optim.Optimizer):
    """AdamW (decoupled weight decay) with moments stored as `exp_avg_dtype` / `exp_avg_sq_dtype` (fp16 ones
    scaled per tensor); parameters keep their own dtype (the main-params dtype). See the module docstring."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01,
                 exp_avg_dtype=torch.float32, exp_avg_sq_dtype=torch.float32):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.state_dtypes = {"exp_avg": exp_avg_dtype, "exp_avg_sq": exp_avg_sq_dtype}

    def _state_of(self, param):
        state = self.state[param]
        if not state:
            state.update(fresh_state(param, self.state_dtypes))
        # A loader that writes the state itself may have put a moment's value there in another dtype
        # (Megatron-FSDP's, `dist_checkpointing`'s); a state saved unscaled has no scales.
        checked_stored_moments(state, self.state_dtypes, param.device)
        return state

    def initialize_state(self):
        """Create every parameter's state as a first step would (step 0, zero moments) without stepping, so that
        a loader that fills the optimizer's existing state (Megatron-FSDP's checkpoints) finds it."""
        for group in self.param_groups:
            for param in group["params"]:
                self._state_of(param)

    def get_unscaled_state(self, param, state_name):
        """The value of `param`'s moment `state_name` (TE FusedAdam's name): fp32 for an fp16 moment, else the
        stored tensor. Checkpoints of the logical state hold it."""
        return unscaled_moment(self._state_of(param), state_name)

    def set_scaled_state(self, param, state_name, unscaled_state):
        """Store `unscaled_state` as `param`'s moment `state_name`, in its configured dtype (fp16 scaled)."""
        store_moment(self._state_of(param), state_name, unscaled_state.to(param.device),
                     self.state_dtypes[state_name])

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
                scales = {key: state.get(SCALE_KEYS[key]) for key in MOMENT_KEYS}
                blocks = list(_blocks(param, grad, state["exp_avg"], state["exp_avg_sq"]))
                new_scales, advanced = None, {}
                if len(blocks) > 1 and any(scale is not None for scale in scales.values()):
                    # The scale comes from the whole tensor's new values: one pass to find them first.
                    amax, advanced = _new_moments_amax(blocks, scales, beta1, beta2)
                    new_scales = {key: moment_scale(amax[key]) if key in amax else None for key in MOMENT_KEYS}
                    blocks = [blocks[-1]] + blocks[:-1]  # the last block first: its new moments are at hand
                for stored in blocks:
                    new_scales = _adamw_update(*stored, lr, beta1, beta2, eps, weight_decay, bias_correction1,
                                               bias_correction2_sqrt, scales, new_scales, advanced)
                    advanced = {}  # the first block's only
                for key, scale in (new_scales or {}).items():  # no blocks for an empty tensor
                    if scale is not None:
                        state[SCALE_KEYS[key]] = scale
        return loss

    def load_state_dict(self, state_dict):
        """torch's loader casts floating state to each parameter's dtype (bf16 moments of fp16 main parameters
        would lose their range, scales could underflow): take the moments and their scales from `state_dict`
        itself, in their configured dtypes."""
        super().load_state_dict(state_dict)
        params = [param for group in self.param_groups for param in group["params"]]
        for index, saved in state_dict["state"].items():
            param = params[index]
            restore_moments(self.state[param], saved, self.state_dtypes, param.device)
        self.cast_state_to_stored_dtypes()

    @torch.no_grad()
    def cast_state_to_stored_dtypes(self):
        """Put every moment back in its configured dtype (after a loader cast it, e.g. to the parameter's)."""
        for group in self.param_groups:
            for param in group["params"]:
                if self.state.get(param):
                    self._state_of(param)


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
