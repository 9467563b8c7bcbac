"""The Mamba-2 mixer: input projection, causal depthwise convolution, selective scan, gated RMS norm, output
projection.

With inner width D = heads x head_dim, G groups and state size N, the input projection gives per group g (of heads
h_g = heads / G): the gate z_g (D / G), the scan input x_g (D / G), B_g and C_g (N each) and dt_g (h_g). x, B and C
go through a causal depthwise convolution of width `mamba_conv_kernel` and SiLU; each head scans with dt =
softplus(dt + dt_bias) (clamped to `mamba_dt_limit`), A = -exp(A_log) and the skip D (`ssd_scan`); the output is
normalised per group after gating, RMSNorm(y * silu(z)), and projected back to the hidden size.

Tensor parallelism splits the mixer by groups (`--mamba-num-groups` a multiple of the TP size): the input
projection is column-parallel, the output projection row-parallel, and every per-channel parameter is cut the
same way. The rows of the input projection, the convolution's channels and the per-head parameters are laid out
group after group (`[z_0, x_0, B_0, C_0, dt_0, z_1, ...]`), so a tensor-parallel rank's contiguous slice holds whole
groups: the full layout is the same at every TP size and TP=2 reproduces TP=1 from the same initialisation (as the
gated MLP's interleaved fc1, see `mlp.py`). Under sequence parallelism the input projection gathers the sequence
and the output projection scatters it again; the convolution and the scan see whole sequences. On a packed row
(upstream's `packed_seq_params`) each sequence is convolved and scanned on its own. Under context parallelism an
all-to-all gives each rank every rank's tokens for its share of the groups, so it scans whole sequences, and a
second one returns each rank its tokens with all groups.
"""

import math

import torch
import torch.nn.functional as F

from megatron.core import parallel_state, tensor_parallel
from megatron.core.packed_sequences import sequence_rows, thd_local_indices
from megatron.core.ssm.ssd_scan import ssd_chunked_scan
from megatron.core.tensor_parallel.partitioned_parameters import initialize_partition_from_master
from megatron.core.transformer.context_parallel.allgather_attention import global_positions_in_rank_order
from megatron.core.transformer.context_parallel.collectives import HeadsToSequence, SequenceToHeads
from megatron.core.transformer.init_seeds import build_with_init_seed, derive_init_seed, initialization_rng
from megatron.core.transformer.utils import parameter_device

# Initial values, as the Mamba-2 reference: A drawn from [1, 16], dt from a log-uniform [1e-3, 0.1] floored at 1e-4.
A_INIT_RANGE = (1.0, 16.0)
DT_MIN, DT_MAX, DT_FLOOR = 1e-3, 0.1, 1e-4
GATED_NORM_EPS = 1e-5


def _init_a_log(master):
    master.uniform_(*A_INIT_RANGE).log_()


def _init_dt_bias(master):
    """The inverse softplus of dt drawn log-uniformly in [DT_MIN, DT_MAX] (floored), so softplus(dt_bias) = dt."""
    dt = torch.exp(torch.rand_like(master) * (math.log(DT_MAX) - math.log(DT_MIN)) + math.log(DT_MIN))
    dt = dt.clamp(min=DT_FLOOR)
    master.copy_(dt + torch.log(-torch.expm1(-dt)))


def _init_conv(bound):
    def init(master):
        master.uniform_(-bound, bound)

    return init


def packed_spans(packed_seq_params, length, batch):
    """[(start, end)] rows of each packed sequence's span in a packed row of `length` tokens, covering the row."""
    if batch != 1:
        raise ValueError(f"packed sequences come as one row (batch 1, the 'thd' layout); got a batch of {batch}")
    starts = [start for start, _ in sequence_rows(packed_seq_params, length)]
    return list(zip(starts, starts[1:] + [length]))


class MambaMixer(torch.nn.Module):
    """`forward(hidden_states [s, b, h]) -> (output [s, b, h], None)` (the bias slot of upstream's sublayers; the
    projections have no bias). Args: config (a `TransformerConfig` with the `mamba_*` fields), layer_number
    (1-based, global), init_seed: the owning layer's seed; each parameter draws from a seed derived from it."""

    def __init__(self, config, layer_number: int, init_seed: int):
        super().__init__()
        self.config = config
        self.layer_number = layer_number
        self.init_seed = init_seed
        tp = parallel_state.get_tensor_model_parallel_world_size()
        self.heads, self.head_dim = config.mamba_heads, config.mamba_head_dim
        self.groups, self.state_dim = config.mamba_num_groups, config.mamba_state_dim
        self.inner = self.heads * self.head_dim
        self.local_groups = self.groups // tp
        self.heads_per_group = self.heads // self.groups
        self.inner_per_group = self.inner // self.groups
        # One group's rows of the input projection: z, x, B, C, dt.
        self.group_rows = 2 * self.inner_per_group + 2 * self.state_dim + self.heads_per_group
        self.conv_channels_per_group = self.inner_per_group + 2 * self.state_dim
        self.in_proj = build_with_init_seed(derive_init_seed(init_seed, "mixer.in_proj"), lambda: (
            tensor_parallel.ColumnParallelLinear(config.hidden_size, self.groups * self.group_rows, config=config,
                                                 init_method=config.init_method, bias=False, gather_output=False)))
        self.out_proj = build_with_init_seed(derive_init_seed(init_seed, "mixer.out_proj"), lambda: (
            tensor_parallel.RowParallelLinear(self.inner, config.hidden_size, config=config,
                                              init_method=config.output_layer_init_method, bias=False,
                                              input_is_parallel=True)))
        device, dtype = parameter_device(config), config.params_dtype
        local_heads, local_inner = self.local_groups * self.heads_per_group, self.local_groups * self.inner_per_group
        local_channels = self.local_groups * self.conv_channels_per_group

        def parameter(*shape):
            param = torch.nn.Parameter(torch.empty(*shape, dtype=dtype, device=device))
            tensor_parallel.set_tensor_model_parallel_attributes(param, True, 0, 1)
            return param

        # Upstream's parameter names: conv1d.weight / conv1d.bias, A_log, D, dt_bias, norm.weight.
        self.conv1d = torch.nn.Module()
        self.conv1d.weight = parameter(local_channels, 1, config.mamba_conv_kernel)
        self.conv1d.bias = parameter(local_channels)
        self.A_log = parameter(local_heads)
        self.D = parameter(local_heads)
        self.dt_bias = parameter(local_heads)
        self.norm = torch.nn.Module()
        self.norm.weight = parameter(local_inner)
        self.reset_parameters()

    def _full_shapes(self):
        kernel = self.config.mamba_conv_kernel
        channels = self.groups * self.conv_channels_per_group
        bound = 1.0 / math.sqrt(kernel)  # torch's Conv1d default for a depthwise kernel (fan-in = kernel)
        return {"conv1d.weight": ((channels, 1, kernel), _init_conv(bound)),
                "conv1d.bias": ((channels,), _init_conv(bound)),
                "A_log": ((self.heads,), _init_a_log), "D": ((self.heads,), torch.nn.init.ones_),
                "dt_bias": ((self.heads,), _init_dt_bias), "norm.weight": ((self.inner,), torch.nn.init.ones_)}

    def reset_parameters(self):
        """Draw this mixer's own parameters (the projections draw theirs): each from the full tensor under its
        own seed, this rank keeping its groups' slice."""
        if not self.config.perform_initialization:
            return
        for name, (shape, init) in self._full_shapes().items():
            with initialization_rng(derive_init_seed(self.init_seed, "mixer", name)):
                initialize_partition_from_master(self.get_parameter(name), shape, init, 0)

    def _causal_conv(self, xbc, weight, bias, prefix=None):
        """Depthwise causal convolution over the sequence, then SiLU: [s, b, c] -> ([b, s, c], the last
        kernel - 1 inputs [kernel - 1, b, c]). `prefix`: the inputs before these (zeros: a sequence's start)."""
        if prefix is None:
            prefix = xbc.new_zeros(self.config.mamba_conv_kernel - 1, *xbc.shape[1:])
        inputs = torch.cat([prefix.to(xbc.dtype), xbc], dim=0)
        out = F.conv1d(inputs.permute(1, 2, 0), weight, bias, groups=xbc.shape[2])
        return F.silu(out).transpose(1, 2), inputs[inputs.shape[0] - prefix.shape[0]:]

    def _state_shapes(self, channels):
        """(convolution state, scan state) shapes of one sequence: [kernel - 1, c], [heads, head_dim, state]."""
        local_heads = self.local_groups * self.heads_per_group
        return (self.config.mamba_conv_kernel - 1, channels), (local_heads, self.head_dim, self.state_dim)

    def decoding_state_bytes(self, dtype) -> int:
        """Bytes of one sequence's decoding state on this rank: its last convolution inputs (in `dtype`, the
        activations') and its fp32 scan state."""
        conv_shape, ssm_shape = self._state_shapes(self.local_groups * self.conv_channels_per_group)
        return (math.prod(conv_shape) * torch.empty(0, dtype=dtype).element_size()
                + math.prod(ssm_shape) * torch.empty(0, dtype=torch.float32).element_size())

    def _decoding_spans(self, inference_context, xbc):
        """(spans, their states to continue from, a function keeping their new states) of a decoding step: the
        static context's batch as one span (a state per row), or the dynamic context's requests, one span each."""
        conv_shape, ssm_shape = self._state_shapes(xbc.shape[2])
        if getattr(inference_context, "is_dynamic_batching", lambda: False)():
            spans = inference_context.step_spans()
            states = [inference_context.request_mamba_states(self.layer_number, request_id, conv_shape, ssm_shape,
                                                             xbc.dtype, xbc.device)
                      for request_id, _ in inference_context.step_entries]

            def keep(final_states):
                for (request_id, _), (conv_state, ssm_state) in zip(inference_context.step_entries, final_states):
                    inference_context.store_request_mamba_states(self.layer_number, request_id, conv_state[:, 0],
                                                                 ssm_state[0])

            return spans, [(conv[:, None], ssm[None]) for conv, ssm in states], keep
        if not (hasattr(inference_context, "mamba_states") and inference_context.is_static_batching()):
            raise NotImplementedError(f"{type(inference_context).__name__}: Mamba layers decode through a "
                                      "StaticInferenceContext or a DynamicInferenceContext")
        conv_state, ssm_state = inference_context.mamba_states(self.layer_number, xbc.shape[1], conv_shape,
                                                               ssm_shape, xbc.dtype, xbc.device)

        def keep(final_states):
            conv_tail, final = final_states[0]
            inference_context.store_mamba_states(self.layer_number, conv_tail.transpose(0, 1), final)

        return [(0, xbc.shape[0])], [(conv_state.transpose(0, 1), ssm_state)], keep

    def _scan_groups(self, xbc_dt, first_group, spans, inference_context):
        """Convolution and scan of whole sequences for `groups` consecutive groups from this rank's group
        `first_group`: xbc_dt `[s, b, groups, conv channels + dt]` -> y `[s, b, groups, inner / G]` fp32 (the
        skip term included). Each span starts from a zero state, or with `inference_context` from the state the
        context kept for it (and keeps its new one)."""
        seq, batch, groups = xbc_dt.shape[:3]
        heads = groups * self.heads_per_group
        channels = slice(first_group * self.conv_channels_per_group,
                         (first_group + groups) * self.conv_channels_per_group)
        head_rows = slice(first_group * self.heads_per_group, first_group * self.heads_per_group + heads)
        xbc, dt = xbc_dt.split([self.conv_channels_per_group, self.heads_per_group], -1)
        xbc, dt = xbc.reshape(seq, batch, -1), dt.reshape(seq, batch, -1)
        states, keep = [(None, None)] * len(spans), None
        if inference_context is not None:
            spans, states, keep = self._decoding_spans(inference_context, xbc)
        weight, bias = self.conv1d.weight[channels], self.conv1d.bias[channels]
        convolved = [self._causal_conv(xbc[start:end], weight, bias, prefix)
                     for (start, end), (prefix, _) in zip(spans, states)]
        xbc = torch.cat([out for out, _ in convolved], dim=1).reshape(batch, seq, groups, -1)
        x, B, C = xbc.split([self.inner_per_group, self.state_dim, self.state_dim], -1)
        x = x.reshape(batch, seq, heads, self.head_dim)
        # Each head reads its group's B and C.
        B = B.repeat_interleave(self.heads_per_group, dim=2)
        C = C.repeat_interleave(self.heads_per_group, dim=2)
        dt = F.softplus(dt.transpose(0, 1).float() + self.dt_bias[head_rows].float())  # [b, s, heads]
        low, high = self.config.mamba_dt_limit
        if low > 0.0 or high < math.inf:
            dt = dt.clamp(low, high)
        A = -torch.exp(self.A_log[head_rows].float())
        scanned = [ssd_chunked_scan(x[:, start:end], dt[:, start:end], A, B[:, start:end], C[:, start:end],
                                    self.config.mamba_chunk_size, initial) for (start, end), (_, initial)
                   in zip(spans, states)]
        y = torch.cat([out for out, _ in scanned], dim=1)
        if keep is not None:
            keep([(conv_tail, final) for (_, conv_tail), (_, final) in zip(convolved, scanned)])
        y = y.float() + x.float() * self.D[head_rows].float()[:, None]
        return y.reshape(batch, seq, groups, self.inner_per_group).transpose(0, 1)

    def _gated_norm(self, y, z):
        """RMSNorm(y * silu(z)) over each group's channels, times the norm weight; [b, s, local_inner]."""
        gated = (y * F.silu(z.float())).reshape(*y.shape[:2], self.local_groups, self.inner_per_group)
        normed = gated * torch.rsqrt(gated.pow(2).mean(-1, keepdim=True) + GATED_NORM_EPS)
        return normed.reshape(y.shape) * self.norm.weight.float()

    def _scan_across_context_parallel_ranks(self, xbc_dt, packed_seq_params):
        """Under context parallelism: gather every rank's tokens of this rank's share of the groups (all-to-all),
        scan the whole sequences, and send each rank its tokens back with all groups."""
        group = parallel_state.get_context_parallel_group()
        cp_size, cp_rank = parallel_state.get_context_parallel_world_size(), parallel_state.get_context_parallel_rank()
        if self.local_groups % cp_size:
            raise ValueError(f"the {self.local_groups} Mamba groups of a tensor-parallel rank must divide into "
                             f"--context-parallel-size {cp_size}: raise --mamba-num-groups")
        seq, batch = xbc_dt.shape[:2]
        total = seq * cp_size
        if packed_seq_params is None:
            positions = global_positions_in_rank_order(total, cp_size, xbc_dt.device)
            spans = [(0, total)]
        else:
            positions = torch.cat([thd_local_indices(packed_seq_params, total, cp_size, rank)
                                   for rank in range(cp_size)]).to(xbc_dt.device)
            spans = packed_spans(packed_seq_params, total, batch)
        gathered = SequenceToHeads.apply(xbc_dt.contiguous(), group).index_select(0, torch.argsort(positions))
        groups = self.local_groups // cp_size
        y = self._scan_groups(gathered, cp_rank * groups, spans, None)
        return HeadsToSequence.apply(y.index_select(0, positions).contiguous(), group)

    def forward(self, hidden_states, packed_seq_params=None, inference_context=None):
        """`packed_seq_params`: a packed row (`[t, 1, h]`) whose sequences each convolve and scan from a zero
        state, as if alone (each span from a sequence's start to the next one's, its padding included).
        `inference_context` (a `StaticInferenceContext`): continue each row from the state the context kept after
        the previous positions, and keep the new one."""
        projected, _ = self.in_proj(hidden_states)
        seq, batch = projected.shape[:2]
        per_group = projected.reshape(seq, batch, self.local_groups, self.group_rows)
        z, xbc_dt = per_group.split([self.inner_per_group, self.group_rows - self.inner_per_group], -1)
        if self.config.context_parallel_size > 1:
            y = self._scan_across_context_parallel_ranks(xbc_dt, packed_seq_params)
        else:
            spans = [(0, seq)] if packed_seq_params is None else packed_spans(packed_seq_params, seq, batch)
            y = self._scan_groups(xbc_dt, 0, spans, inference_context)
        y = self._gated_norm(y.reshape(seq, batch, -1).transpose(0, 1), z.reshape(seq, batch, -1).transpose(0, 1))
        out, _ = self.out_proj(y.to(hidden_states.dtype).transpose(0, 1).contiguous())
        return out, None
