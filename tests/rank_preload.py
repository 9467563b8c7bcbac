"""What the processes that fork test ranks import before forking, so that every rank starts with it loaded.
Importing this module imports them all.

Both rank factories use this list: the functional tests' fork launcher (`tests/functional_tests/fork_launcher.py`)
and the unit tests' pool fork server (`tests/unit_tests/multiprocess_harness.py`). It covers what a training run
imports on its way, lazily or not: the model, the training loop and `pretrain_gpt.py`, the optimizers and
wrappers (Megatron-FSDP and FSDP2 included), checkpointing (torch.distributed.checkpoint), the data pipeline,
torch's compiler front end and TensorBoard. Measured on a 2-core machine: a rank forked from a server that
imported only torch, the model and the training loop spent about 1.2 s of CPU importing the rest during a short
run. None of these imports starts a thread.
"""

import gc
import importlib

RANK_PRELOAD_MODULES = (
    "torch",
    "torch.distributed",
    "torch.distributed.checkpoint",
    "torch._dynamo",
    "megatron.core.models.gpt.gpt_model",
    "megatron.training.training",
    "megatron.training.checkpointing",
    "megatron.training.dist_checkpoint",
    "megatron.core.optimizer.distrib_optimizer",
    "megatron.core.optimizer.fsdp_optimizer",
    "megatron.core.distributed.fsdp_units",
    # Imported when a run builds its wrapper or tears its groups down, not by pretrain_gpt.py itself: every rank of
    # a Megatron-FSDP or FSDP2 run imported (and, without bytecode caches, compiled) them on its own.
    "megatron_fsdp",
    "megatron.core.distributed.fsdp.mcore_fsdp_adapter",
    "megatron.core.distributed.torch_fully_sharded_data_parallel",
    "torch.distributed.tensor.debug",
    "megatron.training.local_checkpoint",
    "megatron.core.dist_checkpointing.offline",
    "megatron.core.dist_checkpointing.serialization",
    "megatron.training.tokenizer.tokenizer",
    "megatron.training.datasets.data_samplers",
    "megatron.core.datasets.gpt_dataset",
    "pretrain_gpt",
)
OPTIONAL_PRELOAD_MODULES = ("torch.utils.tensorboard",)  # a dev extra; runs that log to TensorBoard import it


for _name in RANK_PRELOAD_MODULES:
    importlib.import_module(_name)
for _name in OPTIONAL_PRELOAD_MODULES:
    try:
        importlib.import_module(_name)
    except ImportError:
        pass

# Move everything loaded so far out of the collector's reach: a full collection (the training loop's teardown runs
# one before destroying its process group) then walks only what the rank made itself, not the ~330k objects of
# torch and Megatron, and forked ranks stop touching (copying) the shared pages of those objects.
gc.collect()
gc.freeze()
