"""The training driver: command-line arguments, `pretrain()`, checkpoints and training logs.

The package also answers upstream Megatron-LM's top-level names (`from megatron.training import get_args,
pretrain, print_rank_0, ...`), so that a pretrain script written against upstream runs here unchanged. Each is
looked up in the module that implements it on first use (module `__getattr__`): importing the package, or any
module in it, loads nothing else.
"""

# Upstream name -> the module that holds it here (under the same name). Names whose upstream signature or meaning
# differs from this repository's implementation go through the adapters of `megatron.training.utils`.
UPSTREAM_NAMES = {
    "get_args": "megatron.training.global_state",
    "get_timers": "megatron.training.global_state",
    "get_tokenizer": "megatron.training.global_state",
    "get_tensorboard_writer": "megatron.training.global_state",
    "get_wandb_writer": "megatron.training.global_state",
    "get_signal_handler": "megatron.training.global_state",
    "get_one_logger": "megatron.training.global_state",
    "get_adlr_autoresume": "megatron.training.global_state",
    "initialize_megatron": "megatron.training.initialize",
    "get_num_microbatches": "megatron.core.num_microbatches_calculator",
    "get_current_global_batch_size": "megatron.core.num_microbatches_calculator",
    "update_num_microbatches": "megatron.core.num_microbatches_calculator",
    "pretrain": "megatron.training.utils",
    "get_model": "megatron.training.utils",
    "print_rank_0": "megatron.training.utils",
    "print_rank_last": "megatron.training.utils",
    "is_last_rank": "megatron.training.utils",
    "set_startup_timestamps": "megatron.training.utils",
    "inprocess_restart": "megatron.training.utils",
}


def __getattr__(name):
    module_name = UPSTREAM_NAMES.get(name)
    if module_name is None:
        # AttributeError lets `from megatron.training import <submodule>` go on to import the submodule.
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module_name), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(UPSTREAM_NAMES))
