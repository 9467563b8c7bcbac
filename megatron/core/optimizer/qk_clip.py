"""QK-Clip (Kimi K2's MuonClip, `--qk-clip`): keep every attention head's largest pre-softmax logit near a bound.

During the forward each `SelfAttention` and `MLASelfAttention` tracks, per local query head h, the largest logit
S_h over the step's microbatches (see attention.py, multi_latent_attention.py); `reduce_max_attention_logits`
takes the MAX over data- and context-parallel ranks, so every rank holding the same heads sees the same S. After
the optimizer's inner step, for every head with S_h > tau (`qk_clip_threshold`), gamma_h = tau / S_h and (standard
attention) the head's query rows of the fused QKV weight (and of its bias) are multiplied by gamma_h^alpha
(`qk_clip_alpha`) and its key rows by gamma_h^(1 - alpha), so the head's logits shrink by gamma_h. With
grouped-query attention a key head serves several query heads: each query head takes its own gamma_h^alpha and
the key head the smallest gamma_h^(1 - alpha) of its group, so no head of the group is left above the bound (the
others are clipped a little more). Values rows are never touched.

Multi-latent attention (Kimi K2 paper, section 2.1, and upstream Megatron-LM's `MLASelfAttention.clip_qk`): a
head's logit is q_nope . k_nope + q_rope . k_rope, with q_nope, q_rope and k_nope its own rows of the query
projection (`linear_q_up_proj`, or `linear_q_proj` without a query latent; per head `[q_nope | q_rope]`) and of
`linear_kv_up_proj` (per head `[k_nope | v]`), and k_rope one vector per token shared by every head (from
`linear_kv_down_proj`). A clipped head's q_nope rows take gamma_h^alpha, its k_nope rows gamma_h^(1 - alpha) and
its q_rope rows gamma_h, and k_rope is left alone (scaling it would clip every head): both terms, so the logit,
shrink by gamma_h. The value rows and the down projections are never touched.

The rescale is applied to the main parameters the optimizer steps, before they are copied into the model
(`MegatronOptimizer.after_inner_step`), so model weights follow them as after any step: the fp32 copies of
`Float16Optimizer`, this rank's flat shard of each weight under the distributed optimizer and Megatron-FSDP
(whose elements map to rows through the weight's shape), the DTensor shard under FSDP2, the weight itself
otherwise. The maxima of one step are a per-head function of the whole model: every data-parallel layout
applies the same factors to its own elements.
"""

import contextlib
import math

import torch
import torch.distributed as dist

from megatron.core.distributed.data_parallel_base import is_dtensor


def attention_modules(model_chunks):
    """The `SelfAttention` and `MLASelfAttention` modules of `model_chunks` (wrapped or not), in module order."""
    from megatron.core.transformer.attention import SelfAttention
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention

    return [module for chunk in model_chunks for module in chunk.modules()
            if isinstance(module, (SelfAttention, MLASelfAttention))]


def reset_max_attention_logits(model_chunks):
    """Forget the tracked maxima (at the start of a step's forward-backward pass)."""
    for attention in attention_modules(model_chunks):
        attention.max_attention_logits = None


def reduce_max_attention_logits(model_chunks, group):
    """Replace each tracking attention's maxima by their MAX over `group` (the data-parallel group with context
    parallelism), one collective for all layers. A layer that saw no forward counts as -inf."""
    attentions = [attention for attention in attention_modules(model_chunks) if attention.tracks_max_attention_logits]
    if not attentions:
        return
    device = next((attention.max_attention_logits.device for attention in attentions
                   if attention.max_attention_logits is not None), next(attentions[0].parameters()).device)
    local = [attention.max_attention_logits if attention.max_attention_logits is not None
             else torch.full((attention.num_heads_per_partition,), float("-inf"), device=device)
             for attention in attentions]
    stacked = torch.cat([maxima.to(device=device, dtype=torch.float32) for maxima in local])
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(stacked, op=dist.ReduceOp.MAX, group=group)
    for attention, maxima in zip(attentions, stacked.split([len(maxima) for maxima in local])):
        attention.max_attention_logits = maxima


def max_attention_logit(model_chunks, group=None):
    """The largest tracked logit of all layers (after `reduce_max_attention_logits`), MAX over `group` (the
    model-parallel group, so that every stage and tensor-parallel rank reports the same); None if none tracked."""
    attentions = attention_modules(model_chunks)
    maxima = [attention.max_attention_logits.max() for attention in attentions
              if attention.max_attention_logits is not None]
    device = next(attentions[0].parameters()).device if attentions else torch.device("cpu")
    largest = torch.stack(maxima).max().float() if maxima else torch.tensor(float("-inf"), device=device)
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(largest, op=dist.ReduceOp.MAX, group=group)
    value = largest.item()
    return None if value == float("-inf") else value


def qkv_row_scales(max_logits, heads_per_group, head_dim, threshold, alpha):
    """The factor of each output row of a fused QKV weight laid out `[groups, (q_0 .. q_{m-1} | k | v)]` of
    `head_dim` rows each (attention.py), from the per-query-head maxima `max_logits` `[heads]`."""
    per_query = clip_factors(max_logits, threshold).view(-1, heads_per_group)  # [groups, m]
    query_scales = per_query.pow(alpha)
    key_scales = per_query.pow(1.0 - alpha).amin(dim=1, keepdim=True)
    value_scales = torch.ones_like(key_scales)
    per_head = torch.cat([query_scales, key_scales, value_scales], dim=1)  # [groups, m + 2]
    return per_head.repeat_interleave(head_dim, dim=1).reshape(-1)


def clip_factors(max_logits, threshold):
    """gamma_h = threshold / S_h for the heads above `threshold`, 1 for the others (fp32 `[heads]`)."""
    max_logits = max_logits.float()
    return torch.where(max_logits > threshold, threshold / max_logits, torch.ones_like(max_logits))


def mla_query_row_scales(max_logits, nope_dim, rope_dim, threshold, alpha):
    """The factor of each output row of MLA's query projection laid out `[heads, (q_nope | q_rope)]` (`nope_dim`
    and `rope_dim` rows): gamma_h^alpha on q_nope, gamma_h on q_rope."""
    gamma = clip_factors(max_logits, threshold)[:, None]
    return torch.cat([gamma.pow(alpha).expand(-1, nope_dim), gamma.expand(-1, rope_dim)], dim=1).reshape(-1)


def mla_kv_row_scales(max_logits, nope_dim, value_dim, threshold, alpha):
    """The factor of each output row of MLA's `linear_kv_up_proj` laid out `[heads, (k_nope | v)]` (`nope_dim`
    and `value_dim` rows): gamma_h^(1 - alpha) on k_nope, 1 on v."""
    gamma = clip_factors(max_logits, threshold)[:, None]
    return torch.cat([gamma.pow(1.0 - alpha).expand(-1, nope_dim), torch.ones_like(gamma).expand(-1, value_dim)],
                     dim=1).reshape(-1)


def clipped_rows(attention):
    """[(parameter, factor of each of its output rows)] of `attention`'s QK-Clip from its tracked maxima."""
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention

    config, maxima = attention.config, attention.max_attention_logits
    threshold, alpha = config.qk_clip_threshold, config.qk_clip_alpha
    if isinstance(attention, MLASelfAttention):
        query_proj = attention.linear_q_proj if config.q_lora_rank is None else attention.linear_q_up_proj
        return [
            (query_proj.weight,
             mla_query_row_scales(maxima, config.qk_head_dim, config.qk_pos_emb_head_dim, threshold, alpha)),
            (attention.linear_kv_up_proj.weight,
             mla_kv_row_scales(maxima, config.qk_head_dim, config.v_head_dim, threshold, alpha)),
        ]
    row_scales = qkv_row_scales(maxima, attention.heads_per_group, attention.head_dim, threshold, alpha)
    return [(param, row_scales) for param in (attention.linear_qkv.weight, getattr(attention.linear_qkv, "bias", None))
            if param is not None]


def _main_pieces(optimizer, model_param):
    """The main parameters standing for `model_param` on this rank: (tensor, start, end, shape) holding elements
    `[start, end)` of the flattened parameter of `shape`, or (tensor, None, None, shape) for the whole of it."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    from megatron.core.optimizer.fsdp_optimizer import MegatronFSDPOptimizer
    from megatron.core.optimizer.optimizer import Float16Optimizer, FP32Optimizer

    if isinstance(optimizer, DistributedOptimizer):
        return [(shard.main_param, shard.param_start, shard.param_end, model_param.shape)
                for shard in optimizer._shards if shard.model_param is model_param]
    if isinstance(optimizer, MegatronFSDPOptimizer):
        pieces = []
        for chunk in optimizer.chunks:
            if not chunk.owns(model_param) or chunk.main_param_of(model_param) is None:
                continue
            piece = chunk.main_piece_of(model_param)
            main = chunk.main_param_of(model_param)
            pieces.append((main, None, None, main.shape) if piece is None else (main, piece[1], piece[2], piece[0]))
        return pieces
    if isinstance(optimizer, Float16Optimizer):
        return [(main, None, None, main.shape) for model, main in optimizer._model_and_main if model is model_param]
    if isinstance(optimizer, FP32Optimizer):
        return [(model_param, None, None, model_param.shape)]
    raise ValueError(f"--qk-clip: no rule for the main parameters of {type(optimizer).__name__}; drop --qk-clip "
                     "or use Megatron DDP, the distributed optimizer, Megatron-FSDP or FSDP2")


def scale_rows(main, row_scales, start=None, end=None, shape=None):
    """Multiply row r of the parameter `main` stands for (a weight `[rows, cols]` or bias `[rows]`) by
    `row_scales[r]` in `main`: a flat piece holding elements `[start, end)` of the flattened parameter of `shape`,
    or (start None) the whole parameter, a DTensor's shard of it included."""
    row_scales = row_scales.to(main.device)
    if start is not None:  # a flat piece: element e of the flattened parameter lies in row e // cols
        rows = torch.arange(start, end, device=main.device) // math.prod(shape[1:])
        main.mul_(row_scales[rows].to(main.dtype).view_as(main))
        return
    factors = row_scales.to(main.dtype).view(-1, *([1] * (main.dim() - 1)))
    if is_dtensor(main):
        from megatron.core.distributed.torch_fully_sharded_data_parallel import local_shard_like

        # Every rank holds the same factors: this rank's shard of them is cut locally (no collective) from a
        # view of the whole and made where the shard lives (host memory under --torch-fsdp2-cpu-offload, whose
        # mesh is the GPU's), not on the mesh's device.
        main.mul_(local_shard_like(main, factors.expand(tuple(main.shape)), "a QK-Clip factor"))
    else:
        main.mul_(factors.to(main.device))


def _scale_main(optimizer, model_param, row_scales):
    """`scale_rows` on every main piece of `model_param`."""
    for main, start, end, shape in _main_pieces(optimizer, model_param):
        scale_rows(main, row_scales, start, end, shape)


@torch.no_grad()
def clip_qk(optimizer, model_chunks):
    """Rescale the query and key rows of the heads whose tracked maximum exceeds the threshold (module
    docstring) in `optimizer`'s main parameters."""
    for attention in attention_modules(model_chunks):
        config = attention.config
        if not config.qk_clip or attention.max_attention_logits is None:
            continue
        if not bool((attention.max_attention_logits > config.qk_clip_threshold).any()):
            continue
        for param, row_scales in clipped_rows(attention):
            _scale_main(optimizer, param, row_scales)


@contextlib.contextmanager
def clipping_after_step(optimizer, model_chunks):
    """QK-Clip `model_chunks` within every `optimizer.step()` of the block, after the inner step."""
    optimizer.after_inner_step = lambda stepped: clip_qk(stepped, model_chunks)
    try:
        yield
    finally:
        optimizer.after_inner_step = None
