"""`--dist-ckpt-strictness`: what to do with keys the checkpoint has but the model does not ask for
(unexpected) and keys the model asks for but the checkpoint lacks (missing).

A tensor whose saved shape differs from the model's is never a matter of strictness: it always fails.
"""

import enum
from typing import List, NamedTuple


class StrictHandling(enum.Enum):
    ASSUME_OK_UNEXPECTED = "assume_ok_unexpected"  # ignore unexpected keys; missing keys fail
    LOG_UNEXPECTED = "log_unexpected"  # print unexpected keys; missing keys fail
    LOG_ALL = "log_all"  # print both; missing tensors keep their current values
    RAISE_UNEXPECTED = "raise_unexpected"  # unexpected keys fail; missing keys fail
    RAISE_ALL = "raise_all"  # any mismatch fails
    RETURN_UNEXPECTED = "return_unexpected"  # report unexpected keys to the caller; missing keys fail
    RETURN_ALL = "return_all"  # report both to the caller; missing tensors keep their current values
    IGNORE_ALL = "ignore_all"  # ignore both; missing tensors keep their current values


STRICTNESS_CHOICES = [mode.value for mode in StrictHandling]


class KeyMismatch(NamedTuple):
    missing: List[str]
    unexpected: List[str]


class CheckpointKeyError(KeyError):
    def __str__(self):
        return self.args[0]


def _listing(keys, limit=8):
    shown = ", ".join(keys[:limit])
    return shown + (f", ... ({len(keys) - limit} more)" if len(keys) > limit else "")


def apply_strictness(mode, mismatch: KeyMismatch, checkpoint_dir: str, log=print, hint=None) -> KeyMismatch:
    """Raise or log as `mode` says; returns the mismatch for the load report.

    Missing keys that the mode tolerates are simply not loaded (the caller drops them from its targets). `hint`:
    what the caller knows makes the models differ (e.g. the flags that set the number of layers), put in the error.
    """
    mode = StrictHandling(mode)
    fail_missing = mode not in (StrictHandling.LOG_ALL, StrictHandling.RETURN_ALL, StrictHandling.IGNORE_ALL)
    fail_unexpected = mode in (StrictHandling.RAISE_UNEXPECTED, StrictHandling.RAISE_ALL)
    problems = []
    if mismatch.missing and fail_missing:
        problems.append(f"{len(mismatch.missing)} tensor(s) the model needs are not in the checkpoint: "
                        f"{_listing(mismatch.missing)}")
    if mismatch.unexpected and fail_unexpected:
        problems.append(f"{len(mismatch.unexpected)} tensor(s) in the checkpoint are not in the model: "
                        f"{_listing(mismatch.unexpected)}")
    if problems:
        cause = f"{hint}." if hint else "Is it from another model configuration?"
        raise CheckpointKeyError(
            f"checkpoint {checkpoint_dir} does not match the model ({'; '.join(problems)}). {cause} "
            "--dist-ckpt-strictness log_all loads what matches and lists the rest.")
    if mode in (StrictHandling.LOG_UNEXPECTED, StrictHandling.LOG_ALL) and mismatch.unexpected:
        log(f"checkpoint {checkpoint_dir}: not loaded, not in the model: {_listing(mismatch.unexpected, 50)}")
    if mode is StrictHandling.LOG_ALL and mismatch.missing:
        log(f"checkpoint {checkpoint_dir}: not in the checkpoint, left as initialised: {_listing(mismatch.missing, 50)}")
    return mismatch
