"""`ModelParallelConfig`: parallel sizes, dtypes and communication switches shared by every model-parallel module.

Frozen and validated once in `__post_init__`; error messages name the command-line flag and say what to do.
`TransformerConfig` subclasses it: subclasses extend `__post_init__` and call `super().__post_init__()`.
To change a field after construction use `dataclasses.replace(config, field=value)`, which re-validates; only
the run-time hooks (`RUNTIME_HOOK_FIELDS`) may be assigned in place.
"""

from dataclasses import dataclass
from typing import Callable, Optional

import torch

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

# Hooks a training loop installs after building its wrappers (`config.no_sync_func = model.no_sync`, ...), as
# upstream's own loops do; they are run-time callbacks, not model settings, so plain assignment is allowed for
# them while every other field stays frozen (change those with `dataclasses.replace`, which re-validates).
RUNTIME_HOOK_FIELDS = frozenset(
    ("finalize_model_grads_func", "grad_scale_func", "no_sync_func", "grad_sync_func", "param_sync_func", "timers")
)


def refuse_assignment_naming_replace(config_class, instance_name="config", assignable=(), reason=""):
    """Make assigning a field of the frozen config dataclass `config_class` raise naming
    `dataclasses.replace(<instance_name>, ...)`, which re-validates (upstream's configs are mutable and upstream
    loops assign their fields), `reason` following "is frozen"; the fields in `assignable` take plain assignment.
    Every frozen dataclass gets its own `__setattr__`, so each config class applies this itself."""
    frozen_setattr = config_class.__setattr__
    hooks_note = (f" (only the hooks {', '.join(sorted(assignable))} may be assigned in place)" if assignable
                  else "")

    def __setattr__(self, name, value):
        if name in assignable:
            object.__setattr__(self, name, value)
            return
        try:
            frozen_setattr(self, name, value)
        except AttributeError as error:  # dataclasses.FrozenInstanceError
            raise type(error)(
                f"cannot assign to field {name!r}: {type(self).__name__} is frozen{reason}; build a new one with "
                f"dataclasses.replace({instance_name}, {name}=...), which re-validates{hooks_note}"
            ) from None

    config_class.__setattr__ = __setattr__
    return config_class


def allow_runtime_hook_assignment(config_class):
    """Let instances of the frozen config dataclass `config_class` take plain assignment of the
    `RUNTIME_HOOK_FIELDS`; assigning any other field stays refused, naming `dataclasses.replace`
    (ModelParallelConfig, TransformerConfig)."""
    return refuse_assignment_naming_replace(config_class, assignable=RUNTIME_HOOK_FIELDS)


@allow_runtime_hook_assignment
@dataclass(frozen=True)
class ModelParallelConfig:
    # Parallel sizes
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    # Interleaved pipeline: model chunks per pipeline rank (None: one chunk, plain 1F1B), and how many
    # consecutive microbatches each chunk runs before the next chunk takes over (None: the pipeline size).
    virtual_pipeline_model_parallel_size: Optional[int] = None
    microbatch_group_size_per_vp_stage: Optional[int] = None
    context_parallel_size: int = 1
    expert_model_parallel_size: int = 1
    sequence_parallel: bool = False

    # Initialisation
    perform_initialization: bool = True
    use_cpu_initialization: bool = False
    init_model_with_meta_device: bool = False

    # Precision
    fp16: bool = False
    bf16: bool = False
    params_dtype: torch.dtype = torch.float32

    # Tensor-parallel linear layers
    gradient_accumulation_fusion: bool = False

    # Pipeline parallel
    pipeline_dtype: Optional[torch.dtype] = None
    variable_seq_lengths: bool = False
    batch_p2p_comm: bool = True
    deallocate_pipeline_outputs: bool = False

    # Hooks the training loop installs for the pipeline schedules (assignable in place: RUNTIME_HOOK_FIELDS)
    finalize_model_grads_func: Optional[Callable] = None
    grad_scale_func: Optional[Callable] = None
    no_sync_func: Optional[Callable] = None
    grad_sync_func: Optional[Callable] = None
    param_sync_func: Optional[Callable] = None
    timers: Optional[object] = None
    """`megatron.core.timers.Timers` of the run (None: nothing is timed)."""
    barrier_with_L1_time: bool = True
    """Level-1 timers pass a barrier at start and stop, so they measure the slowest rank."""

    def __post_init__(self):
        sizes = {
            "--tensor-model-parallel-size": self.tensor_model_parallel_size,
            "--pipeline-model-parallel-size": self.pipeline_model_parallel_size,
            "--context-parallel-size": self.context_parallel_size,
            "--expert-model-parallel-size": self.expert_model_parallel_size,
        }
        for flag, value in sizes.items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{flag} must be an integer >= 1, got {value!r}")
        self._validate_virtual_pipeline()
        if self.sequence_parallel and self.tensor_model_parallel_size == 1:
            raise ValueError(
                "--sequence-parallel needs --tensor-model-parallel-size > 1; drop --sequence-parallel or raise "
                "the tensor-parallel size"
            )
        if self.fp16 and self.bf16:
            raise ValueError("--fp16 and --bf16 are mutually exclusive; pick one")
        if self.params_dtype not in _FLOAT_DTYPES:
            raise ValueError(f"params_dtype must be one of {_FLOAT_DTYPES}, got {self.params_dtype}")
        if self.fp16 and self.params_dtype != torch.float16:
            raise ValueError("--fp16 needs params_dtype=torch.float16 (set params_dtype with --fp16)")
        if self.bf16 and self.params_dtype != torch.bfloat16:
            raise ValueError("--bf16 needs params_dtype=torch.bfloat16 (set params_dtype with --bf16)")
        if not (self.fp16 or self.bf16) and self.params_dtype != torch.float32:
            raise ValueError(
                f"params_dtype={self.params_dtype} needs the matching precision flag: --fp16 for float16, "
                "--bf16 for bfloat16"
            )
        if self.pipeline_dtype is not None and self.pipeline_dtype not in _FLOAT_DTYPES:
            raise ValueError(f"pipeline_dtype must be one of {_FLOAT_DTYPES} or None, got {self.pipeline_dtype}")
        if self.pipeline_model_parallel_size > 1 and self.pipeline_dtype is None:
            # The activations sent between stages have the parameters' dtype unless told otherwise.
            object.__setattr__(self, "pipeline_dtype", self.params_dtype)

    def _validate_virtual_pipeline(self):
        chunks = self.virtual_pipeline_model_parallel_size
        if chunks is None:
            return  # as upstream, microbatch_group_size_per_vp_stage is unused without an interleaved pipeline
        if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
            raise ValueError(
                f"--num-virtual-stages-per-pipeline-rank (virtual_pipeline_model_parallel_size) must be an integer "
                f">= 1, got {chunks!r}"
            )
        if chunks > 1 and self.pipeline_model_parallel_size == 1:
            raise ValueError(
                "an interleaved pipeline (--num-layers-per-virtual-pipeline-stage / "
                "--num-virtual-stages-per-pipeline-rank) needs --pipeline-model-parallel-size > 1"
            )
        group_size = self.microbatch_group_size_per_vp_stage
        if group_size is not None and (
            isinstance(group_size, bool) or not isinstance(group_size, int)
            or group_size < self.pipeline_model_parallel_size
        ):
            raise ValueError(
                f"--microbatch-group-size-per-virtual-pipeline-stage ({group_size!r}) must be an integer >= "
                f"--pipeline-model-parallel-size ({self.pipeline_model_parallel_size})"
            )
