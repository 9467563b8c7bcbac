"""The logical state of model chunks and their optimizer, whatever wraps them for data parallelism.

Megatron's DDP (with the plain, mixed-precision or distributed optimizer) holds whole tensor-parallel
partitions in the model and flat ranges of them in a distributed optimizer: `model_state` and
`optimizer_state` describe those. Megatron-FSDP and FSDP2 hold DTensors: `fsdp_state` turns them into the
same logical keys. Either way the result is `{logical key: ShardedLogicalTensor | object}`.
"""

import torch

from megatron.core.dist_checkpointing import fsdp_state, optimizer_state
from megatron.core.dist_checkpointing.first_step_state import first_step_state
from megatron.core.dist_checkpointing.model_state import model_sharded_state_dict

HALF_DTYPES = (torch.bfloat16, torch.float16)


def _is_fsdp(model_chunks):
    return any(fsdp_state.is_fsdp_chunk(chunk) for chunk in model_chunks)


def describe(model_chunks, args=None) -> str:
    """The wrapper and optimizer flavour, as recorded in a checkpoint's layout."""
    if args is not None:
        if getattr(args, "use_torch_fsdp2", False):
            return "torch_fsdp2"
        if getattr(args, "use_megatron_fsdp", False):
            strategy = getattr(args, "data_parallel_sharding_strategy", "optim_grads_params")
            return f"megatron_fsdp:{strategy}"
        return "ddp+distributed_optimizer" if getattr(args, "use_distributed_optimizer", False) else "ddp"
    return type(model_chunks[0]).__name__ if model_chunks else "none"


def model_state(model_chunks, for_saving):
    if _is_fsdp(model_chunks):
        return fsdp_state.model_state(model_chunks, for_saving)
    return model_sharded_state_dict(model_chunks, for_saving)


def model_load_targets(model_chunks, fp32_names=()):
    """(targets, finish): load into `targets`, then call `finish(set of logical names loaded)`. `fp32_names`: the
    weights the checkpoint holds in fp32, which Megatron-FSDP loads into its fp32 main weights unrounded."""
    if _is_fsdp(model_chunks):
        return fsdp_state.model_load_targets(model_chunks, fp32_names)
    return model_sharded_state_dict(model_chunks, for_saving=False), lambda loaded_names: None


def main_weight_targets(optimizer, model_chunks, fp32_names):
    """{logical name: the fp32 main weights' pieces} of the weights named in `fp32_names` (those a checkpoint
    holds in fp32, e.g. FSDP2's) whose model copy is bf16 / fp16 under Megatron's DDP (mixed-precision or
    distributed optimizer): loading the checkpoint's weights into these keeps the precision the model's copy
    rounds away. Megatron-FSDP's main weights load with its model (`model_load_targets`); FSDP2, and an fp32
    model, step their model weights themselves."""
    if not fp32_names or _is_fsdp(model_chunks) or not any(
            optimizer_state.is_optimizer_of_class(optimizer, name)
            for name in ("DistributedOptimizer", "Float16Optimizer")):
        return {}
    return {entry.placement.logical_name: entry.pieces_of(entry.main.data)
            for entry in optimizer_state.main_param_entries(optimizer, model_chunks)
            if entry.model_dtype in HALF_DTYPES and entry.main.dtype == torch.float32
            and entry.placement.logical_name in fp32_names}


def optimizer_state_to_save(optimizer, model_chunks, include_tied_copies=False):
    """`include_tied_copies`: also the state of a tied copy whose logical tensor another stage saves (a
    per-rank checkpoint, which must restore this rank alone, wants it)."""
    if _is_fsdp(model_chunks):
        return fsdp_state.optimizer_state_to_save(optimizer, model_chunks, include_tied_copies)
    entries = optimizer_state.main_param_entries(optimizer, model_chunks)
    return optimizer_state.optimizer_state_to_save(optimizer, entries, include_tied_copies)


def optimizer_load_targets(optimizer, model_chunks, saved_keys):
    """(targets, install): load into `targets` (objects included), then call `install(loaded)`, `loaded` holding
    the keys of the targets that were loaded (state the checkpoint lacks is not installed); `install` returns
    the indices of the param groups the checkpoint holds no group of the same identity for (see `param_groups`),
    which keep this run's hyperparameters."""
    if _is_fsdp(model_chunks):
        with first_step_state(optimizer):  # its targets come from the state the optimizer holds
            return fsdp_state.optimizer_load_targets(optimizer, model_chunks, saved_keys)
    entries = optimizer_state.main_param_entries(optimizer, model_chunks)
    targets, installs = optimizer_state.optimizer_load_targets(entries, saved_keys)

    def install(loaded):
        loaded_installs = [(entry, {key: tensor for key, tensor in moments.items()
                                    if optimizer_state.state_key(entry.placement.logical_name, key) in loaded})
                           for entry, moments in installs]
        unmatched = optimizer_state.install_optimizer_state(
            optimizer, loaded_installs, loaded.get(optimizer_state.STEP_KEY),
            loaded.get(optimizer_state.PARAM_GROUPS_KEY), loaded.get(optimizer_state.GRAD_SCALER_KEY))
        if optimizer_state.is_optimizer_of_class(optimizer, "DistributedOptimizer") and \
                optimizer.holds_fp8_parameters():
            # The model's FP8 bytes are quantized from the main weights: redo that from the loaded ones. (Other
            # weights were loaded whole on every rank, equal to the main weights in the model's dtype.)
            optimizer._copy_main_params_to_model_params()
            for chunk in optimizer.model_chunks:
                chunk.finish_param_sync()
        return unmatched

    return targets, install
