"""Upstream's optimizer checkpoint calls for training loops of their own (as NeMo's):

    dist_checkpointing.save(optimizer.sharded_state_dict(model.sharded_state_dict()), directory)
    optimizer.load_state_dict(dist_checkpointing.load(
        optimizer.sharded_state_dict(model.sharded_state_dict(), is_loading=True), directory))

The dict is the logical optimizer state that pretrain_gpt's checkpoints hold (see
`megatron.core.dist_checkpointing.optimizer_state` and `fsdp_state`): fp32 main weights and moments keyed by the
logical name of their parameter, the step counter, the param groups' hyperparameters and the loss scaler. It is
the same whatever wraps the model (DDP with the plain, mixed-precision or distributed optimizer, Megatron-FSDP),
so a checkpoint loads at another data-parallel size or into another of these optimizers.

`sharded_state_dict(..., is_loading=True)` returns the tensors to load into and remembers how to install them;
`load_state_dict` recognises the filled dict by its keys and installs it. A torch-style `state_dict()` still
goes through the optimizer's own `load_state_dict`.
"""

import torch

from megatron.core.dist_checkpointing.first_step_state import first_step_state
from megatron.core.dist_checkpointing.logical_names import GRAD_SCALER_KEY, PARAM_GROUPS_KEY, STATE_PREFIX, STEP_KEY
from megatron.core.dist_checkpointing.logical_tensor import ShardedLogicalTensor
from megatron.core.optimizer.checkpointable_state import check_state_is_checkpointable, lazy_state_to_load

OBJECT_KEYS = (STEP_KEY, PARAM_GROUPS_KEY, GRAD_SCALER_KEY)


def is_logical_optimizer_state(state_dict) -> bool:
    """Whether `state_dict` is (a loaded) `sharded_state_dict()` rather than a torch-style `state_dict()`."""
    return isinstance(state_dict, dict) and any(key in OBJECT_KEYS or str(key).startswith(STATE_PREFIX)
                                                for key in state_dict)


def _initialize_state(torch_optimizer):
    """Create the moments a first step would (zeros), so that a fresh optimizer asks for them when loading."""
    from megatron_fsdp.optimizer_state import initialize_optimizer_state

    for optimizer in getattr(torch_optimizer, "chained_optimizers", [torch_optimizer]):
        initialize_optimizer_state(optimizer)


def _copy_into_targets(targets, loaded):
    """Copy loaded tensors into the targets they were not loaded into in place (a loader that returned copies)."""
    for key, value in loaded.items():
        target = targets.get(key)
        if not (torch.is_tensor(value) and isinstance(target, ShardedLogicalTensor) and len(target.pieces) == 1):
            continue
        piece = target.pieces[0][1]
        if piece.data_ptr() != value.data_ptr():
            with torch.no_grad():
                piece.copy_(value)


class ShardedStateDictMixin:
    """`sharded_state_dict` / logical `load_state_dict` for the Megatron optimizers (see the module docstring).

    The optimizer checkpoints the state of `model_chunks`: the chunks it was built for (set by
    `get_megatron_optimizer`), or those passed as `model_chunks=` to `sharded_state_dict`."""

    model_chunks = None
    _pending_logical_install = None  # (targets, install) of the last sharded_state_dict(is_loading=True)

    def _checkpointed_chunks(self, model_chunks):
        chunks = model_chunks if model_chunks is not None else self.model_chunks
        if chunks is None:
            raise ValueError(f"{type(self).__name__}.sharded_state_dict: the optimizer does not know its model "
                             "chunks; build it with get_megatron_optimizer(config, model_chunks) or pass "
                             "sharded_state_dict(..., model_chunks=[the DDP / Megatron-FSDP model chunks])")
        return [chunks] if isinstance(chunks, torch.nn.Module) else list(chunks)

    def sharded_state_dict(self, model_sharded_state_dict=None, is_loading=False, model_chunks=None, **kwargs):
        """The logical optimizer state of this rank for `dist_checkpointing.save` (collective), or with
        `is_loading=True` the targets `dist_checkpointing.load` fills for `load_state_dict`.

        `model_sharded_state_dict` and upstream's other keyword arguments (`sharding_type`, `metadata`) are
        accepted for upstream's signature: the logical names come from the model chunks themselves, and the
        layout is always the reshardable one."""
        from megatron.core.dist_checkpointing import wrappers

        chunks = self._checkpointed_chunks(model_chunks)
        if not is_loading:
            self._pending_logical_install = None
            check_state_is_checkpointable(self.optimizer)
            return wrappers.optimizer_state_to_save(self, chunks)
        _initialize_state(self.optimizer)
        # What this optimizer would save after a step (SGD's momentum buffers, other lazily created state
        # included), tied copies included (another stage saves their logical tensor).
        with lazy_state_to_load(self.optimizer), first_step_state(self.optimizer):
            check_state_is_checkpointable(self.optimizer)
            saved_keys = list(wrappers.optimizer_state_to_save(self, chunks, include_tied_copies=True))
            targets, install = wrappers.optimizer_load_targets(self, chunks, saved_keys)
        targets.update({key: None for key in OBJECT_KEYS})  # objects: the loader puts the saved values here
        self._pending_logical_install = (targets, install)
        return targets

    def load_state_dict(self, state_dict):
        """A torch-style `state_dict()`, or what `dist_checkpointing.load` returned for
        `sharded_state_dict(..., is_loading=True)`."""
        if not is_logical_optimizer_state(state_dict):
            return self.load_torch_state_dict(state_dict)
        if self._pending_logical_install is None:
            raise ValueError(f"{type(self).__name__}.load_state_dict: this is a sharded (logical) optimizer state; "
                             "load it into optimizer.sharded_state_dict(model_sharded_state_dict, is_loading=True) "
                             "with dist_checkpointing.load and pass what that returns")
        targets, install = self._pending_logical_install
        self._pending_logical_install = None
        _copy_into_targets(targets, state_dict)
        for key in [key for key in targets if key not in state_dict]:  # not in the checkpoint (lenient `strict`)
            del targets[key]
        install({**targets, **state_dict})
        return None

    def load_torch_state_dict(self, state_dict):
        """Load what `state_dict()` returned (each optimizer class defines it)."""
        raise NotImplementedError
