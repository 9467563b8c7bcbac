"""FP8 state in checkpoints: amax histories missing from a checkpoint, or saved at another history length.

Under delayed scaling each FP8 linear layer keeps its amax histories in buffers (`fp8_amax_history`,
`fp8_amax_recorded_count`), so checkpoints of FP8 runs carry them. A checkpoint of a run without FP8 (or with
another recipe) has none, and loading it into a delayed-scaling model is a normal thing to do (fine-tuning in
FP8): the histories then start empty, as in a fresh run (the first step scales by the current amax), and the
load says so instead of failing on the missing buffers. The other way round (a delayed-scaling checkpoint loaded
without FP8 or under tensorwise scaling) the saved histories are left unused, and the load says so too.

A checkpoint saved with another `--fp8-amax-history-len` holds `[3, saved length]` histories, newest amax first
(`megatron.core.fp8.scaling.reduce_and_record_amaxes` pushes each step's amax in at column 0). They load fitted to
this run's length (`fit_amax_history`): a longer history keeps every saved amax and is zero past them (no amax
recorded there, which neither `most_recent` nor `max` picks), a shorter one keeps the newest amaxes. The scales
that follow are the ones this run's length gives from the saved amaxes.
"""

import logging
from typing import List, Sequence, Tuple

import torch

logger = logging.getLogger(__name__)

AMAX_HISTORY_BUFFER = "fp8_amax_history"
FP8_HISTORY_BUFFERS = (AMAX_HISTORY_BUFFER, "fp8_amax_recorded_count")
_LENGTH_CHANGES_REPORTED = set()


def is_fp8_history_key(key: str) -> bool:
    """Whether a state-dict key (any prefix) names an FP8 amax-history buffer."""
    return key.rsplit(".", 1)[-1] in FP8_HISTORY_BUFFERS


def start_missing_fp8_histories_empty(module, state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs):
    """`load_state_dict` pre-hook of an FP8 linear layer: a state dict without its amax-history buffers (from a
    run without delayed FP8 scaling) loads, and the histories start empty."""
    # Only a state dict without any of them is from a run without the histories; one without just one of them
    # is left to the usual missing-key error.
    if any(prefix + name in state_dict for name in FP8_HISTORY_BUFFERS):
        return
    if not all(getattr(module, name, None) is not None for name in FP8_HISTORY_BUFFERS):
        return
    for name in FP8_HISTORY_BUFFERS:
        state_dict[prefix + name] = torch.zeros_like(getattr(module, name))
    module.fp8_histories_started_empty = True


def count_fp8_histories_started_empty(model_chunks: Sequence[torch.nn.Module]) -> int:
    """Layers whose amax histories the last load started empty (and forget it, so a later load counts anew)."""
    count = 0
    for chunk in model_chunks:
        for module in chunk.modules():
            if module.__dict__.pop("fp8_histories_started_empty", False):
                count += 1
    return count


def split_missing_fp8_histories(missing_keys: Sequence[str]) -> Tuple[List[str], List[str]]:
    """(other keys, FP8 history keys) of `missing_keys` or of a checkpoint's unexpected keys. Neither kind of
    history key is an error: missing histories start empty, and histories a run without delayed FP8 scaling has
    no buffers for are left unused (`unused_fp8_histories_report`)."""
    histories = [key for key in missing_keys if is_fp8_history_key(key)]
    return [key for key in missing_keys if not is_fp8_history_key(key)], histories


def fp8_histories_report(history_keys: Sequence[str]) -> str:
    """The load report's line for FP8 histories absent from the checkpoint."""
    layers = {key.rsplit(".", 1)[0] for key in history_keys}
    return (f"FP8 amax histories of {len(layers)} layer(s) (not in the checkpoint, e.g. from a run without "
            "delayed FP8 scaling): they start empty")


def unused_fp8_histories_report(history_keys: Sequence[str]) -> str:
    """The load report's line for FP8 histories in the checkpoint that this run has no use for."""
    layers = {key.rsplit(".", 1)[0] for key in history_keys}
    return (f"FP8 amax histories of {len(layers)} layer(s) (saved by a run with delayed FP8 scaling; this run "
            "keeps none): unused")


def is_amax_history_key(key: str) -> bool:
    """Whether a state-dict key (any prefix) names an FP8 amax-history buffer (`[3, history length]`)."""
    return key.rsplit(".", 1)[-1] == AMAX_HISTORY_BUFFER


def history_length_changed(saved_shape: Sequence[int], model_shape: Sequence[int]) -> bool:
    """Whether amax histories of `saved_shape` differ from the model's `model_shape` in their length (the last
    dim) alone, which `fit_amax_history` adapts."""
    saved_shape, model_shape = tuple(saved_shape), tuple(model_shape)
    return (len(saved_shape) == len(model_shape) >= 1 and saved_shape[:-1] == model_shape[:-1]
            and saved_shape[-1] != model_shape[-1] and min(saved_shape[-1], model_shape[-1]) >= 1)


@torch.no_grad()
def fit_amax_history(saved: torch.Tensor, length: int) -> torch.Tensor:
    """Amax histories `saved` (`[..., saved length]`, newest first) at history length `length`: the newest
    `length` amaxes, followed by zeros (nothing recorded) where the saved histories are shorter."""
    fitted = saved.new_zeros(*saved.shape[:-1], length)
    kept = min(length, saved.shape[-1])
    fitted[..., :kept] = saved[..., :kept]
    return fitted


def history_length_error(key: str, saved_shape: Sequence[int], model_shape: Sequence[int]) -> str:
    """The message for amax histories that cannot be loaded at this run's shape: names the flag and both lengths."""
    return (f"FP8 amax history '{key}' has shape {tuple(saved_shape)} in the checkpoint but {tuple(model_shape)} "
            f"in this model: saved with --fp8-amax-history-len {saved_shape[-1]}, this run uses "
            f"--fp8-amax-history-len {model_shape[-1]}; resume with --fp8-amax-history-len {saved_shape[-1]}")


def report_history_length_change(saved_length: int, model_length: int) -> None:
    """Say on rank 0 (once per pair of lengths) that amax histories were fitted to another length."""
    import torch.distributed as dist

    if (saved_length, model_length) in _LENGTH_CHANGES_REPORTED:
        return
    _LENGTH_CHANGES_REPORTED.add((saved_length, model_length))
    if dist.is_initialized() and dist.get_rank() != 0:
        return
    kept = ("every saved amax kept, zeros past them" if model_length > saved_length
            else f"the newest {model_length} amaxes kept")
    logger.warning("FP8 amax histories saved with --fp8-amax-history-len %d load into --fp8-amax-history-len %d: "
                   "%s", saved_length, model_length, kept)


def fit_loaded_amax_history(module, state_dict, prefix) -> None:
    """`load_state_dict` pre-hook part of an FP8 linear layer: amax histories saved at another history length are
    fitted to the layer's (`fit_amax_history`) before the state dict's shapes are checked."""
    key = prefix + AMAX_HISTORY_BUFFER
    saved, current = state_dict.get(key), getattr(module, AMAX_HISTORY_BUFFER, None)
    if not torch.is_tensor(saved) or current is None or not history_length_changed(saved.shape, current.shape):
        return
    state_dict[key] = fit_amax_history(saved, current.shape[-1])
    report_history_length_change(saved.shape[-1], current.shape[-1])
