"""The experts of one MoE layer on one expert-parallel rank.

Every implementation holds the same parameters: `local_experts.{j}` is an `MLP` (fc1 column-parallel, fc2
row-parallel, built with `is_expert=True`, so their parameters are marked `allreduce = False`) for the expert
of global index `ep_rank * num_local_experts + j`. Its initial weights come from a seed derived from the layer's
seed and that global index alone, so any expert-parallel size builds the same experts. Each expert parameter
carries `expert_global_index` and `num_local_experts`, and so do the experts' tensor buffers (FP8 amax
histories), which checkpoints therefore name by global expert index as well.

Under `--moe-latent-size` the experts work in the latent width: fc1 reads latent-width tokens and fc2 writes
them (the layer projects the tokens down before dispatch and back up after the combine, see `latent_projection`).

The experts' linears are split over the expert tensor-parallel group (`--expert-tensor-parallel-size`, default
the tensor-parallel size; 1 keeps each expert whole on its rank), not the dense layers' tensor-parallel group.
The experts take tokens already dispatched to this rank, sorted by local expert (`tokens_per_expert` rows each),
and return each row's expert output before the routing probability is applied. The dispatcher gathered the
tokens of the whole expert tensor-parallel group, so the linears run without their own tensor-parallel
communication: fc2's output is this rank's partial sum, which the dispatcher's combine reduces. fc2's bias is
added on expert tensor-parallel rank 0 only (once in that sum), and its gradient is the full one on every rank.

- `SequentialMLP`: one matmul pair per expert.
- `GroupedMLP` (`--moe-grouped-gemm`): torch's grouped GEMM (`torch.nn.functional.grouped_mm`) over all local
  experts where the device and dtype support it, else the per-expert loop.
- `TEGroupedMLP`: the name Transformer Engine builds use; it needs transformer-engine and computes like
  `GroupedMLP`.

FP8 (`--fp8-format`): inside the layer's FP8 region every expert's GEMMs go through its linear layers' FP8 path
(`_Fp8LinearMixin._matmul`: scaling states, the step's cached FP8 weight, the weight gathered by
`--fp8-param-gather`), one expert after the other (`GroupedMLP` too: torch's grouped GEMM takes no float8
operands). Tensor-parallel ranks of one expert run the same experts on the same gathered tokens, so the
tensor-parallel amax reductions of current scaling line up (FP8 therefore needs the expert tensor-parallel size
to equal the tensor-parallel size). Under delayed scaling each expert's amaxes are
reduced by its global index (`fp8_step_states_by_global_expert`), so an expert's scales do not depend on the
expert-parallel size.

Selective `--recompute-modules moe_act` keeps neither the activation's output (fc2's input) nor what the
activation saves: backward recomputes them from fc1's output (`output_recomputed_in_backward`).
"""

import dataclasses
import functools

import torch
import torch.nn.functional as F

from megatron.core import parallel_state
from megatron.core.activations import gated_linear_unit
from megatron.core.fp8.region import active_fp8_region
from megatron.core.offloading.activations import keep_on_device
from megatron.core.offloading.fine_grained import offloaded_saved_tensors
from megatron.core.optional_deps import HAVE_TE
from megatron.core.transformer.init_seeds import derive_init_seed, resolve_base_init_seed
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.recompute import output_recomputed_in_backward


def expert_init_seed(layer_init_seed, global_expert_index):
    return derive_init_seed(layer_init_seed, "mlp.experts", global_expert_index)


def _expert_token_width(config):
    """The config fields that give the experts their token width: the latent width under `--moe-latent-size`
    (their fc1 reads it, their fc2 writes it), else nothing to change. A hybrid model's Mamba head count, which
    defaults to one derived from the hidden size, is pinned so that the narrower width does not change it."""
    if config.moe_latent_size is None:
        return {}
    fields = {"hidden_size": config.moe_latent_size}
    if hasattr(config, "mamba_heads"):
        fields["mamba_num_heads"] = config.mamba_heads
    return fields


def _tensor_parallel_rank():
    """This rank's position in the experts' tensor-parallel group (`--expert-tensor-parallel-size`)."""
    return parallel_state.get_expert_tensor_parallel_rank()


class _BiasOnceOverPartialSums(torch.autograd.Function):
    """`partial + bias` on the rank that adds it (`add`), `partial` elsewhere; the bias gradient is the full
    sum of the output gradient on every rank (the combine's backward hands every rank the same gradient)."""

    @staticmethod
    def forward(ctx, partial, bias, add):
        ctx.bias_shape = bias.shape
        return partial + bias if add else partial.clone()

    @staticmethod
    def backward(ctx, grad_output):
        return grad_output, grad_output.reshape(-1, ctx.bias_shape[0]).sum(dim=0), None


def _activate(config, intermediate):
    """The MLP's activation (gated: fc1's rows interleave gate and up per unit)."""
    if config.gated_linear_unit:
        return gated_linear_unit(config, intermediate)
    return config.activation_func(intermediate)


def _activate_then(config, intermediate, recompute, consumer, offload_context):
    """`consumer(activation(intermediate))`, the activation under `offload_context` (`--offload-modules moe_act`);
    with `recompute` the activation's output is not kept for backward (offloading excludes recompute)."""
    if not recompute:
        with offload_context:
            activated = _activate(config, intermediate)
        return consumer(activated)
    activated, consumer_context = output_recomputed_in_backward(functools.partial(_activate, config), intermediate)
    with consumer_context:
        return consumer(activated)


class SequentialMLP(torch.nn.Module):
    """Args, in upstream's order: num_local_experts; config (a MoE `TransformerConfig`); submodules: upstream's
    `MLPSubmodules` (the config picks the linears here; accepted and not read); pg_collection: must be None (the
    groups come from `parallel_state`). Keyword-only: layer_init_seed, the owning layer's seed (default: the
    config's base seed, as `MoELayer` without one); first_global_index, the global index of local expert 0
    (default: this rank's expert-parallel rank x num_local_experts)."""

    def __init__(self, num_local_experts, config, submodules=None, pg_collection=None, *, layer_init_seed=None,
                 first_global_index=None):
        super().__init__()
        if pg_collection is not None:
            raise ValueError(f"{type(self).__name__}(pg_collection=...) is not supported: the process groups come "
                             "from parallel_state.initialize_model_parallel; drop pg_collection")
        if isinstance(submodules, int):
            raise ValueError(f"{type(self).__name__}'s third argument is upstream's submodules: pass the seed as "
                             f"layer_init_seed={submodules}")
        if layer_init_seed is None:
            layer_init_seed = resolve_base_init_seed(config)
        if first_global_index is None:
            ep_rank = (parallel_state.get_expert_model_parallel_rank()
                       if parallel_state.model_parallel_is_initialized() else 0)
            first_global_index = ep_rank * num_local_experts
        self.config = config
        self.num_local_experts = num_local_experts
        self.num_global_experts = config.num_moe_experts
        self.first_global_index = first_global_index
        # The experts are plain torch-native MLPs of width moe_ffn_hidden_size (the dispatcher communicates).
        self.expert_config = dataclasses.replace(config, ffn_hidden_size=config.moe_ffn_hidden_size,
                                                 transformer_impl="local", **_expert_token_width(config))
        self.local_experts = torch.nn.ModuleList()
        for local_index in range(num_local_experts):
            global_index = first_global_index + local_index
            expert = MLP(self.expert_config, init_seed=expert_init_seed(layer_init_seed, global_index),
                         is_expert=True)
            for param in expert.parameters():
                param.expert_global_index = global_index
                param.num_local_experts = num_local_experts
            if expert.linear_fc2.bias is not None:
                # Every rank computes this bias's full gradient (see _BiasOnceOverPartialSums): no sum over TP.
                expert.linear_fc2.bias.sequence_parallel = False
            self.local_experts.append(expert)
        self._mark_expert_buffers()

    def _mark_expert_buffers(self):
        """Give the experts' tensor buffers (FP8 amax histories) the expert marks of their parameters, so that
        checkpoints name them by global expert index too. Buffers are new tensors after a dtype or device move,
        hence again after every `_apply`."""
        for local_index, expert in enumerate(self.local_experts):
            for buffer in expert.buffers():
                buffer.allreduce = False
                buffer.expert_global_index = self.first_global_index + local_index
                buffer.num_local_experts = self.num_local_experts

    def _apply(self, fn, recurse=True):
        result = super()._apply(fn, recurse)
        self._mark_expert_buffers()
        return result

    def _fc2_bias(self, partial, expert):
        bias = expert.linear_fc2.bias
        if bias is None:
            return partial
        return _BiasOnceOverPartialSums.apply(partial, bias, _tensor_parallel_rank() == 0)

    def _expert_forward(self, expert, tokens):
        # The linears' GEMM without their tensor-parallel communication (the dispatcher does it): in FP8 inside
        # an FP8 region, else the plain GEMM (with gradient-accumulation fusion where configured).
        # `--offload-modules expert_fc1 / moe_act` offload what fc1 and the activation save.
        fc1, fc2 = expert.linear_fc1, expert.linear_fc2
        with offloaded_saved_tensors(self, "expert_fc1"):
            intermediate = fc1._matmul(tokens, fc1.weight, fc1.bias)
        partial = _activate_then(self.expert_config, intermediate, self._recompute_activation(),
                                 lambda activated: fc2._matmul(activated, fc2.weight, None),
                                 offloaded_saved_tensors(self, "moe_act"))
        return self._fc2_bias(partial, expert)

    def _recompute_activation(self):
        return self.training and self.config.recomputes("moe_act")

    def fp8_step_states_by_global_expert(self):
        """Once per optimizer step (`reduce_fp8_amaxes`): every local expert's FP8 step states (its linears'
        `fp8_step_states()`, which also start their weight caches anew), placed at the expert's global index.
        Returns one entry per state of each of the layer's `num_global_experts` experts, None where the expert
        lives on another expert-parallel rank, so that the amaxes of one expert meet in the same position on
        every rank whatever the expert-parallel size."""
        local_states = [[state for linear in (expert.linear_fc1, expert.linear_fc2)
                         for state in linear.fp8_step_states()] for expert in self.local_experts]
        per_expert = len(local_states[0]) if local_states else 0
        slots = []
        for global_index in range(self.num_global_experts):
            local_index = global_index - self.first_global_index
            if 0 <= local_index < self.num_local_experts:
                slots.extend(local_states[local_index])
            else:
                slots.extend([None] * per_expert)
        return slots

    def forward(self, tokens, tokens_per_expert):
        """`tokens` [sum(tokens_per_expert), h] sorted by local expert -> the experts' outputs, same shape."""
        counts = [int(count) for count in tokens_per_expert]
        if len(counts) != self.num_local_experts or sum(counts) != tokens.size(0):
            raise ValueError(f"tokens_per_expert {counts} does not match {self.num_local_experts} local experts and "
                             f"{tokens.size(0)} tokens")
        outputs = [self._expert_forward(expert, chunk)
                   for expert, chunk in zip(self.local_experts, torch.split(tokens, counts))]
        return torch.cat(outputs) if outputs else tokens.new_empty(tokens.shape)


_GROUPED_MM_SUPPORT = {}


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the incoming gradient contiguous (grouped GEMM's backward rejects the
    expanded gradients that, for example, a `.sum()` produces)."""

    @staticmethod
    def forward(ctx, tensor):
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad_output):
        return grad_output.contiguous()


def _grouped_mm(tokens, weights, offsets):
    return _ContiguousGrad.apply(F.grouped_mm(tokens, weights, offs=offsets))


def _kept(tensor):
    return tensor


def grouped_mm_supported(device, dtype):
    """Whether torch's grouped GEMM runs (forward and backward) on this device type and dtype; probed once.

    The probe's graph keeps its own saved tensors: the first call may come inside a checkpointed (recomputed) or
    activation-offloaded forward, whose saved-tensor hooks must not take the probe's tensors (its backward
    would recompute the enclosing chunk in the middle of its forward)."""
    key = (torch.device(device).type, dtype)
    if key not in _GROUPED_MM_SUPPORT:
        supported = hasattr(F, "grouped_mm")
        if supported:
            try:
                with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(_kept, _kept):
                    tokens = torch.ones(8, 16, device=device, dtype=dtype, requires_grad=True)
                    weights = torch.ones(2, 16, 16, device=device, dtype=dtype, requires_grad=True)
                    offsets = torch.tensor([3, 8], device=device, dtype=torch.int32)
                    _grouped_mm(tokens, weights, offsets).sum().backward()
            except (RuntimeError, NotImplementedError, TypeError):
                supported = False
        _GROUPED_MM_SUPPORT[key] = supported
    return _GROUPED_MM_SUPPORT[key]


def _aligned_for_grouped_mm(tensor, *widths):
    """Grouped GEMM needs 16-byte aligned row strides."""
    return all((width * tensor.element_size()) % 16 == 0 for width in widths)


class GroupedMLP(SequentialMLP):
    """`SequentialMLP`'s parameters, computed with one grouped GEMM per linear over all local experts."""

    def uses_grouped_gemm(self, tokens):
        first = self.local_experts[0]
        fc1_out, hidden = first.linear_fc1.weight.shape
        fc2_in = first.linear_fc2.weight.shape[1]
        return (tokens.size(0) > 0 and grouped_mm_supported(tokens.device, tokens.dtype)
                and _aligned_for_grouped_mm(tokens, hidden, fc1_out, fc2_in))

    def forward(self, tokens, tokens_per_expert):
        if active_fp8_region() is not None or not self.uses_grouped_gemm(tokens):
            return super().forward(tokens, tokens_per_expert)
        counts = torch.as_tensor([int(count) for count in tokens_per_expert], dtype=torch.int64)
        if counts.numel() != self.num_local_experts or int(counts.sum()) != tokens.size(0):
            raise ValueError(f"tokens_per_expert {counts.tolist()} does not match {self.num_local_experts} local "
                             f"experts and {tokens.size(0)} tokens")
        config = self.expert_config
        offsets = torch.cumsum(counts, 0).to(device=tokens.device, dtype=torch.int32)
        experts = list(self.local_experts)
        fc1 = keep_on_device(torch.stack([expert.linear_fc1.weight.t() for expert in experts]))
        expert_of_row = torch.repeat_interleave(torch.arange(len(experts), device=tokens.device),
                                                counts.to(tokens.device))
        with offloaded_saved_tensors(self, "expert_fc1"):  # the stacked weights stay (keep_on_device)
            intermediate = _grouped_mm(tokens, fc1, offsets)
            if experts[0].linear_fc1.bias is not None:
                fc1_biases = torch.stack([expert.linear_fc1.bias for expert in experts])
                intermediate = _RowBias.apply(intermediate, fc1_biases, expert_of_row, True)
        fc2 = torch.stack([expert.linear_fc2.weight.t() for expert in experts])
        partial = _activate_then(config, intermediate, self._recompute_activation(),
                                 lambda activated: _grouped_mm(activated, fc2, offsets),
                                 offloaded_saved_tensors(self, "moe_act"))
        if experts[0].linear_fc2.bias is None:
            return partial
        biases = torch.stack([expert.linear_fc2.bias for expert in experts])
        return _RowBias.apply(partial, biases, expert_of_row, _tensor_parallel_rank() == 0)


class _RowBias(torch.autograd.Function):
    """Row i gets `biases[expert_of_row[i]]` where `add` (else the rows pass unchanged: fc2's bias over partial
    sums, see `_BiasOnceOverPartialSums`); each bias's gradient is the sum of its rows' gradients on every rank.

    The sum is an `index_add`, which adds the rows in order whatever the thread count. Autograd's own backward
    of `biases[expert_of_row]` (an accumulating `index_put_`) spreads atomic adds over the intra-op threads on
    CPU once the rows hold 32768 elements or more: its fp32 sum would depend on thread timing."""

    @staticmethod
    def forward(ctx, partial, biases, expert_of_row, add):
        ctx.save_for_backward(expert_of_row)
        ctx.num_experts = biases.size(0)
        return partial + biases[expert_of_row] if add else partial.clone()

    @staticmethod
    def backward(ctx, grad_output):
        (expert_of_row,) = ctx.saved_tensors
        grad_biases = grad_output.new_zeros(ctx.num_experts, grad_output.size(-1)).index_add(0, expert_of_row,
                                                                                            grad_output)
        return grad_output, grad_biases, None, None


class TEGroupedMLP(GroupedMLP):
    """The expert module of Transformer Engine builds (`--transformer-impl transformer_engine --moe-grouped-gemm`);
    same parameters and computation as `GroupedMLP`."""

    def __init__(self, num_local_experts, config, submodules=None, pg_collection=None, *, layer_init_seed=None,
                 first_global_index=None):
        if not HAVE_TE:
            raise ValueError("TEGroupedMLP needs transformer-engine, which is not installed (it needs CUDA): use "
                             "--transformer-impl local, whose --moe-grouped-gemm builds GroupedMLP")
        super().__init__(num_local_experts, config, submodules, pg_collection, layer_init_seed=layer_init_seed,
                         first_global_index=first_global_index)


def build_experts(config, layer_init_seed, num_local_experts, first_global_index):
    """The expert module the config asks for."""
    if not config.moe_grouped_gemm:
        cls = SequentialMLP
    elif config.transformer_impl == "transformer_engine":
        cls = TEGroupedMLP
    else:
        cls = GroupedMLP
    return cls(num_local_experts, config, layer_init_seed=layer_init_seed, first_global_index=first_global_index)
