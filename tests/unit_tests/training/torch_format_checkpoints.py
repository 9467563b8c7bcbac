"""What the torch-format checkpoint tests save: a small trained state and the flags of a run."""

import argparse

import torch


class Scheduler:
    """The smallest object with the optimizer-parameter scheduler's state dict."""

    def __init__(self):
        self.num_steps = 0

    def state_dict(self):
        return {"num_steps": self.num_steps}

    def load_state_dict(self, state):
        self.num_steps = state["num_steps"]


def checkpoint_args(root, **overrides):
    """The checkpoint flags of a torch-format run saving to and loading from `root`."""
    values = dict(
        save=root, load=root, ckpt_format="torch", no_save_optim=False, no_save_rng=False, no_load_optim=False,
        no_load_rng=False, finetune=False, exit_on_missing_checkpoint=False, use_distributed_optimizer=False,
        tensor_model_parallel_size=1, pipeline_model_parallel_size=1, consumed_train_samples=0,
    )  # fmt: skip
    values.update(overrides)
    return argparse.Namespace(**values)


def trained_state(seed):
    """A linear model, its Adam optimizer after one step and a scheduler at step `seed`."""
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(5, 4)).sum().backward()
    optimizer.step()
    scheduler = Scheduler()
    scheduler.num_steps = seed
    return model, optimizer, scheduler
