"""Tensor-parallel layers: column- and row-parallel linear layers and the vocabulary-parallel embedding.

Weight shapes follow Megatron: a column-parallel weight is `[output_size / tp, input_size]` (split along
dim 0), a row-parallel weight `[output_size, input_size / tp]` (split along dim 1), a vocabulary-parallel
embedding `[num_embeddings / tp, embedding_dim]`.

Initialisation is independent of the tensor-parallel size: every rank initialises the full master weight
on the CPU in fp32 with `init_method` under the default generator, keeps its own slice and casts it to
`config.params_dtype`. All ranks draw the same random numbers, so their default generators stay in lockstep
and a partition equals the matching slice of a single-rank layer built with the same seed. The same code
runs in `reset_parameters()`, which meta-device construction calls after materialising the parameters.

FP8: inside an FP8 region (`megatron.core.fp8_utils.get_fp8_context`) the linear layers run their GEMMs in
FP8 through the torch-native backend (`megatron.core.fp8.linear`); a weight that carries an FP8 copy
(`weight.fp8_weight`, installed by `--fp8-param-gather`) is used as it is, else the layer quantizes its weight
once per optimizer step. Under delayed scaling each linear layer of a transformer layer keeps its amax histories
in buffers (`fp8_amax_history`, `fp8_amax_recorded_count`), so they are saved and restored with the model; a
state dict without them (a run without delayed FP8 scaling) loads, and the histories start empty; histories
saved with another `--fp8-amax-history-len` load fitted to this run's (`megatron.core.fp8.checkpoint`); layers
that never run in FP8 (the output layer) have none and ignore them.
"""

import functools

import torch
import torch.nn.functional as F
from torch.nn.parameter import Parameter

from megatron.core import parallel_state
from megatron.core.device_utils import get_current_device
from megatron.core.fp8.checkpoint import (
    FP8_HISTORY_BUFFERS,
    fit_loaded_amax_history,
    start_missing_fp8_histories_empty,
)
from megatron.core.fp8.linear import fp8_linear, scaled_mm_in_use
from megatron.core.fp8.recipe import Fp8Recipe
from megatron.core.fp8.region import active_fp8_region
from megatron.core.fp8.scaling import LinearScaling
from megatron.core.fused_weight_grad import weight_grad_after_main_grad
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region,
)
from megatron.core.tensor_parallel.utils import VocabUtility, divide, strided_partition

_MODEL_PARALLEL_ATTRIBUTE_DEFAULTS = {"tensor_model_parallel": False, "partition_dim": -1, "partition_stride": 1}


# --------------------------------------------------------------------------------------------------------
# Parameter attributes
# --------------------------------------------------------------------------------------------------------


def set_tensor_model_parallel_attributes(tensor, is_parallel, dim, stride):
    """Record how `tensor` is partitioned across tensor-parallel ranks."""
    tensor.tensor_model_parallel = is_parallel
    tensor.partition_dim = dim
    tensor.partition_stride = stride


def set_defaults_if_not_set_tensor_model_parallel_attributes(tensor):
    for attribute, value in _MODEL_PARALLEL_ATTRIBUTE_DEFAULTS.items():
        if not hasattr(tensor, attribute):
            setattr(tensor, attribute, value)


def copy_tensor_model_parallel_attributes(destination, source):
    for attribute in _MODEL_PARALLEL_ATTRIBUTE_DEFAULTS:
        if hasattr(source, attribute):
            setattr(destination, attribute, getattr(source, attribute))


def param_is_not_tensor_parallel_duplicate(param):
    """True for partitioned params, and for duplicated ones on tensor-parallel rank 0 (count each once); an
    expert's parameter (`allreduce = False`) is duplicated over the expert tensor-parallel group instead."""
    if getattr(param, "tensor_model_parallel", False):
        return True
    if getattr(param, "allreduce", True) is False:
        return parallel_state.get_expert_tensor_parallel_rank() == 0
    return parallel_state.get_tensor_model_parallel_rank() == 0


def tensor_parallel_rank_and_size(is_expert=False):
    """(rank, size) in the group a linear's weight is split over: the expert tensor-parallel group for an
    expert's linears (`--expert-tensor-parallel-size`), else the tensor-parallel group."""
    if is_expert:
        return parallel_state.get_expert_tensor_parallel_rank(), parallel_state.get_expert_tensor_parallel_world_size()
    return parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_tensor_model_parallel_world_size()


def explicit_expert_communication(config, is_expert):
    """As upstream: an expert's linear under tensor or expert parallelism does no communication of its own (the
    MoE token dispatcher gathers its input and reduces its output), so it must leave its bias to the caller."""
    return is_expert and (config.tensor_model_parallel_size > 1 or config.expert_model_parallel_size > 1)


def _communication_group(is_expert, tp_size):
    """The group a linear's activations are exchanged over: the expert tensor-parallel group for an expert's
    linear (None, meaning the tensor-parallel group, otherwise or when the split is over one rank)."""
    return parallel_state.get_expert_tensor_parallel_group() if is_expert and tp_size > 1 else None


def check_tensor_parallel_group(layer_name, tp_group, is_expert=False):
    """Upstream's `tp_group` keyword: a linear here is split over parallel_state's tensor-parallel group (the
    expert one with `is_expert`), so a group given must have that group's ranks."""
    if tp_group is None:
        return
    import torch.distributed as dist

    if parallel_state.model_parallel_is_initialized():
        kind = "expert tensor-parallel" if is_expert else "tensor-parallel"
        expected = (parallel_state.get_expert_tensor_parallel_group() if is_expert
                    else parallel_state.get_tensor_model_parallel_group())
        expected_ranks = dist.get_process_group_ranks(expected)
    else:
        kind, expected_ranks = "single-rank tensor-parallel (model parallelism is not initialised)", [dist.get_rank()]
    given_ranks = dist.get_process_group_ranks(tp_group)
    if given_ranks != expected_ranks:
        raise ValueError(
            f"{layer_name}(tp_group=...) spans ranks {given_ranks}, but the layer is split over the {kind} group "
            f"of parallel_state (ranks {expected_ranks}): pass tp_group=None, or initialize_model_parallel() with "
            "the tensor-parallel size you want"
        )


def _refuse_upstream_only_options(layer_name, **options):
    """Upstream keywords whose non-default values (None or False) have no implementation here: refused by name."""
    for name, (value, instead) in options.items():
        if value is not None and value is not False:
            raise ValueError(f"{layer_name}({name}=...) is not supported here: {instead}")


def _parameter_device(config):
    if getattr(config, "init_model_with_meta_device", False) or torch.get_default_device().type == "meta":
        return torch.device("meta")
    if getattr(config, "use_cpu_initialization", False):
        return torch.device("cpu")
    return get_current_device()


def initialize_partition_from_master(param, full_shape, init_method, partition_dim, stride=1, is_expert=False):
    """Fill `param` with this rank's slice of a full fp32 CPU weight initialised by `init_method` (split over
    the expert tensor-parallel group with `is_expert`); returns that full weight (None on the meta device)."""
    if param.is_meta:
        return None
    master = torch.empty(full_shape, dtype=torch.float32, device="cpu")
    init_method(master)
    tp_rank, tp_size = tensor_parallel_rank_and_size(is_expert)
    partition = strided_partition(master, tp_size, tp_rank, partition_dim, stride)
    with torch.no_grad():
        param.copy_(partition.to(dtype=param.dtype))
    return master


def _zero_(param):
    if param is not None and not param.is_meta:
        with torch.no_grad():
            param.zero_()


# --------------------------------------------------------------------------------------------------------
# Linear with optional weight-gradient accumulation into `main_grad`
# --------------------------------------------------------------------------------------------------------


class LinearWithGradAccumulation(torch.autograd.Function):
    """`input @ weight.T + bias` whose weight gradient is added straight into `weight.main_grad`.

    Used when `gradient_accumulation_fusion` is on and the data-parallel wrapper gave the weight a
    `main_grad` buffer. If the weight also has a `grad_added_to_main_grad` flag it is set and a zero
    gradient is returned (so gradient hooks still run); otherwise the weight gradient is None.
    """

    @staticmethod
    def forward(ctx, input_, weight, bias):
        ctx.save_for_backward(input_, weight)
        ctx.has_bias = bias is not None
        return F.linear(input_, weight, bias)

    @staticmethod
    def backward(ctx, grad_output):
        input_, weight = ctx.saved_tensors
        grad_input = grad_output.matmul(weight)
        grad_output_2d = grad_output.reshape(-1, grad_output.size(-1))
        input_2d = input_.reshape(-1, input_.size(-1))
        grad_weight = grad_output_2d.t().matmul(input_2d)
        if hasattr(weight, "main_grad"):
            weight.main_grad.add_(grad_weight.to(weight.main_grad.dtype))
            grad_weight = weight_grad_after_main_grad(weight)
        grad_bias = grad_output_2d.sum(dim=0) if ctx.has_bias else None
        return grad_input, grad_weight, grad_bias


def _linear(input_, weight, bias, gradient_accumulation_fusion):
    if gradient_accumulation_fusion and torch.is_grad_enabled() and weight.requires_grad:
        return LinearWithGradAccumulation.apply(input_, weight, bias)
    return F.linear(input_, weight, bias)


def linear_with_grad_accumulation_and_async_allreduce(input, weight, bias, gradient_accumulation_fusion,
                                                      allreduce_dgrad, sequence_parallel, grad_output_buffer=None,
                                                      wgrad_deferral_limit=None, async_grad_allreduce=None,
                                                      tp_group=None):
    """The GEMM of the tensor-parallel linear layers outside FP8 regions, with the communication upstream's
    function of this name does around it: under `sequence_parallel` the input (split along the sequence, dim 0)
    is all-gathered over the tensor-parallel group first (its gradient reduce-scattered back); with
    `allreduce_dgrad` the input gradient is all-reduced over the group. The weight gradient goes into
    `weight.main_grad` with `gradient_accumulation_fusion` (see `LinearWithGradAccumulation`).

    The layers look this function up in this module on every call, so a tool can wrap it (modelopt's Megatron
    plugin quantizes the input and weight it receives). Deferred weight gradients (`grad_output_buffer`,
    `wgrad_deferral_limit`) and groups other than this rank's tensor-parallel group are not supported.
    """
    if grad_output_buffer is not None or wgrad_deferral_limit:
        raise NotImplementedError("deferred weight-gradient computation (grad_output_buffer) is not supported")
    if tp_group is not None and parallel_state.model_parallel_is_initialized() and \
            tp_group is not parallel_state.get_tensor_model_parallel_group():
        raise NotImplementedError("linear_with_grad_accumulation_and_async_allreduce runs over the tensor-parallel "
                                  "group of parallel_state only")
    if async_grad_allreduce is not None:  # upstream's older name of allreduce_dgrad
        allreduce_dgrad = allreduce_dgrad or async_grad_allreduce
    if sequence_parallel:
        input = gather_from_sequence_parallel_region(input, tensor_parallel_output_grad=True)
    elif allreduce_dgrad:
        input = copy_to_tensor_model_parallel_region(input)
    return _linear(input, weight, bias, gradient_accumulation_fusion)


# --------------------------------------------------------------------------------------------------------
# FP8
# --------------------------------------------------------------------------------------------------------


def _uses_torch_native_delayed_fp8(config):
    return (
        getattr(config, "fp8", None) is not None
        and getattr(config, "fp8_recipe", None) == "delayed"
        and getattr(config, "transformer_impl", "local") == "local"
    )


def _fp8_linear_load_pre_hook(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
    """Loading resets the layer's FP8 state kept off the state dict (scaling states, the step's weight cache); a
    layer without amax-history buffers ignores the ones a state dict has (older checkpoints gave them to every
    linear layer, the output layer too); one with them starts them empty when the state dict has none, and fits
    them to its history length when they were saved with another `--fp8-amax-history-len`."""
    module._fp8_scaling = None
    module._fp8_weight_cache = None
    if getattr(module, "fp8_amax_history", None) is None:
        for name in FP8_HISTORY_BUFFERS:
            state_dict.pop(prefix + name, None)
        return
    fit_loaded_amax_history(module, state_dict, prefix)
    start_missing_fp8_histories_empty(module, state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)


class _Fp8LinearMixin:
    """FP8 state of a tensor-parallel linear layer: its scaling states, the step's FP8 weight and the GEMM dispatch.

    Under delayed scaling (`--transformer-impl local`) a layer that can run inside an FP8 region (one of a
    transformer layer, built through `megatron.core.extensions.transformer_engine.layer_classes`) keeps its amax
    histories in buffers (`register_fp8_histories`); others (the output layer) have none, as they never quantize.

    The FP8 weight is cached for the optimizer step once the training loop manages the layer (it calls
    `fp8_step_states()` every step, through `megatron.core.fp8.scaling.reduce_fp8_amaxes`, which starts the
    cache anew): later microbatches reuse it while the weight's version counter and storage are unchanged.
    """

    fp8_parallel_mode = "none"

    def _init_fp8(self, config):
        self._fp8_scaling = None
        self._fp8_weight_cache = None
        self._fp8_step_managed = False
        self._fp8_keep_transpose = bool(getattr(config, "keep_fp8_transpose_cache", False))
        self._fp8_history_recipe = Fp8Recipe.from_config(config) if _uses_torch_native_delayed_fp8(config) else None
        self._register_load_state_dict_pre_hook(_fp8_linear_load_pre_hook, with_module=True)

    @functools.cached_property
    def _fp8_label(self):
        return f"{type(self).__name__}({self.input_size}->{self.output_size})"

    def register_fp8_histories(self):
        """Give the layer its delayed-scaling amax-history buffers (`fp8_amax_history` `[3, history length]` and
        `fp8_amax_recorded_count` `[3]`, on the parameters' device); nothing without delayed scaling. Returns
        the layer."""
        recipe = self._fp8_history_recipe
        if recipe is None or getattr(self, "fp8_amax_history", None) is not None:
            return self
        device = self.weight.device if self.weight is not None else _parameter_device(self.config)
        self.register_buffer("fp8_amax_history",
                             torch.zeros(3, recipe.amax_history_len, dtype=torch.float32, device=device))
        self.register_buffer("fp8_amax_recorded_count", torch.zeros(3, dtype=torch.int64, device=device))
        return self

    def fp8_scaling(self, recipe):
        """The layer's `LinearScaling` for `recipe` (rebuilt when the recipe or the history buffers change)."""
        history = self._buffers.get("fp8_amax_history")
        counts = self._buffers.get("fp8_amax_recorded_count")
        if history is not None and history.shape[1] != recipe.amax_history_len:
            history = counts = None
        scaling = self._fp8_scaling
        if (scaling is None or (scaling.recipe is not recipe and scaling.recipe != recipe)
                or getattr(scaling, "storage", None) is not history):
            scaling = LinearScaling(recipe, self.fp8_parallel_mode, history_storage=history, count_storage=counts)
            scaling.storage = history
            self._fp8_scaling = scaling
        return scaling

    def fp8_step_states(self):
        """Called once per optimizer step (`reduce_fp8_amaxes`): start the FP8 weight cache anew and return the
        delayed-scaling states whose pending amaxes are reduced now (the same number on every rank)."""
        self._fp8_step_managed = True
        self._fp8_weight_cache = None
        if self._fp8_history_recipe is not None and getattr(self, "fp8_amax_history", None) is not None:
            return self.fp8_scaling(self._fp8_history_recipe).states()
        scaling = self._fp8_scaling
        return scaling.states() if scaling is not None and scaling.recipe.is_delayed else ()

    def _fp8_weight(self, weight, scaling):
        """The weight in FP8: the gathered one (`--fp8-param-gather`), the step's cached one, or quantized now."""
        gathered = weight.__dict__.get("fp8_weight")  # a missing attribute would cost an exception per call
        if gathered is not None:
            return gathered
        with_transpose = self._fp8_keep_transpose and scaled_mm_in_use(weight.device.type)
        if not self._fp8_step_managed:
            return scaling.weight.quantize(weight, with_transpose=with_transpose)
        # A cache miss quantizes again, which reduces the amax over the tensor-parallel group under tensorwise
        # scaling: there the key leaves out the storage address, which ranks need not share.
        collective = not scaling.recipe.is_delayed and scaling.weight.sharded_over_tensor_parallel
        key = (weight._version, None if collective else weight.data_ptr(), id(scaling), scaling.weight.generation,
               with_transpose)
        cached = self._fp8_weight_cache
        if cached is not None and cached[0] == key:
            return cached[1]
        fp8_weight = scaling.weight.quantize(weight, with_transpose=with_transpose)
        self._fp8_weight_cache = (key, fp8_weight)
        return fp8_weight

    def _matmul(self, input_, weight, bias):
        region = active_fp8_region()
        if region is None:
            return _linear(input_, weight, bias, self.gradient_accumulation_fusion)
        scaling = self.fp8_scaling(region.recipe)
        return fp8_linear(
            input_,
            weight,
            bias,
            scaling,
            weight_fp8=self._fp8_weight(weight, scaling),
            accumulate_into_main_grad=self.gradient_accumulation_fusion and torch.is_grad_enabled(),
            label=self._fp8_label,
        )


# --------------------------------------------------------------------------------------------------------
# Layers
# --------------------------------------------------------------------------------------------------------


def _sharded_state_dict_with_axes(module, prefix, sharded_offsets, axes):
    from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

    state = module.state_dict(prefix="", keep_vars=True)
    return make_sharded_tensors_for_checkpoint(state, prefix, {k: v for k, v in axes.items() if k in state},
                                               sharded_offsets)


class ColumnParallelLinear(_Fp8LinearMixin, torch.nn.Module):
    """Y = XA + b with A split by columns: rank r holds output features [r*out/tp, (r+1)*out/tp).

    `forward(x) -> (output, output_bias)`; `output_bias` is the bias when `skip_bias_add` (for a later
    fused add) and None otherwise. With `gather_output` the output is all-gathered to the full width.
    With `config.sequence_parallel` the input arrives split along the sequence (dim 0) and is all-gathered
    first. `skip_weight_param_allocation` makes the layer weightless: `forward(x, weight)` then uses the
    given weight (a tied output layer reusing the embedding). An expert's linear (`is_expert`) is split over the
    expert tensor-parallel group (`--expert-tensor-parallel-size`) instead and, as upstream, communicates nothing
    under tensor or expert parallelism (the MoE token dispatcher gathers and reduces), else over that group.

    Upstream's other keywords: `keep_master_weight_for_test` keeps the full initial weight as `master_weight`;
    `tp_group` must be parallel_state's group (see `check_tensor_parallel_group`); `embedding_activation_buffer`,
    `grad_output_buffer` and `disable_grad_reduce` are refused unless left at their defaults.
    """

    fp8_parallel_mode = "column"

    def __init__(
        self,
        input_size,
        output_size,
        *,
        config,
        init_method,
        bias=True,
        gather_output=False,
        stride=1,
        skip_bias_add=False,
        skip_weight_param_allocation=False,
        is_expert=False,
        tp_comm_buffer_name=None,
        keep_master_weight_for_test=False,
        embedding_activation_buffer=None,
        grad_output_buffer=None,
        disable_grad_reduce=False,
        tp_group=None,
    ):
        super().__init__()
        check_tensor_parallel_group("ColumnParallelLinear", tp_group, is_expert)
        _refuse_upstream_only_options(
            "ColumnParallelLinear",
            embedding_activation_buffer=(embedding_activation_buffer, "the embedding weight gradient is not "
                                         "deferred (--defer-embedding-wgrad-compute); pass None"),
            grad_output_buffer=(grad_output_buffer, "the embedding weight gradient is not deferred "
                                "(--defer-embedding-wgrad-compute); pass None"),
            disable_grad_reduce=(disable_grad_reduce, "the input gradient is always all-reduced over the "
                                 "tensor-parallel group; leave it False"),
        )
        self.config = config
        self.keep_master_weight_for_test = keep_master_weight_for_test
        self.master_weight = None
        self.input_size = input_size
        self.output_size = output_size
        self.gather_output = gather_output
        self.skip_bias_add = skip_bias_add
        self.init_method = init_method
        self.stride = stride
        self.is_expert = is_expert
        _, tp_size = tensor_parallel_rank_and_size(is_expert)
        self.output_size_per_partition = divide(output_size, tp_size, "ColumnParallelLinear output_size")
        self.sequence_parallel = config.sequence_parallel and tp_size > 1
        if self.sequence_parallel and gather_output:
            raise ValueError("ColumnParallelLinear: gather_output=True cannot be used with --sequence-parallel")
        self.explicit_expert_comm = explicit_expert_communication(config, is_expert)
        if self.explicit_expert_comm and gather_output:
            raise ValueError("ColumnParallelLinear(is_expert=True) under tensor or expert parallelism leaves the "
                             "communication to the MoE token dispatcher: pass gather_output=False")
        self._comm_group = _communication_group(is_expert, tp_size)
        self.gradient_accumulation_fusion = config.gradient_accumulation_fusion
        device = _parameter_device(config)

        if skip_weight_param_allocation:
            self.weight = None
        else:
            self.weight = Parameter(
                torch.empty(self.output_size_per_partition, input_size, dtype=config.params_dtype, device=device)
            )
            set_tensor_model_parallel_attributes(self.weight, True, 0, stride)
            self.weight.allreduce = not is_expert
        if bias:
            self.bias = Parameter(torch.empty(self.output_size_per_partition, dtype=config.params_dtype, device=device))
            set_tensor_model_parallel_attributes(self.bias, True, 0, stride)
            self.bias.allreduce = not is_expert
        else:
            self.register_parameter("bias", None)
        self._init_fp8(config)
        self.reset_parameters()

    def reset_parameters(self):
        if self.weight is not None and self.config.perform_initialization:
            master = initialize_partition_from_master(
                self.weight, (self.output_size, self.input_size), self.init_method, 0, self.stride, self.is_expert
            )
            if self.keep_master_weight_for_test:
                self.master_weight = master
        _zero_(self.bias)

    def forward(self, input_, weight=None, runtime_gather_output=None):
        """-> (output, output_bias). `runtime_gather_output` (upstream's keyword) overrides `gather_output` for
        this call when not None."""
        if weight is None:
            if self.weight is None:
                raise ValueError("ColumnParallelLinear built with skip_weight_param_allocation needs "
                                 "forward(x, weight)")
            weight = self.weight
        elif tuple(weight.shape) != (self.output_size_per_partition, self.input_size):
            raise ValueError(
                f"weight of shape {tuple(weight.shape)} given; expected "
                f"{(self.output_size_per_partition, self.input_size)}"
            )
        gather_output = self.gather_output if runtime_gather_output is None else runtime_gather_output
        if gather_output and self.explicit_expert_comm:
            raise ValueError("ColumnParallelLinear(is_expert=True) under tensor or expert parallelism cannot gather "
                             "its output: pass runtime_gather_output=False")
        bias = self.bias if not self.skip_bias_add else None
        if self.is_expert:
            # Upstream's expert linears: no communication under tensor or expert parallelism, else the
            # gradient of the input is summed over the expert tensor-parallel group.
            if not self.explicit_expert_comm:
                input_ = copy_to_tensor_model_parallel_region(input_, group=self._comm_group)
            if active_fp8_region() is None:
                output_parallel = linear_with_grad_accumulation_and_async_allreduce(
                    input_, weight, bias, self.gradient_accumulation_fusion, allreduce_dgrad=False,
                    sequence_parallel=False)
            else:
                output_parallel = self._matmul(input_, weight, bias)
        elif active_fp8_region() is None:
            output_parallel = linear_with_grad_accumulation_and_async_allreduce(
                input_, weight, bias, self.gradient_accumulation_fusion,
                allreduce_dgrad=not self.sequence_parallel, sequence_parallel=self.sequence_parallel)
        else:
            if self.sequence_parallel:
                input_parallel = gather_from_sequence_parallel_region(input_, tensor_parallel_output_grad=True)
            else:
                input_parallel = copy_to_tensor_model_parallel_region(input_)
            output_parallel = self._matmul(input_parallel, weight, bias)
        if gather_output:
            output = gather_from_tensor_model_parallel_region(output_parallel, group=self._comm_group)
        else:
            output = output_parallel
        return output, (self.bias if self.skip_bias_add else None)

    def extra_repr(self):
        return (
            f"in_features={self.input_size}, out_features={self.output_size}, "
            f"out_features_per_partition={self.output_size_per_partition}, bias={self.bias is not None}, "
            f"gather_output={self.gather_output}, sequence_parallel={self.sequence_parallel}"
        )

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        """Checkpoint entries: weight and bias as this rank's rows (dim 0) of the logical tensors."""
        return _sharded_state_dict_with_axes(self, prefix, sharded_offsets, {"weight": 0, "bias": 0})


class RowParallelLinear(_Fp8LinearMixin, torch.nn.Module):
    """Y = XA + b with A split by rows: rank r holds input features [r*in/tp, (r+1)*in/tp).

    The partial products are summed over the tensor-parallel group (reduce-scattered along the sequence
    with `config.sequence_parallel`). The bias is the same on every rank (`tensor_model_parallel=False`)
    and is added after the reduction. Without `input_is_parallel` the full-width input is split first. An
    expert's linear (`is_expert`) is split over the expert tensor-parallel group instead; as upstream, under tensor
    or expert parallelism it leaves the reduction to the MoE token dispatcher (and so needs `skip_bias_add`).
    `keep_master_weight_for_test` and `tp_group` are as in `ColumnParallelLinear`.
    """

    fp8_parallel_mode = "row"

    def __init__(
        self,
        input_size,
        output_size,
        *,
        config,
        init_method,
        bias=True,
        input_is_parallel=False,
        stride=1,
        skip_bias_add=False,
        is_expert=False,
        tp_comm_buffer_name=None,
        keep_master_weight_for_test=False,
        tp_group=None,
    ):
        super().__init__()
        check_tensor_parallel_group("RowParallelLinear", tp_group, is_expert)
        self.config = config
        self.keep_master_weight_for_test = keep_master_weight_for_test
        self.master_weight = None
        self.input_size = input_size
        self.output_size = output_size
        self.input_is_parallel = input_is_parallel
        self.skip_bias_add = skip_bias_add
        self.init_method = init_method
        self.stride = stride
        self.is_expert = is_expert
        _, tp_size = tensor_parallel_rank_and_size(is_expert)
        self.input_size_per_partition = divide(input_size, tp_size, "RowParallelLinear input_size")
        self.sequence_parallel = config.sequence_parallel and tp_size > 1
        if self.sequence_parallel and not input_is_parallel:
            raise ValueError("RowParallelLinear: --sequence-parallel needs input_is_parallel=True")
        self.explicit_expert_comm = explicit_expert_communication(config, is_expert)
        self._comm_group = _communication_group(is_expert, tp_size)
        self.gradient_accumulation_fusion = config.gradient_accumulation_fusion
        device = _parameter_device(config)

        self.weight = Parameter(
            torch.empty(output_size, self.input_size_per_partition, dtype=config.params_dtype, device=device)
        )
        set_tensor_model_parallel_attributes(self.weight, True, 1, stride)
        self.weight.allreduce = not is_expert
        if bias:
            self.bias = Parameter(torch.empty(output_size, dtype=config.params_dtype, device=device))
            set_tensor_model_parallel_attributes(self.bias, False, -1, 1)
            # Under sequence parallelism each rank's bias gradient covers only its sequence chunk.
            self.bias.sequence_parallel = self.sequence_parallel
            self.bias.allreduce = not is_expert
        else:
            self.register_parameter("bias", None)
        self._init_fp8(config)
        self.reset_parameters()

    def reset_parameters(self):
        if self.config.perform_initialization:
            master = initialize_partition_from_master(
                self.weight, (self.output_size, self.input_size), self.init_method, 1, self.stride, self.is_expert
            )
            if self.keep_master_weight_for_test:
                self.master_weight = master
        _zero_(self.bias)

    def forward(self, input_):
        if self.input_is_parallel:
            input_parallel = input_
        else:
            input_parallel = scatter_to_tensor_model_parallel_region(input_, group=self._comm_group)
        if active_fp8_region() is None:
            output_parallel = linear_with_grad_accumulation_and_async_allreduce(
                input_parallel, self.weight, None, self.gradient_accumulation_fusion, allreduce_dgrad=False,
                sequence_parallel=False)
        else:
            output_parallel = self._matmul(input_parallel, self.weight, None)
        if self.explicit_expert_comm:
            if self.bias is not None and not self.skip_bias_add:
                raise ValueError("RowParallelLinear(is_expert=True) under tensor or expert parallelism leaves the "
                                 "reduction of its output to the MoE token dispatcher, so the bias must be added "
                                 "after it: build it with skip_bias_add=True (or bias=False)")
            output = output_parallel  # reduced by the MoE token dispatcher
        elif self.sequence_parallel and not self.is_expert:
            output = reduce_scatter_to_sequence_parallel_region(output_parallel)
        else:
            output = reduce_from_tensor_model_parallel_region(output_parallel, group=self._comm_group)
        if self.skip_bias_add:
            return output, self.bias
        if self.bias is not None:
            output = output + self.bias
        return output, None

    def extra_repr(self):
        return (
            f"in_features={self.input_size}, out_features={self.output_size}, "
            f"in_features_per_partition={self.input_size_per_partition}, bias={self.bias is not None}, "
            f"input_is_parallel={self.input_is_parallel}, sequence_parallel={self.sequence_parallel}"
        )

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        """Checkpoint entries: the weight as this rank's columns (dim 1) of the logical tensor, the bias whole."""
        return _sharded_state_dict_with_axes(self, prefix, sharded_offsets, {"weight": 1})


class VocabParallelEmbedding(torch.nn.Module):
    """Embedding table split along the vocabulary: rank r holds rows [r*V/tp, (r+1)*V/tp).

    Each rank looks up the ids in its range (zeros elsewhere) and the results are summed over the
    tensor-parallel group. With `reduce_scatter_embeddings` a `[b, s]` input yields `[s/tp, b, h]`:
    transposed to sequence-first and reduce-scattered along the sequence for sequence parallelism.
    """

    def __init__(self, num_embeddings, embedding_dim, *, init_method, config, reduce_scatter_embeddings=False,
                 tp_group=None):
        super().__init__()
        check_tensor_parallel_group("VocabParallelEmbedding", tp_group)
        self.config = config
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.init_method = init_method
        self.reduce_scatter_embeddings = reduce_scatter_embeddings
        tp_size = parallel_state.get_tensor_model_parallel_world_size()
        if num_embeddings % tp_size != 0:
            raise ValueError(
                f"vocabulary size {num_embeddings} is not divisible by --tensor-model-parallel-size {tp_size}; "
                "pad the vocabulary (--make-vocab-size-divisible-by) to a multiple of it"
            )
        self.num_embeddings_per_partition = num_embeddings // tp_size
        self.vocab_start_index, self.vocab_end_index = VocabUtility.vocab_range_from_global_vocab_size(
            num_embeddings, parallel_state.get_tensor_model_parallel_rank(), tp_size
        )
        self.tensor_model_parallel_size = tp_size
        device = _parameter_device(config)
        self.weight = Parameter(
            torch.empty(self.num_embeddings_per_partition, embedding_dim, dtype=config.params_dtype, device=device)
        )
        set_tensor_model_parallel_attributes(self.weight, True, 0, 1)
        self.reset_parameters()

    def reset_parameters(self):
        if self.config.perform_initialization:
            initialize_partition_from_master(
                self.weight, (self.num_embeddings, self.embedding_dim), self.init_method, 0, 1
            )

    def forward(self, input_):
        if self.tensor_model_parallel_size > 1:
            out_of_range = (input_ < self.vocab_start_index) | (input_ >= self.vocab_end_index)
            local_ids = (input_ - self.vocab_start_index).masked_fill(out_of_range, 0)
        else:
            local_ids = input_
        output_parallel = F.embedding(local_ids, self.weight)
        if self.tensor_model_parallel_size > 1:
            output_parallel = output_parallel.masked_fill(out_of_range.unsqueeze(-1), 0.0)
        if self.reduce_scatter_embeddings:
            output_parallel = output_parallel.transpose(0, 1).contiguous()
            return reduce_scatter_to_sequence_parallel_region(output_parallel)
        return reduce_from_tensor_model_parallel_region(output_parallel)

    def extra_repr(self):
        return (
            f"num_embeddings={self.num_embeddings}, embedding_dim={self.embedding_dim}, "
            f"num_embeddings_per_partition={self.num_embeddings_per_partition}"
        )

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        """Checkpoint entries: the weight as this rank's rows (dim 0, the vocabulary) of the logical table."""
        return _sharded_state_dict_with_axes(self, prefix, sharded_offsets, {"weight": 0})
