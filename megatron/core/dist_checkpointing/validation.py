"""Upstream's module for checkpoint-key strictness: `StrictHandling` and the parser of its flag value."""

from megatron.core.dist_checkpointing.strictness import STRICTNESS_CHOICES, StrictHandling

__all__ = ["StrictHandling", "parse_strict_flag"]


def parse_strict_flag(strict) -> StrictHandling:
    """`StrictHandling` from a member, its value (`--dist-ckpt-strictness`), or a bool (True: raise on any
    mismatch, False: ignore them)."""
    if isinstance(strict, StrictHandling):
        return strict
    if isinstance(strict, bool):
        return StrictHandling.RAISE_ALL if strict else StrictHandling.IGNORE_ALL
    if strict in STRICTNESS_CHOICES:
        return StrictHandling(strict)
    raise ValueError(f"--dist-ckpt-strictness must be one of {STRICTNESS_CHOICES}, got {strict!r}")
