"""modelopt's state in torch_dist checkpoints: a model converted by nvidia-modelopt (quantized for PTQ or QAT)
is saved with modelopt's record of the conversions, and a freshly built model is converted the same way
before its tensors are loaded.

What is saved, per pipeline stage (module names are local to a stage): `modelopt_state.pp<rank>`, the output of
`mto.modelopt_state(model)` (modes, configurations and each quantizer's settings), written by the stage's first
rank. Module names, and so the state, do not depend on the tensor- or data-parallel size. The quantizers'
calibrated amaxes are buffers of the model and travel with its tensors (`model.*`): a per-channel weight amax of
a column-parallel layer is marked as split over tensor parallelism like the weight's rows, every other amax is
the same on all tensor-parallel ranks (calibration agrees on it) and is saved whole. So a quantized checkpoint
loads at another tensor- or data-parallel size; the pipeline-parallel size must stay the same. modelopt's
distillation mode (`kd_loss`, which wraps the student with its teacher) is left out: checkpoints hold the
student.
"""

import sys

from megatron.core.distributed.data_parallel_base import unwrap_model

STATE_KEY_PREFIX = "modelopt_state.pp"
TRAINING_ONLY_MODES = ("kd_loss",)


def _pipeline_rank_and_size():
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return 0, 1
    return parallel_state.get_pipeline_model_parallel_rank(), parallel_state.get_pipeline_model_parallel_world_size()


def _is_converted(module) -> bool:
    # Only a process that imported modelopt can hold a model it converted; not importing it otherwise keeps
    # every save free of modelopt's import cost and of its dependencies' side effects (some draw from Python's
    # `random` at import, which would change the RNG state the checkpoint records).
    if "modelopt" not in sys.modules:
        return False
    try:
        import modelopt.torch.opt as mto
    except Exception:  # modelopt absent or not importable: nothing can have been converted by it
        return False
    return mto.ModeloptStateManager.is_converted(module)


def _single_converted_module(model_chunks):
    """The one unwrapped model chunk when modelopt converted it, else None (no chunk converted)."""
    modules = [unwrap_model(chunk) for chunk in model_chunks]
    converted = [module for module in modules if _is_converted(module)]
    if not converted:
        return None
    if len(modules) > 1:
        raise NotImplementedError("modelopt-converted models are checkpointed with one model chunk per pipeline "
                                  "stage: drop the virtual pipeline flags (--num-layers-per-virtual-pipeline-stage)")
    return converted[0]


def mark_tensor_parallel_quantizer_buffers(module):
    """Give each per-channel weight amax of a column-parallel layer the tensor-parallel attributes of the weight
    rows it belongs to (split along dim 0), so checkpoints place it like the weight."""
    from modelopt.torch.quantization.nn import TensorQuantizer

    from megatron.core.tensor_parallel.layers import ColumnParallelLinear

    for layer in module.modules():
        if not isinstance(layer, ColumnParallelLinear):
            continue
        quantizer = getattr(layer, "weight_quantizer", None)
        amax = getattr(quantizer, "_amax", None) if isinstance(quantizer, TensorQuantizer) else None
        if amax is not None and amax.dim() > 0 and amax.numel() > 1:
            amax.tensor_model_parallel, amax.partition_dim, amax.partition_stride = True, 0, 1


def modelopt_state_to_save(model_chunks):
    """{`modelopt_state.pp<rank>`: state} on the first rank of a stage whose model modelopt converted, else {}.
    Marks the tensor-parallel amax buffers first (call it before the model's state is taken)."""
    module = _single_converted_module(model_chunks)
    if module is None:
        return {}
    import modelopt.torch.opt as mto

    mark_tensor_parallel_quantizer_buffers(module)
    from megatron.core import parallel_state

    first_rank_of_stage = (not parallel_state.model_parallel_is_initialized()) or (
        parallel_state.get_tensor_model_parallel_rank() == 0
        and parallel_state.get_data_parallel_rank(with_context_parallel=True) == 0)
    if not first_rank_of_stage:
        return {}
    state = mto.modelopt_state(module)
    # A distillation wrapper (`kd_loss`) is not saved: checkpoints hold the student alone, without its teacher.
    modes = [(mode, config) for mode, config in state.get("modelopt_state_dict", []) if mode not in TRAINING_ONLY_MODES]
    if not modes:
        return {}
    state = {**state, "modelopt_state_dict": modes}
    pipeline_rank, _ = _pipeline_rank_and_size()
    return {f"{STATE_KEY_PREFIX}{pipeline_rank}": state}


def restore_modelopt_state(model_chunks, directory, saved_object_keys):
    """Convert the (unconverted) model as the checkpoint's modelopt state records, before its tensors are
    loaded; returns a line for the load report, or None when the checkpoint holds no modelopt state."""
    from megatron.core.dist_checkpointing import serialization

    stage_keys = sorted(key for key in saved_object_keys if key.startswith(STATE_KEY_PREFIX))
    if not stage_keys:
        return None
    pipeline_rank, pipeline_size = _pipeline_rank_and_size()
    if len(stage_keys) != pipeline_size:
        raise ValueError(f"checkpoint {directory} holds modelopt state for {len(stage_keys)} pipeline stage(s) but "
                         f"this run has --pipeline-model-parallel-size {pipeline_size}: a modelopt-converted model "
                         "loads with the pipeline-parallel size it was saved with")
    if len(model_chunks) > 1:
        raise NotImplementedError("a modelopt-converted checkpoint loads into one model chunk per pipeline stage: "
                                  "drop the virtual pipeline flags")
    key = f"{STATE_KEY_PREFIX}{pipeline_rank}"
    state = serialization.read_objects(directory, [key])[key]  # collective: every rank reads its stage's
    module = unwrap_model(model_chunks[0])
    if _is_converted(module):
        return f"modelopt state: the model was already converted; {key} not applied"
    from megatron.core.extensions import modelopt as modelopt_support

    restored = modelopt_support.restore(module, state)
    if restored is not module:
        raise RuntimeError("modelopt replaced the model object while restoring its state; the training wrapper "
                           "still holds the old one")
    mark_tensor_parallel_quantizer_buffers(module)
    modes = [mode for mode, _ in state.get("modelopt_state_dict", [])]
    return f"modelopt state ({', '.join(modes)}) from {key}"
