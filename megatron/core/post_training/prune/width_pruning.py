"""Minitron width pruning of a GPTModel: keep the most important channels, copy their weights into a smaller model.

`select_kept_channels` turns importance scores (`importance.py`) into the indices to keep for target sizes;
`prune_gpt_width` builds the smaller GPTModel (its TransformerConfig with the new sizes) and `copy_kept_weights`
copies the kept rows and columns into it. Kept indices stay in their original order, so keeping everything gives
a model whose weights, and outputs, equal the original's exactly.

Which entries a channel owns (TP1; this file's own layout knowledge of `attention.py` and `mlp.py`):
- a hidden channel c: column c of the word and position embeddings, of `linear_qkv`, `linear_fc1` and an untied
  output layer; row c (and bias c) of `linear_proj` and `linear_fc2`; element c of every norm over the hidden size;
- an FFN neuron i: row i of `linear_fc1` (rows 2i and 2i + 1 with a gated linear unit, which interleaves gate and
  up rows), its bias, and column i of `linear_fc2`;
- a query head h = g * m + j (query group g of m heads): its `kv_channels` rows of `linear_qkv` in group g's
  block `[q_0 .. q_{m-1} | k | v]` and its columns of `linear_proj`. With multi-head attention (one head per
  group) a pruned head takes its key and value rows along; with grouped-query attention every group stays and
  loses the same number of query heads.
"""

import copy
import dataclasses
import re
from dataclasses import dataclass
from typing import Callable, List, Optional

import torch

from megatron.core.post_training.prune.importance import WidthImportance, check_prunable


@dataclass(frozen=True)
class WidthPruningTarget:
    """Target sizes (None: keep that dimension), modelopt's export_config names."""

    hidden_size: Optional[int] = None
    ffn_hidden_size: Optional[int] = None
    num_attention_heads: Optional[int] = None


@dataclass
class KeptChannels:
    """Sorted indices to keep: hidden channels, and per layer FFN neurons and query heads."""

    hidden: torch.Tensor
    ffn: List[torch.Tensor]
    heads: List[torch.Tensor]


def _check_target(config, target: WidthPruningTarget):
    for flag, wanted, current in (
        ("--target-hidden-size", target.hidden_size, config.hidden_size),
        ("--target-ffn-hidden-size", target.ffn_hidden_size, config.ffn_hidden_size),
        ("--target-num-attention-heads", target.num_attention_heads, config.num_attention_heads),
    ):
        if wanted is not None and not (isinstance(wanted, int) and 0 < wanted <= current):
            raise ValueError(f"{flag} must be a positive integer no larger than the model's ({current}), got {wanted!r}")
    heads = target.num_attention_heads
    groups = config.num_query_groups
    if heads is not None and groups != config.num_attention_heads and heads % groups != 0:
        raise ValueError(f"--target-num-attention-heads ({heads}) must be a multiple of --num-query-groups ({groups}):"
                         " grouped-query attention keeps every group and prunes the same number of heads in each")


def _top(scores: torch.Tensor, count: int) -> torch.Tensor:
    """Indices of the `count` highest scores, in ascending index order (ties: the lower index)."""
    order = torch.sort(-scores.detach().double().cpu(), stable=True).indices
    return order[:count].sort().values


def _kept_heads(scores: torch.Tensor, target: int, num_groups: int) -> torch.Tensor:
    heads = scores.numel()
    if num_groups == heads:  # multi-head attention: a head is a group
        return _top(scores, target)
    per_group, kept_per_group = heads // num_groups, target // num_groups
    kept = [group * per_group + _top(scores[group * per_group:(group + 1) * per_group], kept_per_group)
            for group in range(num_groups)]
    return torch.cat(kept)


def select_kept_channels(importance: WidthImportance, config, target: WidthPruningTarget) -> KeptChannels:
    """The channels to keep for `target`: the highest-scoring ones of each kind."""
    _check_target(config, target)
    hidden = target.hidden_size or config.hidden_size
    ffn = target.ffn_hidden_size or config.ffn_hidden_size
    heads = target.num_attention_heads or config.num_attention_heads
    return KeptChannels(
        hidden=_top(importance.hidden, hidden),
        ffn=[_top(scores, ffn) for scores in importance.ffn],
        heads=[_kept_heads(scores, heads, config.num_query_groups) for scores in importance.heads],
    )


def pruned_config(config, kept: KeptChannels):
    """`config` with the kept sizes; kv_channels (the head width) stays, whatever the hidden size."""
    heads = len(kept.heads[0])
    groups = heads if config.num_query_groups == config.num_attention_heads else config.num_query_groups
    return dataclasses.replace(config, hidden_size=len(kept.hidden), ffn_hidden_size=len(kept.ffn[0]),
                               num_attention_heads=heads, num_query_groups=groups, kv_channels=config.kv_channels)


def _qkv_rows(config, heads: torch.Tensor) -> torch.Tensor:
    """Rows of `linear_qkv` that the kept query heads (and, with multi-head attention, their key and value) own."""
    head_dim, groups = config.kv_channels, config.num_query_groups
    per_group = config.num_attention_heads // groups
    block = (per_group + 2) * head_dim
    channels = torch.arange(head_dim)
    rows = []
    for group in range(groups):
        in_group = [int(h) - group * per_group for h in heads if int(h) // per_group == group]
        if not in_group:
            continue
        base = group * block
        rows += [base + j * head_dim + channels for j in in_group]
        rows += [base + per_group * head_dim + channels, base + (per_group + 1) * head_dim + channels]
    return torch.cat(rows)


def _head_columns(config, heads: torch.Tensor) -> torch.Tensor:
    channels = torch.arange(config.kv_channels)
    return torch.cat([int(h) * config.kv_channels + channels for h in heads])


def _ffn_rows(config, ffn: torch.Tensor) -> torch.Tensor:
    if not config.gated_linear_unit:
        return ffn
    return torch.stack([2 * ffn, 2 * ffn + 1], dim=1).reshape(-1)  # gate and up rows interleave


_LAYER_ENTRY = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")


def _kept_slice(name, tensor, config, kept: KeptChannels):
    """The part of the original entry `name` that the kept channels own."""
    hidden = kept.hidden
    if name in ("embedding.word_embeddings.weight", "embedding.position_embeddings.weight", "output_layer.weight"):
        return tensor[:, hidden]
    if name.startswith("decoder.final_layernorm."):
        return tensor[hidden]
    match = _LAYER_ENTRY.match(name)
    if match is None:
        return tensor
    layer, entry = int(match.group(1)), match.group(2)
    if entry.startswith(("input_layernorm.", "pre_mlp_layernorm.")):
        return tensor[hidden]
    if entry.startswith("self_attention.linear_qkv."):
        rows = _qkv_rows(config, kept.heads[layer])
        return tensor[rows][:, hidden] if entry.endswith("weight") else tensor[rows]
    if entry == "self_attention.linear_proj.weight":
        return tensor[hidden][:, _head_columns(config, kept.heads[layer])]
    if entry.startswith("mlp.linear_fc1."):
        rows = _ffn_rows(config, kept.ffn[layer])
        return tensor[rows][:, hidden] if entry.endswith("weight") else tensor[rows]
    if entry == "mlp.linear_fc2.weight":
        return tensor[hidden][:, kept.ffn[layer]]
    if entry in ("self_attention.linear_proj.bias", "mlp.linear_fc2.bias"):
        return tensor[hidden]
    return tensor  # q/k norms (over kv_channels), extra state


def copy_kept_weights(source, target, kept: KeptChannels):
    """Copy the kept rows and columns of `source`'s weights into `target` (built with `pruned_config`)."""
    source_state = source.state_dict()
    with torch.no_grad():
        for name, destination in target.state_dict().items():
            if name not in source_state:
                raise KeyError(f"pruned model entry {name} has no counterpart in the original model")
            value = _kept_slice(name, source_state[name], source.config, kept)
            if not torch.is_tensor(destination):
                continue
            if value.shape != destination.shape:
                raise RuntimeError(f"pruning {name}: kept part has shape {tuple(value.shape)}, the pruned model's "
                                   f"entry {tuple(destination.shape)}")
            destination.copy_(value)


def build_like(model, config):
    """A GPTModel of `model`'s kind (vocabulary, positions, tying, rotary embedding) with `config`."""
    from megatron.core.models.gpt.gpt_model import GPTModel

    pruned = GPTModel(config, vocab_size=model.vocab_size, max_sequence_length=model.max_sequence_length,
                      pre_process=model.pre_process, post_process=model.post_process,
                      share_embeddings_and_output_weights=model.share_embeddings_and_output_weights,
                      position_embedding_type=model.position_embedding_type,
                      parallel_output=getattr(model, "parallel_output", True))
    # The rotary embedding depends on the head width only, which pruning keeps.
    pruned.rotary_pos_emb = copy.deepcopy(model.rotary_pos_emb)
    return pruned.to(next(model.parameters()).device)


def prune_gpt_width(model, kept: KeptChannels, build_model: Optional[Callable] = None):
    """A new GPTModel holding `model`'s kept channels. `build_model(config)` builds the smaller model (default:
    `build_like(model, config)`)."""
    check_prunable(model)
    config = pruned_config(model.config, kept)
    pruned = build_model(config) if build_model is not None else build_like(model, config)
    copy_kept_weights(model, pruned, kept)
    return pruned
