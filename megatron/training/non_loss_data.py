"""Evaluation outputs other than the loss: `pretrain(process_non_loss_data_func=..., non_loss_data_func=...)`.

After the loss batches of each evaluation (when it was not cut short), one more global batch runs through the
pipeline schedule with `collect_non_loss_data=True`: on the last stage each microbatch's
`loss_func(output_tensor, non_loss_data=True)` is kept as it is (no loss reduction), and the list of them is
handed, with the iteration and the TensorBoard writer, to `process_non_loss_data_func(collected, iteration,
writer)` on the last rank, as upstream. `non_loss_data_func(model)`, when given, produces the data instead of
that extra batch. As upstream, the hook is called only where there is a writer (--tensorboard-dir, on the last
rank; not with --skip-train, which writes nothing to TensorBoard). With --full-validation, which leaves no batch
to collect from, `process_non_loss_data_func` needs `non_loss_data_func`.
"""

import dataclasses
from typing import Callable, Optional

import torch.distributed as dist


@dataclasses.dataclass(frozen=True)
class NonLossDataHooks:
    """`pretrain()`'s two hooks for evaluation data other than the loss; both None: nothing is collected."""

    process_non_loss_data_func: Optional[Callable] = None
    """`(collected, iteration, writer)`, called on the last rank after each evaluation."""
    non_loss_data_func: Optional[Callable] = None
    """`(model chunks) -> data`, used instead of running a batch through the schedule to collect it."""

    def __post_init__(self):
        for name in ("process_non_loss_data_func", "non_loss_data_func"):
            value = getattr(self, name)
            if value is not None and not callable(value):
                raise TypeError(f"pretrain({name}=...) must be a function or None, got {type(value).__name__}")

    def check_fits(self, args):
        """Refuse hooks the run cannot serve: --full-validation evaluates each validation set to its last complete
        batch, so no batch is left for `process_non_loss_data_func` to collect (`non_loss_data_func` needs none)."""
        if (getattr(args, "full_validation", False) and self.process_non_loss_data_func is not None
                and self.non_loss_data_func is None):
            raise ValueError("pretrain(process_non_loss_data_func=...) cannot be used with --full-validation: each "
                             "evaluation reads the whole validation set, leaving no batch to collect the non-loss "
                             "data from; drop --full-validation, or also pass non_loss_data_func=(model) -> data "
                             "to produce the data without a batch")

    @property
    def collects(self):
        return self.process_non_loss_data_func is not None or self.non_loss_data_func is not None


NO_HOOKS = NonLossDataHooks()


def collect_non_loss_data(hooks, model, run_schedule):
    """The evaluation's non-loss data on this rank: `non_loss_data_func(model)`, else what `run_schedule(
    collect_non_loss_data=True)` returns (the last stage's per-microbatch outputs; [] on other stages), else None.
    Every rank calls this, so that the pipeline stages run the schedule together."""
    if hooks.non_loss_data_func is not None:
        return hooks.non_loss_data_func(model)
    if hooks.process_non_loss_data_func is not None:
        return run_schedule(collect_non_loss_data=True)
    return None


def process_non_loss_data(hooks, collected, iteration, writer):
    """Hand `collected` to `process_non_loss_data_func` on the last rank when it has a writer."""
    if hooks.process_non_loss_data_func is None or writer is None:
        return
    if dist.is_initialized() and dist.get_rank() != dist.get_world_size() - 1:
        return
    hooks.process_non_loss_data_func(collected, iteration, writer)
