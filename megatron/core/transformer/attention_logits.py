"""The largest pre-softmax attention logit of each head (`--qk-clip`, `--log-max-attention-logit`).

The logit of query i and key j is the scaled dot product q_i . k_j / sqrt(head_dim) that the softmax sees; the
maximum runs over the batch and every (i, j) the mask keeps. It is computed beside the attention, from detached
queries and keys, so the attention's own numbers are untouched; one query group and block of query rows at a
time, so at most about `MAX_SCORES_PER_BLOCK` fp32 scores exist at once.

Under context parallelism a rank holds s/N queries (its two load-balanced chunks) and s/N keys: the keys of the
whole sequence are gathered over the context-parallel group and the mask is built from global positions, so each
rank covers its queries against every key and a MAX over the context-parallel ranks covers the whole sequence.
"""

import math

import torch

from megatron.core.transformer.context_parallel.collectives import all_gather_first_dim
from megatron.core.transformer.context_parallel.sequence_split import local_token_indices

MAX_SCORES_PER_BLOCK = 1 << 26  # 256 MiB of fp32 scores


@torch.no_grad()
def max_attention_logits(query, key, attention_mask=None, scale=None):
    """Per query head, the largest logit: query `[s_q, b, heads, d]`, key `[s_k, b, groups, d]` (query head h
    uses group h // (heads / groups)) -> fp32 `[heads]`. `attention_mask` is None (causal: query i sees keys
    0 .. i) or a bool tensor broadcastable to `[b, heads, s_q, s_k]`, True where attention is NOT allowed."""
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
    queries = query.detach().float().permute(1, 2, 0, 3)  # [b, heads, s_q, d]
    keys = key.detach().float().permute(1, 2, 3, 0)  # [b, groups, d, s_k]
    heads, groups = queries.shape[1], keys.shape[1]
    per_group = heads // groups
    if attention_mask is None:
        blocked = torch.ones(queries.shape[2], keys.shape[3], dtype=torch.bool, device=query.device).triu(1)
    else:
        blocked = attention_mask.to(torch.bool)
    batch, queries_len, keys_len = queries.shape[0], queries.shape[2], keys.shape[3]
    rows_per_block = max(1, MAX_SCORES_PER_BLOCK // (batch * per_group * keys_len))
    maxima = []
    for group in range(groups):
        heads_of_group = slice(group * per_group, (group + 1) * per_group)
        group_blocked = blocked[:, heads_of_group] if blocked.dim() == 4 and blocked.shape[1] == heads else blocked
        group_max = torch.full((per_group,), float("-inf"), device=query.device)
        for start in range(0, queries_len, rows_per_block):
            rows = slice(start, start + rows_per_block)
            scores = torch.matmul(queries[:, heads_of_group, rows], keys[:, group:group + 1]) * scale
            rows_blocked = group_blocked[..., rows, :] if group_blocked.shape[-2] != 1 else group_blocked
            group_max = torch.maximum(group_max, scores.masked_fill(rows_blocked, float("-inf")).amax(dim=(0, 2, 3)))
        maxima.append(group_max)
    return torch.cat(maxima)


@torch.no_grad()
def context_parallel_max_attention_logits(query, key, attention_mask, group, scale=None):
    """`max_attention_logits` of this context-parallel rank's queries `[s/N, b, heads, d]` over the keys of the
    whole sequence (gathered from this rank's `[s/N, b, groups, d]` over `group`, the context-parallel group
    whose rank r holds the tokens `local_token_indices(s, N, r)`). `attention_mask`: None (causal) or bool
    `[b|1, 1, s, s]` over global positions, True where masked."""
    cp_size, cp_rank = torch.distributed.get_world_size(group), torch.distributed.get_rank(group)
    seq_len = query.shape[0] * cp_size
    full_key = all_gather_first_dim(key.detach(), group)
    query_positions = local_token_indices(seq_len, cp_size, cp_rank, query.device)
    key_positions = torch.cat([local_token_indices(seq_len, cp_size, rank, query.device) for rank in range(cp_size)])
    if attention_mask is None:
        blocked = key_positions.unsqueeze(0) > query_positions.unsqueeze(1)
    else:
        blocked = attention_mask.to(torch.bool).index_select(-2, query_positions).index_select(-1, key_positions)
    return max_attention_logits(query, full_key, blocked, scale)
