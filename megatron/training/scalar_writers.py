"""Where the training log's scalars go: TensorBoard (--tensorboard-dir) and Weights & Biases (--wandb-project),
behind one `add_scalar(name, value, step)` so that both receive exactly the same numbers.

`wandb` is an optional dependency, imported only when --wandb-project is given (validation has checked that it
is installed); so is TensorBoard, without which --tensorboard-dir writes no scalars (a message says so). Only the
logging rank (the last) builds writers.
"""

import os


class WandbWriter:
    """A W&B run seen as a TensorBoard-style writer: each scalar is one `run.log({name: value}, step=step)`."""

    def __init__(self, args):
        import wandb

        save_dir = args.wandb_save_dir or os.path.join(args.save, "wandb")
        os.makedirs(save_dir, exist_ok=True)
        init_kwargs = {"dir": save_dir, "name": args.wandb_exp_name, "project": args.wandb_project,
                       "config": {key: _plain(value) for key, value in vars(args).items()}}
        if args.wandb_entity:
            init_kwargs["entity"] = args.wandb_entity
        self._run = wandb.init(**init_kwargs)

    @property
    def run(self):
        """The W&B run (what upstream's `get_wandb_writer()` returns for scripts: `.log({name: value}, step)`)."""
        return self._run

    def add_scalar(self, name, value, step):
        self._run.log({name: value}, step=step)

    def flush(self):
        pass

    def close(self):
        self._run.finish()


def _plain(value):
    """Values W&B can store in a run's config: numbers, strings, lists of them; anything else as its str."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_plain(each) for each in value]
    return str(value)


class ScalarWriters:
    """Sends every scalar to each writer (TensorBoard's SummaryWriter, WandbWriter)."""

    def __init__(self, writers):
        self.writers = list(writers)

    def add_scalar(self, name, value, step):
        for writer in self.writers:
            writer.add_scalar(name, value, step)

    def flush(self):
        for writer in self.writers:
            writer.flush()

    def close(self):
        for writer in self.writers:
            writer.close()

    def shared_writers(self):
        """(TensorBoard's SummaryWriter or None, the W&B run or None): the objects upstream's
        `get_tensorboard_writer()` and `get_wandb_writer()` hand to scripts."""
        tensorboard = next((writer for writer in self.writers if not isinstance(writer, WandbWriter)), None)
        wandb_run = next((writer.run for writer in self.writers if isinstance(writer, WandbWriter)), None)
        return tensorboard, wandb_run


def build_scalar_writers(args):
    """The writers the flags ask for, as one `ScalarWriters`; None when there are none."""
    writers = []
    if args.tensorboard_dir:
        writer = _tensorboard_writer(args)
        if writer is not None:
            writers.append(writer)
    if getattr(args, "wandb_project", ""):
        writers.append(WandbWriter(args))
    return ScalarWriters(writers) if writers else None


def _tensorboard_writer(args):
    """TensorBoard's SummaryWriter for --tensorboard-dir; None, after saying so, when TensorBoard is not installed
    (as upstream, the run goes on without its scalars)."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as error:
        print(f"--tensorboard-dir {args.tensorboard_dir}: no TensorBoard scalars are written: TensorBoard is not "
              f"installed ({error}); `pip install tensorboard` to get them. The log lines and the metrics file are "
              "written as usual", flush=True)
        return None
    return SummaryWriter(log_dir=args.tensorboard_dir, max_queue=getattr(args, "tensorboard_queue_size", 1000))
