"""Logical state of Megatron-FSDP and FSDP2 model chunks (DTensor-based wrappers)."""

FSDP_CLASS_NAMES = {"FullyShardedDataParallel", "TorchFullyShardedDataParallel", "MegatronFSDP"}


def is_fsdp_chunk(chunk) -> bool:
    return type(chunk).__name__ in FSDP_CLASS_NAMES


def _not_yet(what):
    raise NotImplementedError(f"not implemented yet: {what} for Megatron-FSDP / FSDP2 checkpoints in torch_dist")


def model_state(model_chunks, for_saving):
    _not_yet("model state")


def optimizer_state_to_save(optimizer, model_chunks):
    _not_yet("optimizer state")


def optimizer_load_targets(optimizer, model_chunks, saved_keys):
    _not_yet("optimizer state")
