"""What the one-process CPU benchmark programs of examples/ share: a one-rank gloo world with parallel_state set up
(unless the caller has one), and the result table printed and written to `--markdown`."""

import os

import torch
import torch.distributed as dist


def one_process_world(port):
    """A one-rank gloo world on `port` and one-rank parallel_state groups, unless already set up."""
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(port))
        dist.init_process_group("gloo", rank=0, world_size=1)
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads", flush=True)


def report(table, markdown=None):
    """Print the markdown `table`, also write it to `markdown` when given; returns it."""
    print(table, flush=True)
    if markdown:
        with open(markdown, "w") as output:
            output.write(table + "\n")
    return table
