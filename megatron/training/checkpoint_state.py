"""What a training run's logical checkpoint holds: this module builds the state to save and the targets to load
into; `dist_checkpoint` writes and reads them (it imports this module, never the other way round).

Model and optimizer tensors come from `megatron.core.dist_checkpointing` (the part that depends on the data
parallel wrapper lives there); this module adds the run's state around them: scheduler, per-rank RNG states,
iteration, consumed samples, the arguments and the layout that wrote the checkpoint.
"""

import torch.distributed as dist

from megatron.core.dist_checkpointing import rng_mapping, serialization, vocab_padding, wrappers
from megatron.training import modelopt_checkpoint
from megatron.training.checkpoint_args import padding_origin, true_vocab_size
from megatron.training.random_state import rng_state

CHECKPOINT_VERSION = 1
RNG_PREFIX = "rng_state."
RNG_COORDINATES_KEY = "rng_coordinates"  # in `common`: {global rank: (tensor, pipeline, data, expert) ranks}
VOCAB_SIZE_KEY = "vocab_size"  # in `common`: the tokenizer's vocabulary size, before padding


def _rank():
    return dist.get_rank() if dist.is_initialized() else 0


def layout_of(args, model_chunks):
    """The parallel layout a checkpoint records: TP, PP and DP sizes (CP and EP where they split the model),
    the world size, the wrapper and the format."""
    from megatron.core import parallel_state

    layout = {
        "tensor_model_parallel_size": parallel_state.get_tensor_model_parallel_world_size(),
        "pipeline_model_parallel_size": parallel_state.get_pipeline_model_parallel_world_size(),
        "data_parallel_size": parallel_state.get_data_parallel_world_size(),
    }
    context_parallel_size = parallel_state.get_context_parallel_world_size()
    if context_parallel_size > 1:  # no key at 1: layouts written before the key existed held DP x CP under DP
        layout["context_parallel_size"] = context_parallel_size
    if getattr(args, "num_experts", None):  # a MoE model: how its experts were split (a load may reshard them)
        layout["expert_model_parallel_size"] = parallel_state.get_expert_model_parallel_world_size()
    layout.update({
        "world_size": dist.get_world_size() if dist.is_initialized() else 1,
        "wrapper": wrappers.describe(model_chunks, args),
        "ckpt_format": args.ckpt_format,
    })
    return layout


def data_times_context_parallel(layout):
    """DP x CP of a recorded layout (None where it records no DP size); a layout without a CP size is CP 1 or was
    written when DP x CP was recorded as the DP size."""
    data_parallel_size = layout.get("data_parallel_size")
    if data_parallel_size is None:
        return None
    return data_parallel_size * layout.get("context_parallel_size", 1)


def state_to_save(iteration, model_chunks, optimizer, scheduler, args):
    """(flat state dict of this rank, layout); collective (the optimizer agrees on its step counter)."""
    modelopt_state = modelopt_checkpoint.modelopt_state_to_save(model_chunks)  # before the model's tensors
    state = {f"model.{name}": value for name, value in wrappers.model_state(model_chunks, for_saving=True).items()}
    state.update(modelopt_state)
    if optimizer is not None and not args.no_save_optim:
        state.update(wrappers.optimizer_state_to_save(optimizer, model_chunks))
        if scheduler is not None:
            state["scheduler"] = scheduler.state_dict()
    coordinates = None
    if not args.no_save_rng:
        state[f"{RNG_PREFIX}{_rank()}"] = rng_state()
        coordinates = _all_rank_coordinates()
    layout = layout_of(args, model_chunks)
    if _rank() == 0:
        state["common"] = {
            "checkpoint_version": CHECKPOINT_VERSION,
            "iteration": iteration,
            "consumed_train_samples": getattr(args, "consumed_train_samples", 0),
            "skipped_train_samples": getattr(args, "skipped_train_samples", 0),
            "args": args,
            "layout": layout,
            VOCAB_SIZE_KEY: true_vocab_size(args),
        }
        if coordinates is not None:
            state["common"][RNG_COORDINATES_KEY] = coordinates
    return state, layout


def rank_coordinates():
    from megatron.core import parallel_state

    return rng_mapping.RankCoordinates(
        tensor=parallel_state.get_tensor_model_parallel_rank(),
        pipeline=parallel_state.get_pipeline_model_parallel_rank(),
        data=parallel_state.get_data_parallel_rank(with_context_parallel=True),
        expert=parallel_state.get_expert_model_parallel_rank())


def all_gather_objects(value):
    """[value of every rank] (collective; [value] without a process group)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [value]
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    return gathered


def _all_rank_coordinates():
    """{global rank: its (tensor, pipeline, data, expert) coordinates as a tuple} (collective)."""
    return {rank: tuple(coordinates) for rank, coordinates in enumerate(all_gather_objects(rank_coordinates()))}


def model_targets(model_chunks, fp32_names=()):
    """({`model.<name>`: target}, finish(loaded keys)) for loading the model chunks (`fp32_names`: see
    `wrappers.model_load_targets`)."""
    targets, finish = wrappers.model_load_targets(model_chunks, fp32_names)
    prefixed = {f"model.{name}": value for name, value in targets.items()}
    return prefixed, lambda loaded_keys: finish({key[len("model."):] for key in loaded_keys})


def refresh_main_params(optimizer):
    """Main (fp32) parameter copies follow the model weights just loaded."""
    if hasattr(optimizer, "reload_model_params"):
        optimizer.reload_model_params()


def adapt_vocab_padding(targets, metadata, args, report):
    """Load the word embedding and output layer (and their optimizer state) across another vocabulary padding
    (see megatron.core.dist_checkpointing.vocab_padding); the report says how the rows changed. Collective."""
    changes = vocab_padding.adapt_targets(targets, serialization.tensor_shapes(metadata), true_vocab_size(args))
    everywhere = [change for rank_changes in all_gather_objects(changes) for change in rank_changes]  # collective
    if everywhere:  # a rank holds only some of these tensors (pipeline stages, optimizer shards)
        report.add_vocab_padding(everywhere, true_vocab_size(args), args)


class LoadReport:
    """What a load restored and what it did not, printed by rank 0 as Megatron does."""

    def __init__(self, directory, common):
        self.directory = directory
        self.layout = common.get("layout", {})
        self.saved_args = common.get("args")
        self.loaded, self.not_loaded, self.notes = [], [], []
        self._vocab_tensors, self._vocab_context = {}, None  # (saved rows, model rows) -> {name: optimizer too}

    def add_vocab_padding(self, changes, vocab_size, args):
        """Vocab tensors loaded across another padding (model and optimizer keys of one tensor count once)."""
        for change in changes:
            names = self._vocab_tensors.setdefault((change.saved_rows, change.model_rows), {})
            with_optimizer = change.key.startswith(vocab_padding.OPTIMIZER_STATE_PREFIX)
            names[change.name] = names.get(change.name, False) or with_optimizer
        self._vocab_context = (vocab_size, args.make_vocab_size_divisible_by, args.tensor_model_parallel_size)

    def _vocab_padding_notes(self):
        if not self._vocab_tensors:
            return []
        vocab_size, divisor, tp = self._vocab_context
        saved_divisor = getattr(self.saved_args, "make_vocab_size_divisible_by", "?")
        saved_tp = self.layout.get("tensor_model_parallel_size", "?")
        notes = []
        for (saved_rows, model_rows), names in self._vocab_tensors.items():
            loaded = min(saved_rows, model_rows)
            rest = (f"rows {loaded}-{model_rows - 1} keep this model's values (optimizer moments zero)"
                    if model_rows > saved_rows else f"the checkpoint's rows {loaded}-{saved_rows - 1} are not read")
            tensors = ", ".join(name + (" (and its optimizer state)" if optimizer else "")
                                for name, optimizer in names.items())
            this_run = padding_origin(model_rows, vocab_size, divisor, tp).replace(
                "--make-vocab-size-divisible-by ", "")
            notes.append(f"vocabulary padding changed: {tensors}: {saved_rows} rows in the checkpoint "
                         f"({padding_origin(saved_rows, vocab_size, saved_divisor, saved_tp)}) and {model_rows} in "
                         f"this run ({this_run}), true vocabulary size {vocab_size}: rows 0-{loaded - 1} loaded, "
                         f"{rest}")
        return notes

    def add_mismatch(self, what, mismatch):
        if mismatch.missing:
            self.not_loaded.append(f"{len(mismatch.missing)} {what} tensor(s) missing from the checkpoint")
        if mismatch.unexpected:
            self.not_loaded.append(f"{len(mismatch.unexpected)} checkpoint {what} tensor(s) the model lacks")

    def lines(self):
        layout = ", ".join(f"{k}={v}" for k, v in self.layout.items())
        lines = [f"loaded checkpoint {self.directory} (written with {layout})",
                 "  loaded: " + ("; ".join(self.loaded) or "nothing")]
        if self.not_loaded:
            lines.append("  not loaded: " + "; ".join(self.not_loaded))
        lines.extend(f"  note: {note}" for note in self.notes + self._vocab_padding_notes())
        return lines
