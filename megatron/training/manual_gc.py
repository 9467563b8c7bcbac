"""`--manual-gc`: Python's cyclic garbage collector runs at chosen iterations instead of whenever it likes.

An automatic collection can take a noticeable time on a large model's object graph, and it strikes each rank at
a different moment: the other ranks then wait for the slow one at the next collective. With `--manual-gc` the
automatic collector is off during training and every rank collects at the same iterations: at the start, every
`--manual-gc-interval` iterations (0: never in between), before and after each evaluation (unless
`--no-manual-gc-eval`), and at the end, where the collector is switched back on.
"""

import gc


class ManualGarbageCollection:
    """Context manager around the training loop; inert unless `enabled`."""

    def __init__(self, enabled: bool, interval: int = 0, around_evaluation: bool = True):
        if interval < 0:
            raise ValueError(f"--manual-gc-interval must be >= 0, got {interval}")
        self.enabled = enabled
        self.interval = interval
        self.around_evaluation = around_evaluation
        self.collections = 0
        self._was_enabled = None

    @classmethod
    def from_args(cls, args):
        return cls(getattr(args, "manual_gc", False), getattr(args, "manual_gc_interval", 0),
                   getattr(args, "manual_gc_eval", True))

    def _collect(self):
        gc.collect()
        self.collections += 1

    def __enter__(self):
        if self.enabled:
            self._was_enabled = gc.isenabled()
            gc.disable()
            self._collect()
        return self

    def __exit__(self, *exc_info):
        if self.enabled:
            self._collect()
            if self._was_enabled:
                gc.enable()
        return False

    def after_iteration(self, iteration: int):
        if self.enabled and self.interval and iteration % self.interval == 0:
            self._collect()

    def around_evaluation_step(self):
        """Call before and after an evaluation."""
        if self.enabled and self.around_evaluation:
            self._collect()
