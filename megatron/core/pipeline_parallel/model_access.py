"""What the pipeline schedules read from, and call on, the model they run.

A schedule receives the model as a module (possibly wrapped by DDP or FSDP, which keep the real model in
`.module`) or as a list holding one such module. The hooks and communication settings come from the model's
config object (`model.config`); a model without one runs with `DEFAULT_SCHEDULE_SETTINGS`, whose hooks are
all off and whose activations are fp32.
"""

import types

import torch

DEFAULT_SCHEDULE_SETTINGS = types.MappingProxyType(
    {
        # Pipeline communication.
        "pipeline_dtype": None,  # None: params_dtype if the config has one, else float32
        "params_dtype": torch.float32,
        "hidden_size": None,
        "sequence_parallel": False,
        "variable_seq_lengths": False,
        "deallocate_pipeline_outputs": False,
        # Loss handling.
        "calculate_per_token_loss": False,
        "grad_scale_func": None,
        # Gradient-synchronisation hooks.
        "no_sync_func": None,
        "grad_sync_func": None,
        "param_sync_func": None,
        "finalize_model_grads_func": None,
        # Timers (megatron.core.timers.Timers) of forward-compute and backward-compute; None: not timed.
        "timers": None,
    }
)


def schedule_setting(config, name):
    """`config.<name>`, or the schedule's default when the config does not define it (or there is none)."""
    return getattr(config, name, DEFAULT_SCHEDULE_SETTINGS[name])


def single_model_chunk(model):
    """The one module a non-interleaved schedule runs, from a module or a one-element list."""
    if isinstance(model, (list, tuple)):
        if len(model) != 1:
            raise ValueError(
                f"this schedule runs one model chunk per pipeline stage, got a list of {len(model)}; "
                "pass the stage's module (interleaved virtual pipeline stages are not supported)"
            )
        model = model[0]
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module or a list with one, got {type(model).__name__}")
    return model


def _unwrapped_modules(model):
    """`model`, then `model.module`, `model.module.module`, ... (DDP / FSDP / Float16Module wrappers)."""
    seen = set()
    while model is not None and id(model) not in seen:
        seen.add(id(model))
        yield model
        model = getattr(model, "module", None)


def get_model_config(model):
    """The first `config` attribute found through the wrappers, or None (the schedule then uses defaults)."""
    for module in _unwrapped_modules(model):
        config = getattr(module, "config", None)
        if config is not None:
            return config
    return None


def set_input_tensor(model, input_tensor):
    """Hand the activation received from the previous stage to the model (None on the first stage)."""
    for module in _unwrapped_modules(model):
        setter = getattr(module, "set_input_tensor", None)
        if callable(setter):
            setter(input_tensor)
            return
    if input_tensor is None:  # a single-stage model need not know about pipelining
        return
    raise AttributeError(
        f"{type(model).__name__} (and the modules it wraps via .module) has no set_input_tensor(); pipeline "
        "stages must accept the previous stage's activation through set_input_tensor"
    )


_UPSTREAM_OPTION_ADVICE = {
    "adjust_tensor_shapes_fn": "every stage sends and receives [seq_length, micro_batch_size, hidden_size] "
                               "activations; pass None",
    "p2p_communicator": "stages exchange activations over parallel_state's pipeline group; pass None",
    "pg_collection": "the schedules use parallel_state's process groups (initialize_model_parallel); pass None",
}


def refuse_upstream_schedule_options(schedule, **options):
    """Upstream's schedule keywords whose non-None values have no implementation here: refused by name."""
    for name, value in options.items():
        if value is not None:
            raise ValueError(f"{schedule}({name}=...) is not supported here: {_UPSTREAM_OPTION_ADVICE[name]}")
