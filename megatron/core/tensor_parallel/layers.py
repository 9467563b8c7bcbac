"""Tensor-parallel layers: column- and row-parallel linear layers (the vocabulary-parallel embedding is re-exported).

Weight shapes follow Megatron: a column-parallel weight is `[output_size / tp, input_size]` (split along
dim 0), a row-parallel weight `[output_size, input_size / tp]` (split along dim 1), a vocabulary-parallel
embedding `[num_embeddings / tp, embedding_dim]`.

The rooms next door: `partitioned_parameters` (partition attributes and TP-size-independent initialisation),
`linear_function` (the GEMM and its weight-gradient accumulation), `fp8_layer_state` (FP8 scaling and weight
cache), `vocab_parallel_embedding`. Every name they define that users know from upstream is importable here too.
The linear layers look `linear_with_grad_accumulation_and_async_allreduce` up in this module on every call, so
a tool that wraps it (modelopt's Megatron plugin) replaces it here.
"""

import torch
from torch.nn.parameter import Parameter

from megatron.core import parallel_state
from megatron.core.fp8.region import active_fp8_region
from megatron.core.tensor_parallel.fp8_layer_state import _Fp8LinearMixin, _uses_torch_native_delayed_fp8
from megatron.core.tensor_parallel.linear_function import (
    LinearWithGradAccumulation,
    linear_with_grad_accumulation_and_async_allreduce,
)
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region,
)
from megatron.core.tensor_parallel.partitioned_parameters import (
    check_tensor_parallel_group,
    copy_tensor_model_parallel_attributes,
    initialize_partition_from_master,
    param_is_not_tensor_parallel_duplicate,
    parameter_device,
    set_defaults_if_not_set_tensor_model_parallel_attributes,
    set_tensor_model_parallel_attributes,
    sharded_state_dict_with_axes,
    tensor_parallel_rank_and_size,
    zero_parameter,
)
from megatron.core.tensor_parallel.utils import divide
from megatron.core.tensor_parallel.vocab_parallel_embedding import VocabParallelEmbedding

__all__ = [  # the layers defined here and the names users import from this module since before the split
    "ColumnParallelLinear",
    "LinearWithGradAccumulation",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "_Fp8LinearMixin",
    "_uses_torch_native_delayed_fp8",
    "check_tensor_parallel_group",
    "copy_tensor_model_parallel_attributes",
    "explicit_expert_communication",
    "initialize_partition_from_master",
    "linear_with_grad_accumulation_and_async_allreduce",
    "param_is_not_tensor_parallel_duplicate",
    "set_defaults_if_not_set_tensor_model_parallel_attributes",
    "set_tensor_model_parallel_attributes",
    "tensor_parallel_rank_and_size",
]


def explicit_expert_communication(config, is_expert):
    """As upstream: an expert's linear under tensor or expert parallelism does no communication of its own (the
    MoE token dispatcher gathers its input and reduces its output), so it must leave its bias to the caller."""
    return is_expert and (config.tensor_model_parallel_size > 1 or config.expert_model_parallel_size > 1)


def _communication_group(is_expert, tp_size):
    """The group a linear's activations are exchanged over: the expert tensor-parallel group for an expert's
    linear (None, meaning the tensor-parallel group, otherwise or when the split is over one rank)."""
    return parallel_state.get_expert_tensor_parallel_group() if is_expert and tp_size > 1 else None


def _refuse_upstream_only_options(layer_name, **options):
    """Upstream keywords whose non-default values (None or False) have no implementation here: refused by name."""
    for name, (value, instead) in options.items():
        if value is not None and value is not False:
            raise ValueError(f"{layer_name}({name}=...) is not supported here: {instead}")


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
        device = parameter_device(config)

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
        zero_parameter(self.bias)

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
        return sharded_state_dict_with_axes(self, prefix, sharded_offsets, {"weight": 0, "bias": 0})


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
        device = parameter_device(config)

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
        zero_parameter(self.bias)

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
        return sharded_state_dict_with_axes(self, prefix, sharded_offsets, {"weight": 1})
