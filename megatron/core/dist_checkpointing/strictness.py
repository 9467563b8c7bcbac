"""`--dist-ckpt-strictness`: what to do when the keys a load asks for and the keys the checkpoint holds differ.

Upstream's names, which the modes use, are the checkpoint's view: an *unexpected* key is one the load asks for
that the checkpoint lacks; a *missing* key is one the checkpoint holds that no rank asks for. `KeyMismatch`
keeps them the way `load_state_dict` names them (its `missing`: asked for, not in the checkpoint; its
`unexpected`: in the checkpoint, asked for by no rank), so each mode reads as follows:

| mode | asked for, not in the checkpoint | in the checkpoint, asked for by no rank |
|---|---|---|
| assume_ok_unexpected (default) | fail | ignored |
| log_unexpected | logged, left as initialised | ignored |
| log_all | logged, left as initialised | logged |
| raise_unexpected | fail | ignored |
| raise_all | fail | fail |
| return_unexpected | returned, left as initialised | ignored |
| return_all | returned, left as initialised | returned |
| ignore_all | left as initialised | ignored |

A tensor whose saved shape differs from the model's is never a matter of strictness: it always fails.
"""

import enum
from typing import List, NamedTuple


class StrictHandling(enum.Enum):
    ASSUME_OK_UNEXPECTED = "assume_ok_unexpected"  # keys asked for but absent fail; unasked checkpoint keys ignored
    LOG_UNEXPECTED = "log_unexpected"  # keys asked for but absent are logged and skipped; unasked keys ignored
    LOG_ALL = "log_all"  # both logged; keys asked for but absent keep their current values
    RAISE_UNEXPECTED = "raise_unexpected"  # keys asked for but absent fail; unasked checkpoint keys ignored
    RAISE_ALL = "raise_all"  # any mismatch fails
    RETURN_UNEXPECTED = "return_unexpected"  # keys asked for but absent returned to the caller and skipped
    RETURN_ALL = "return_all"  # both returned to the caller; keys asked for but absent are skipped
    IGNORE_ALL = "ignore_all"  # both ignored; keys asked for but absent keep their current values

    @staticmethod
    def requires_explicit_ckpt_mismatch_check(mode: "StrictHandling") -> bool:
        """Whether `load` compares the keys at all (upstream's name; every mode but the default does)."""
        return mode != StrictHandling.ASSUME_OK_UNEXPECTED

    @staticmethod
    def requires_global_app_metadata(mode: "StrictHandling") -> bool:
        """Whether the mode looks at checkpoint keys no rank asks for (needs every rank's request)."""
        return mode in (StrictHandling.LOG_ALL, StrictHandling.RAISE_ALL, StrictHandling.RETURN_ALL)

    @staticmethod
    def requires_returning_mismatch_keys(mode: "StrictHandling") -> bool:
        """Whether `load` returns `(state dict, missing keys, unexpected keys)`."""
        return mode in (StrictHandling.RETURN_UNEXPECTED, StrictHandling.RETURN_ALL)


STRICTNESS_CHOICES = [mode.value for mode in StrictHandling]


class KeyMismatch(NamedTuple):
    missing: List[str]  # asked for by the load, not in the checkpoint (upstream's "unexpected" keys)
    unexpected: List[str]  # in the checkpoint, asked for by no rank (upstream's "missing" keys)


class CheckpointKeyError(KeyError):
    def __str__(self):
        return self.args[0]


def _listing(keys, limit=8):
    shown = ", ".join(keys[:limit])
    return shown + (f", ... ({len(keys) - limit} more)" if len(keys) > limit else "")


_SKIP_ABSENT = (StrictHandling.LOG_UNEXPECTED, StrictHandling.LOG_ALL, StrictHandling.RETURN_UNEXPECTED,
                StrictHandling.RETURN_ALL, StrictHandling.IGNORE_ALL)


def apply_strictness(mode, mismatch: KeyMismatch, checkpoint_dir: str, log=print, hint=None) -> KeyMismatch:
    """Raise or log as `mode` says (see the module docstring); returns the mismatch for the load report.

    Missing keys that the mode tolerates are simply not loaded (the caller drops them from its targets). `hint`:
    what the caller knows makes the models differ (e.g. the flags that set the number of layers), put in the error.
    """
    mode = StrictHandling(mode)
    fail_missing = mode not in _SKIP_ABSENT
    fail_unexpected = mode is StrictHandling.RAISE_ALL
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
    if mode is StrictHandling.LOG_ALL and mismatch.unexpected:
        log(f"checkpoint {checkpoint_dir}: not loaded, not in the model: {_listing(mismatch.unexpected, 50)}")
    if mode in (StrictHandling.LOG_UNEXPECTED, StrictHandling.LOG_ALL) and mismatch.missing:
        log(f"checkpoint {checkpoint_dir}: not in the checkpoint, left as initialised: "
            f"{_listing(mismatch.missing, 50)}")
    return mismatch
