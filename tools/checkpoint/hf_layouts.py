"""Tensor layouts both directions share: our logical tensor names, the fused QKV and SwiGLU rows split into HF's
projections and joined again, the q / k channel order of --rotary-interleaved, the Mamba mixer's rows and
channels in HF's order and ours, and a source of named tensors that reports what is missing or misshapen.

Our fused layouts (megatron/core/transformer/attention.py, mlp.py): linear_qkv's rows are `[groups, (q_0 ..
q_{m-1} | k | v), head_dim]` with m query heads per group, query head g * m + j being group g's j-th; SwiGLU's
linear_fc1 rows interleave gate and up per unit, `[gate_0, up_0, gate_1, up_1, ...]`. The Mamba mixer's
(megatron/core/ssm/mamba_mixer.py) in_proj rows and conv1d channels go group after group, `[z_g, x_g, B_g, C_g,
dt_g]` and `[x_g, B_g, C_g]` for g = 0 .. G - 1, where HF's go kind after kind, `[z, x, B, C, dt]` and `[x, B, C]`
(each kind's rows group after group within it).
"""

from typing import Dict

import torch

from hf_errors import ConversionError
from hf_shape import ModelShape

WORD_EMBEDDING, POSITION_EMBEDDING, OUTPUT_LAYER = (
    "embedding.word_embeddings.weight", "embedding.position_embeddings.weight", "output_layer.weight")
# Extras (megatron_extras.safetensors) kept under our name plus a suffix: the vocabulary padding rows of a table,
# and FP8 delayed-scaling buffers under their own names.
PADDING_SUFFIX = ".vocab_padding"
FP8_BUFFER_SUFFIXES = (".fp8_amax_history", ".fp8_amax_recorded_count")


def split_qkv(fused: torch.Tensor, shape: ModelShape):
    """linear_qkv's weight or bias -> (q, k, v), each with heads in order (query head h = g * m + j)."""
    groups, per_group, head_dim = shape.num_query_groups, shape.heads_per_group, shape.kv_channels
    blocks = fused.reshape(groups, per_group + 2, head_dim, *fused.shape[1:])
    rest = fused.shape[1:]
    query = blocks[:, :per_group].reshape(groups * per_group * head_dim, *rest)
    return query, blocks[:, per_group].reshape(groups * head_dim, *rest), \
        blocks[:, per_group + 1].reshape(groups * head_dim, *rest)


def fuse_qkv(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, shape: ModelShape) -> torch.Tensor:
    groups, per_group, head_dim = shape.num_query_groups, shape.heads_per_group, shape.kv_channels
    rest = query.shape[1:]
    blocks = (query.reshape(groups, per_group, head_dim, *rest), key.reshape(groups, 1, head_dim, *rest),
              value.reshape(groups, 1, head_dim, *rest))
    return torch.cat(blocks, dim=1).reshape(-1, *rest)


def split_gate_up(fc1: torch.Tensor):
    """SwiGLU linear_fc1's weight or bias -> (gate, up)."""
    return fc1[0::2], fc1[1::2]


def fuse_gate_up(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return torch.stack((gate, up), dim=1).reshape(-1, *gate.shape[1:])


def query_key_rows(rows: torch.Tensor, shape: ModelShape, to_hf: bool) -> torch.Tensor:
    """q or k rows (weight or bias) in HF's rotate-half channel order (`to_hf`) or back in ours: with
    --rotary-interleaved each head's channels 2i, 2i + 1 become i, i + head_dim / 2 (the same permutation of q
    and k keeps every attention score), otherwise they are the same."""
    if not shape.rotary_interleaved:
        return rows
    head_dim, rest = shape.kv_channels, rows.shape[1:]
    heads = rows.reshape(-1, *((head_dim // 2, 2) if to_hf else (2, head_dim // 2)), *rest)
    return heads.transpose(1, 2).reshape(rows.shape)


def _mamba_kinds(shape: ModelShape, with_gate_and_step: bool):
    """The rows one group holds of each kind, in order: z, x, B, C, dt (in_proj) or x, B, C (conv1d)."""
    groups, state = shape.mamba_num_groups, shape.mamba_state_dim
    inner, heads = shape.mamba_inner_size // groups, shape.mamba_heads // groups
    return [inner, inner, state, state, heads] if with_gate_and_step else [inner, state, state]


def mamba_rows(rows: torch.Tensor, shape: ModelShape, to_hf: bool, with_gate_and_step: bool = True):
    """The mixer's in_proj rows (`with_gate_and_step`) or conv1d channels (without: x, B and C), weight or bias,
    from our group-major order to HF's kind-major one (`to_hf`) or back."""
    groups, kinds, rest = shape.mamba_num_groups, _mamba_kinds(shape, with_gate_and_step), rows.shape[1:]
    if to_hf:
        per_group = rows.reshape(groups, sum(kinds), *rest).split(kinds, dim=1)
        return torch.cat([kind.reshape(-1, *rest) for kind in per_group])
    per_kind = rows.split([groups * width for width in kinds])
    return torch.cat([kind.reshape(groups, width, *rest) for kind, width in zip(per_kind, kinds)],
                     dim=1).reshape(rows.shape)


class TensorSource:
    """Named tensors taken one at a time; what is missing or has the wrong shape is an error naming it."""

    def __init__(self, tensors: Dict[str, torch.Tensor], where: str, described_by: str):
        self.tensors, self.where, self.described_by = dict(tensors), where, described_by

    def take(self, name: str, shape=None) -> torch.Tensor:
        if name not in self.tensors:
            raise ConversionError(f"{self.where} has no tensor '{name}'")
        tensor = self.tensors.pop(name)
        if shape is not None and tuple(tensor.shape) != tuple(shape):
            raise ConversionError(f"{self.where}: '{name}' has shape {tuple(tensor.shape)}, the model "
                                  f"{self.described_by} describes needs {tuple(shape)}")
        return tensor

