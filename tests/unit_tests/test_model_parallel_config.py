"""ModelParallelConfig: frozen, defaults, and validation errors that name the flags."""

import dataclasses

import pytest
import torch

from megatron.core.model_parallel_config import ModelParallelConfig


def test_defaults_and_frozen():
    config = ModelParallelConfig()
    assert config.tensor_model_parallel_size == 1
    assert config.params_dtype == torch.float32
    assert config.perform_initialization is True
    assert config.sequence_parallel is False
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.tensor_model_parallel_size = 2


def test_replace_revalidates():
    config = ModelParallelConfig(tensor_model_parallel_size=2, sequence_parallel=True)
    with pytest.raises(ValueError, match="--sequence-parallel needs --tensor-model-parallel-size > 1"):
        dataclasses.replace(config, tensor_model_parallel_size=1)


def test_pipeline_dtype_defaults_to_params_dtype_with_pipelining():
    config = ModelParallelConfig(pipeline_model_parallel_size=2, bf16=True, params_dtype=torch.bfloat16)
    assert config.pipeline_dtype == torch.bfloat16
    assert ModelParallelConfig().pipeline_dtype is None


def test_subclass_extends_validation():
    @dataclasses.dataclass(frozen=True)
    class Child(ModelParallelConfig):
        hidden_size: int = 8

        def __post_init__(self):
            super().__post_init__()
            if self.hidden_size % self.tensor_model_parallel_size:
                raise ValueError("hidden")

    assert Child(tensor_model_parallel_size=2).hidden_size == 8
    with pytest.raises(ValueError, match="--fp16 and --bf16"):
        Child(fp16=True, bf16=True)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(sequence_parallel=True), "--sequence-parallel needs --tensor-model-parallel-size > 1"),
        (dict(fp16=True, bf16=True), "--fp16 and --bf16 are mutually exclusive"),
        (dict(tensor_model_parallel_size=0), "--tensor-model-parallel-size must be an integer >= 1"),
        (dict(pipeline_model_parallel_size=-1), "--pipeline-model-parallel-size must be an integer >= 1"),
        (dict(context_parallel_size=1.5), "--context-parallel-size must be an integer >= 1"),
        (dict(expert_model_parallel_size=0), "--expert-model-parallel-size must be an integer >= 1"),
        (dict(fp16=True), r"--fp16 needs params_dtype=torch.float16"),
        (dict(bf16=True, params_dtype=torch.float16), r"--bf16 needs params_dtype=torch.bfloat16"),
        (dict(params_dtype=torch.bfloat16), "needs the matching precision flag"),
        (dict(params_dtype=torch.int32), "params_dtype must be one of"),
        (dict(virtual_pipeline_model_parallel_size=2), "needs --pipeline-model-parallel-size > 1"),
        (dict(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2,
              microbatch_group_size_per_vp_stage=1), "--microbatch-group-size-per-virtual-pipeline-stage"),
        (dict(pipeline_dtype=torch.int64), "pipeline_dtype must be one of"),
    ],
)
def test_invalid_combinations_name_the_flag(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ModelParallelConfig(**kwargs)


def test_microbatch_group_size_without_interleaving_is_accepted_as_upstream():
    config = ModelParallelConfig(pipeline_model_parallel_size=2, microbatch_group_size_per_vp_stage=4)
    assert (config.virtual_pipeline_model_parallel_size, config.microbatch_group_size_per_vp_stage) == (None, 4)


def test_valid_precisions():
    assert ModelParallelConfig(fp16=True, params_dtype=torch.float16).params_dtype == torch.float16
    assert ModelParallelConfig(bf16=True, params_dtype=torch.bfloat16).bf16
    assert ModelParallelConfig(tensor_model_parallel_size=4, sequence_parallel=True).sequence_parallel


def test_training_loop_hooks_can_be_assigned_in_place():
    from megatron.core.model_parallel_config import RUNTIME_HOOK_FIELDS

    config = ModelParallelConfig(pipeline_model_parallel_size=2)
    hooks = [lambda: None, lambda: None]
    config.no_sync_func = hooks  # as upstream's own training loops do
    config.finalize_model_grads_func = config.grad_sync_func = config.param_sync_func = print
    config.grad_scale_func = config.timers = None
    assert config.no_sync_func is hooks and config.finalize_model_grads_func is print
    assert RUNTIME_HOOK_FIELDS == {"finalize_model_grads_func", "grad_scale_func", "no_sync_func", "grad_sync_func",
                                   "param_sync_func", "timers"}
    with pytest.raises(dataclasses.FrozenInstanceError,
                       match=r"ModelParallelConfig is frozen; .*dataclasses.replace\(config, sequence_parallel="):
        config.sequence_parallel = True
    assert config.sequence_parallel is False
