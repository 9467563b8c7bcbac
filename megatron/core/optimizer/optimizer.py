"""Optimizer wrappers: one step = gather grads into main grads, unscale, clip, step, write params back.

`MegatronOptimizer` owns that sequence; subclasses only say what the *main* parameters are and how gradients
and weights travel between them and the model:
- `FP32Optimizer`: the model parameters are the main parameters;
- `Float16Optimizer`: fp32 copies of bf16/fp16 model parameters (fp16 adds a loss scaler and skips steps
  whose gradients overflowed);
- `DistributedOptimizer` (distrib_optimizer.py): this rank's data-parallel shard only (stepped in place in the
  parameter buffer for fp32 parameters, fp32 copies of it for bf16/fp16 ones);
- `ChainedOptimizer`: several of the above stepped as one, with one global gradient norm and one fp16 skip decision.
Gradients are read from `param.main_grad` (the DDP buffer view) when the model is wrapped in DDP, else from
`param.grad`. Gradient norms and zero counts sum the dense parameters over `grad_stats_groups` and the
Mixture-of-Experts expert parameters over `expert_grad_stats_groups` (see `megatron.core.expert_parameters`).
Every optimizer checkpoints through upstream's `sharded_state_dict` / `load_state_dict` (sharded_state.py).
"""

import contextlib
import math

import torch
import torch.distributed as dist

from megatron.core.optimizer.clip_grads import (
    clip_grad_by_total_norm_fp32,
    count_zeros_fp32,
    default_grad_stats_groups,
    global_norms_fp32,
    tensors_counted_once,
)
from megatron.core.expert_parameters import split_expert_parameters
from megatron.core.optimizer.precision_aware_adam import optimizer_grad
from megatron.core.dist_checkpointing.param_groups import check_groups_match
from megatron.core.optimizer.sharded_state import ShardedStateDictMixin
from megatron.core.device_utils import get_current_device
from megatron.core.timers import timed

# Attributes that decide how a parameter is counted in the global grad norm; main copies inherit them.
PARALLEL_ATTRIBUTES = ("tensor_model_parallel", "partition_dim", "partition_stride", "shared_embedding",
                       "sequence_parallel", "allreduce")

_UNTIMED = contextlib.nullcontext()


def copy_parallel_attributes(source, destination):
    for name in PARALLEL_ATTRIBUTES:
        if hasattr(source, name):
            setattr(destination, name, getattr(source, name))


def model_grad(param):
    """The accumulated gradient of a model parameter: the DDP buffer view if there is one."""
    main_grad = getattr(param, "main_grad", None)
    return main_grad if main_grad is not None else param.grad


def fp32_grad(grad):
    """`grad` itself when it is already fp32 (the fp32 main-gradient buffers of the bf16 default: no per-step
    copy), otherwise an fp32 copy of it."""
    return grad if grad.dtype == torch.float32 else grad.float()


def reject_closure(optimizer, closure):
    """Megatron optimizers, as upstream's, step on gradients already accumulated: they take no torch closure."""
    if closure is not None:
        raise TypeError(
            f"{type(optimizer).__name__}.step() takes no closure (as upstream Megatron-LM's optimizers): run the "
            "forward and backward passes yourself (e.g. `loss = closure()`), then call optimizer.step(); it returns "
            "(update_successful, grad_norm, num_zeros_in_grad).")


class MegatronOptimizer(ShardedStateDictMixin):
    """Common step logic around a `torch.optim.Optimizer` that steps on `main_params()`.

    `found_inf_groups`: groups over which an fp16 overflow is agreed on (model-parallel and data-parallel),
    so that every rank skips the same steps. `grad_stats_groups`: groups over which gradient norms and zero
    counts are summed; `expert_grad_stats_groups`: the same for expert parameters (None when no rank has any).
    """

    def __init__(self, optimizer, config, grad_scaler=None, grad_stats_groups=None, found_inf_groups=None,
                 expert_grad_stats_groups=None):
        self.optimizer = optimizer
        self.config = config
        self.grad_scaler = grad_scaler
        self.grad_stats_groups = default_grad_stats_groups() if grad_stats_groups is None else grad_stats_groups
        self.found_inf_groups = self.grad_stats_groups if found_inf_groups is None else found_inf_groups
        self.expert_grad_stats_groups = expert_grad_stats_groups

    # ---- what subclasses define -------------------------------------------------------------------------
    # False where the model parameters are the main parameters: the step then has no copy-back phase.
    copies_main_params_to_model_params = True
    # Called with this optimizer after each inner step, before the main parameters are copied into the model, so
    # that what it changes in the main parameters reaches the model weights (QK-Clip: see qk_clip.py); or None.
    after_inner_step = None

    def main_params(self):
        return [param for group in self.optimizer.param_groups for param in group["params"]]

    def get_parameters(self):
        """The parameters the inner optimizer steps (upstream's name for `main_params()`)."""
        return self.main_params()

    def _copy_model_grads_to_main_grads(self):
        raise NotImplementedError

    def _copy_main_params_to_model_params(self):
        raise NotImplementedError

    def model_params(self):
        raise NotImplementedError

    def reload_model_params(self):
        """Refresh the main parameters from the model's (after loading weights without optimizer state)."""

    # ---- public API ----------------------------------------------------------------------------------------
    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @property
    def state(self):
        return self.optimizer.state

    def get_lr(self):
        """The learning rate of the first param group (of the first chained optimizer for a chain)."""
        return self.param_groups[0]["lr"]

    def get_loss_scale(self):
        if self.grad_scaler is None:
            return torch.tensor(1.0)
        return self.grad_scaler.scale

    def scale_loss(self, loss):
        return loss * self.get_loss_scale().to(loss.device)

    def zero_grad(self, set_to_none=True):
        """As upstream (and torch): drop the gradients, or with `set_to_none=False` zero them in place (a gradient
        that is a view of DDP's gradient buffer is zeroed there, which cannot detach it in place)."""
        for param in self.model_params() + self.main_params():
            for grad_attr in ("grad", "decoupled_grad"):
                grad = getattr(param, grad_attr, None)
                if grad is None:
                    continue
                if set_to_none:
                    setattr(param, grad_attr, None)
                    continue
                if grad.grad_fn is not None:
                    grad.detach_()
                else:
                    grad.requires_grad_(False)
                grad.zero_()

    def _dense_and_expert_stats(self, tensor_of):
        """`[(tensors counted once, groups to reduce over)]` for the dense and (if any) the expert main params."""
        dense, expert = split_expert_parameters(self.main_params())
        parts = [(tensors_counted_once(dense, tensor_of), self.grad_stats_groups)]
        if self.expert_grad_stats_groups is not None:
            parts.append((tensors_counted_once(expert, tensor_of), self.expert_grad_stats_groups))
        elif expert:
            raise RuntimeError("this optimizer steps expert parameters but was built without "
                               "expert_grad_stats_groups; build it with get_megatron_optimizer")
        return parts

    def global_norm(self, tensor_of):
        """The L2 norm of `tensor_of(main param)` over the whole model, each element counted once."""
        square = 0.0
        for norm in global_norms_fp32(self._dense_and_expert_stats(tensor_of), 2.0, self._device()):
            square += norm ** 2
        return math.sqrt(square)

    def get_grad_norm(self):
        return self.global_norm(optimizer_grad)

    def clip_grad_norm(self, clip_grad):
        grad_norm = self.get_grad_norm()
        if clip_grad > 0.0:
            clip_grad_by_total_norm_fp32([optimizer_grad(param) for param in self.main_params()], clip_grad, grad_norm)
        return grad_norm

    def count_zeros(self):
        return sum(count_zeros_fp32(grads, groups, self._device())
                   for grads, groups in self._dense_and_expert_stats(optimizer_grad))

    def _device(self):
        """Where statistics are reduced: the main parameters' device, or the process's compute device when they
        rest in host memory (parameter or optimizer CPU offload on an accelerator)."""
        params = self.main_params()
        if params and params[0].device.type != "cpu":
            return params[0].device
        return get_current_device()

    def _unscale_main_grads_and_check_for_nan(self):
        """Divide main grads by the loss scale; True on every rank if any rank saw inf/nan."""
        found_inf = torch.zeros(1, dtype=torch.float32, device=self._device())
        grads = [optimizer_grad(param) for param in self.main_params() if optimizer_grad(param) is not None]
        if grads:
            torch._amp_foreach_non_finite_check_and_unscale_(
                grads, found_inf, self.grad_scaler.inv_scale.to(found_inf.device)
            )
        for group in self.found_inf_groups:
            if group is not None and dist.get_world_size(group) > 1:
                dist.all_reduce(found_inf, op=dist.ReduceOp.MAX, group=group)
        return found_inf.item() > 0

    def _phase(self, name):
        """Times the step phase `name` at level 1 with `config.timers`; a shared no-op context without timers."""
        timers = self.config.timers
        if timers is None:
            return _UNTIMED
        return timed(timers, name, log_level=1, barrier=self.config.barrier_with_L1_time)

    def _copy_and_unscale_grads(self):
        """Main gradients from the model's, divided by the loss scale; True when some rank found inf/nan in them
        (the loss scale is not updated)."""
        with self._phase("optimizer-copy-to-main-grad"):
            self._copy_model_grads_to_main_grads()
        if self.grad_scaler is None:
            return False
        with self._phase("optimizer-unscale-and-check-inf"):
            return self._unscale_main_grads_and_check_for_nan()

    @torch.no_grad()
    def prepare_grads(self):
        """The first half of `step()` (upstream's name): main gradients copied from the model's and unscaled, the
        loss scale updated; True when the step must be skipped (fp16 overflow on some rank)."""
        found_inf = self._copy_and_unscale_grads()
        if self.grad_scaler is not None:
            self.grad_scaler.update(found_inf)
        return found_inf

    @torch.no_grad()
    def step_with_ready_grads(self):
        """The second half of `step()` (upstream's name): the inner optimizer's step on the prepared (and clipped)
        main gradients, then the main parameters copied into the model. Returns True."""
        with self._phase("optimizer-inner-step"):
            self.optimizer.step()
            if self.after_inner_step is not None:
                self.after_inner_step(self)
        if self.copies_main_params_to_model_params:
            with self._phase("optimizer-copy-main-to-model-params"):
                self._copy_main_params_to_model_params()
        return True

    @torch.no_grad()
    def step(self, closure=None):
        """Returns `(update_successful, grad_norm, num_zeros_in_grad)`; fp16 overflow skips the update.

        With `config.timers` each phase is timed at level 1 under upstream's names: optimizer-copy-to-main-grad,
        optimizer-unscale-and-check-inf (with a loss scaler), optimizer-clip-main-grad (the norm and the clip),
        optimizer-count-zeros (with `log_num_zeros_in_grad`), optimizer-inner-step and
        optimizer-copy-main-to-model-params (where main and model parameters differ)."""
        reject_closure(self, closure)
        if self.prepare_grads():
            return False, None, None
        with self._phase("optimizer-clip-main-grad"):
            grad_norm = self.clip_grad_norm(self.config.clip_grad)
        num_zeros = None
        if self.config.log_num_zeros_in_grad:
            with self._phase("optimizer-count-zeros"):
                num_zeros = self.count_zeros()
        return self.step_with_ready_grads(), grad_norm, num_zeros

    def state_dict(self):
        return {
            "optimizer": self.optimizer.state_dict(),
            "grad_scaler": None if self.grad_scaler is None else self.grad_scaler.state_dict(),
        }

    def load_torch_state_dict(self, state_dict):
        # torch's loading matches the state to the parameters by position: refuse groups laid out otherwise.
        check_groups_match(self.optimizer.param_groups, state_dict["optimizer"]["param_groups"])
        self.optimizer.load_state_dict(state_dict["optimizer"])
        if self.grad_scaler is not None and state_dict.get("grad_scaler") is not None:
            self.grad_scaler.load_state_dict(state_dict["grad_scaler"])


class FP32Optimizer(MegatronOptimizer):
    """The model's fp32 parameters are stepped directly; DDP main grads are handed over as `.grad`."""

    copies_main_params_to_model_params = False

    def model_params(self):
        return self.main_params()

    def _copy_model_grads_to_main_grads(self):
        for param in self.main_params():
            main_grad = getattr(param, "main_grad", None)
            if main_grad is not None:
                param.grad = main_grad if main_grad.dtype == param.dtype else main_grad.to(param.dtype)

    def _copy_main_params_to_model_params(self):
        pass


class Float16Optimizer(MegatronOptimizer):
    """bf16/fp16 model parameters get fp32 main copies; fp32 model parameters are stepped directly.

    Build it with the model's param groups; `optimizer_factory(groups)` receives the same groups with the
    half-precision parameters replaced by their fp32 main copies.
    """

    def __init__(self, param_groups, optimizer_factory, config, grad_scaler=None, grad_stats_groups=None,
                 found_inf_groups=None, expert_grad_stats_groups=None):
        self._model_and_main = []  # (model param, main param); the same object twice for fp32 params
        main_groups = []
        for group in param_groups:
            main_group_params = []
            for param in group["params"]:
                if param.dtype in (torch.float16, torch.bfloat16):
                    main_param = torch.nn.Parameter(param.detach().clone().float())
                    copy_parallel_attributes(param, main_param)
                else:
                    main_param = param
                self._model_and_main.append((param, main_param))
                main_group_params.append(main_param)
            main_groups.append({**group, "params": main_group_params})
        super().__init__(optimizer_factory(main_groups), config, grad_scaler, grad_stats_groups, found_inf_groups,
                         expert_grad_stats_groups)

    def model_params(self):
        return [model_param for model_param, _ in self._model_and_main]

    def _copy_model_grads_to_main_grads(self):
        for model_param, main_param in self._model_and_main:
            grad = model_grad(model_param)
            main_param.grad = None if grad is None else fp32_grad(grad)
            if model_param is not main_param:
                model_param.grad = None

    def _copy_main_params_to_model_params(self):
        for model_param, main_param in self._model_and_main:
            if model_param is not main_param:
                model_param.data.copy_(main_param.data)

    @torch.no_grad()
    def reload_model_params(self):
        for model_param, main_param in self._model_and_main:
            if model_param is not main_param:
                main_param.copy_(model_param)

    def state_dict(self):
        state = super().state_dict()
        state["fp32_main_params"] = [main_param.detach().clone() for _, main_param in self._model_and_main]
        return state

    def load_torch_state_dict(self, state_dict):
        super().load_torch_state_dict(state_dict)
        with torch.no_grad():
            for (_, main_param), saved in zip(self._model_and_main, state_dict["fp32_main_params"], strict=True):
                main_param.copy_(saved)
            self._copy_main_params_to_model_params()


CHAINED_KEY_PREFIX = "chained_{index}."  # upstream's prefix of each chained optimizer's checkpoint keys


class ChainedOptimizer(MegatronOptimizer):
    """Several Megatron optimizers stepped as one (upstream's name), e.g. one per model, or per set of parameters
    that needs settings of its own.

    `step()` prepares every optimizer's gradients (an fp16 overflow in any of them skips the step of all and
    backs off all their loss scales), takes the global gradient norm over all of them, clips each optimizer's
    gradients with its own `clip_grad` against that norm, then steps each; it returns `(update_successful,
    grad_norm, num_zeros_in_grad)` like a single optimizer (the zeros of the optimizers that log them).
    `param_groups` are the optimizers' own group dicts one after another, so a scheduler sets all of them.
    `state_dict()` is the list of theirs; `sharded_state_dict()` prefixes each optimizer's keys with
    `chained_<index>.` as upstream, so that optimizers over parameters of the same names do not collide.
    """

    def __init__(self, chained_optimizers):
        self.chained_optimizers = list(chained_optimizers)
        if not self.chained_optimizers:
            raise ValueError("ChainedOptimizer needs at least one optimizer to chain.")
        stepped_by = {}
        for index, optimizer in enumerate(self.chained_optimizers):
            if not isinstance(optimizer, MegatronOptimizer):
                raise TypeError(f"ChainedOptimizer chains Megatron optimizers (from get_megatron_optimizer); "
                                f"optimizer {index} is a {type(optimizer).__name__}.")
            for param in optimizer.main_params():
                if id(param) in stepped_by:
                    raise ValueError(f"ChainedOptimizer: optimizers {stepped_by[id(param)]} and {index} step the same "
                                     "parameter; build each over parameters of its own.")
                stepped_by[id(param)] = index
        scales = [None if optimizer.grad_scaler is None else optimizer.get_loss_scale().item()
                  for optimizer in self.chained_optimizers]
        if len(set(scales)) > 1:
            raise ValueError(f"ChainedOptimizer: the loss scales of the optimizers differ ({scales}, None: no loss "
                             "scaling); the loss is scaled once for all of them, so build them with the same --fp16 "
                             "and loss-scale settings.")
        self.optimizer = None
        self.config = self.chained_optimizers[0].config
        self.grad_scaler = self.chained_optimizers[0].grad_scaler

    @property
    def model_chunks(self):
        chunks = []
        for optimizer in self.chained_optimizers:
            for chunk in optimizer.model_chunks or []:
                if not any(chunk is known for known in chunks):
                    chunks.append(chunk)
        return chunks

    @property
    def param_groups(self):
        return [group for optimizer in self.chained_optimizers for group in optimizer.param_groups]

    @property
    def state(self):
        merged = {}
        for optimizer in self.chained_optimizers:
            merged.update(optimizer.state)
        return merged

    def main_params(self):
        return [param for optimizer in self.chained_optimizers for param in optimizer.main_params()]

    def model_params(self):
        return [param for optimizer in self.chained_optimizers for param in optimizer.model_params()]

    def get_loss_scale(self):
        return self.chained_optimizers[0].get_loss_scale()

    def zero_grad(self, set_to_none=True):
        for optimizer in self.chained_optimizers:
            optimizer.zero_grad(set_to_none)

    def reload_model_params(self):
        for optimizer in self.chained_optimizers:
            optimizer.reload_model_params()

    def get_grad_norm(self):
        return math.sqrt(sum(optimizer.get_grad_norm() ** 2 for optimizer in self.chained_optimizers))

    def global_norm(self, tensor_of):
        return math.sqrt(sum(optimizer.global_norm(tensor_of) ** 2 for optimizer in self.chained_optimizers))

    def clip_grad_norm(self, clip_grad=None):
        """The global gradient norm of all the optimizers; each one's gradients are clipped against it with
        `clip_grad`, or with its own `config.clip_grad` when None."""
        grad_norm = self.get_grad_norm()
        for optimizer in self.chained_optimizers:
            max_norm = optimizer.config.clip_grad if clip_grad is None else clip_grad
            if max_norm > 0.0:
                clip_grad_by_total_norm_fp32([optimizer_grad(param) for param in optimizer.main_params()], max_norm,
                                             grad_norm)
        return grad_norm

    def count_zeros(self):
        return sum(optimizer.count_zeros() for optimizer in self.chained_optimizers)

    @torch.no_grad()
    def prepare_grads(self):
        found_inf = False
        for optimizer in self.chained_optimizers:
            found_inf = optimizer._copy_and_unscale_grads() or found_inf
        # One decision for all: the loss scales stay equal, as the loss is scaled once.
        for optimizer in self.chained_optimizers:
            if optimizer.grad_scaler is not None:
                optimizer.grad_scaler.update(found_inf)
        return found_inf

    @torch.no_grad()
    def step_with_ready_grads(self):
        return all([optimizer.step_with_ready_grads() for optimizer in self.chained_optimizers])

    @torch.no_grad()
    def step(self, closure=None):
        reject_closure(self, closure)
        if self.prepare_grads():
            return False, None, None
        with self._phase("optimizer-clip-main-grad"):
            grad_norm = self.clip_grad_norm()
        logging = [optimizer for optimizer in self.chained_optimizers if optimizer.config.log_num_zeros_in_grad]
        num_zeros = None
        if logging:
            with self._phase("optimizer-count-zeros"):
                num_zeros = sum(optimizer.count_zeros() for optimizer in logging)
        return self.step_with_ready_grads(), grad_norm, num_zeros

    def state_dict(self):
        return [optimizer.state_dict() for optimizer in self.chained_optimizers]

    def sharded_state_dict(self, model_sharded_state_dict=None, is_loading=False, **kwargs):
        chained = {}
        for index, optimizer in enumerate(self.chained_optimizers):
            prefix = CHAINED_KEY_PREFIX.format(index=index)
            state = optimizer.sharded_state_dict(model_sharded_state_dict, is_loading=is_loading, **kwargs)
            chained.update({prefix + key: value for key, value in state.items()})
        return chained

    def load_state_dict(self, state_dict):
        """What `state_dict()` returned (a list, one entry per optimizer), or what `dist_checkpointing.load`
        returned for `sharded_state_dict(..., is_loading=True)`."""
        count = len(self.chained_optimizers)
        if isinstance(state_dict, (list, tuple)):
            if len(state_dict) != count:
                raise ValueError(f"ChainedOptimizer.load_state_dict: the state holds {len(state_dict)} optimizers, "
                                 f"this chain {count}.")
            for optimizer, state in zip(self.chained_optimizers, state_dict):
                optimizer.load_state_dict(state)
            return
        saved = {}
        for key, value in state_dict.items():
            index, dot, rest = str(key).removeprefix("chained_").partition(".")
            if not (str(key).startswith("chained_") and dot and index.isdigit()):
                raise ValueError(f"ChainedOptimizer.load_state_dict: '{key}' is not a key of a chained optimizer "
                                 "(chained_<index>.<key>); load what sharded_state_dict(..., is_loading=True) of "
                                 "this chain asked for.")
            saved.setdefault(int(index), {})[rest] = value
        if sorted(saved) != list(range(count)):
            raise ValueError(f"ChainedOptimizer.load_state_dict: the state holds optimizers {sorted(saved)}, this "
                             f"chain has {count}.")
        for index, optimizer in enumerate(self.chained_optimizers):
            optimizer.load_state_dict(saved[index])
