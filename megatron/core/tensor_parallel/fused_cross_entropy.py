"""Fused vocab-parallel cross entropy (`--cross-entropy-loss-fusion`): the same loss and gradient as
`vocab_parallel_cross_entropy`, with less memory and one collective fewer.

- Memory: the logits stay in their own dtype. fp32 work happens on row chunks of at most `chunk_elements`
  values, so neither the fp32 copy of the logits nor the fp32 softmax is ever materialised whole; the backward
  recomputes each chunk's softmax from the saved logits and writes the gradient in the logits' dtype.
- Communication: after the MAX all-reduce of the row maxima, one SUM all-reduce carries the target logit, the
  sum of exponentials (and, with label smoothing, the sum of shifted logits) together: two collectives instead
  of three (four with smoothing).

Per row the arithmetic is the unfused one's (fp32 `logits - max`, `exp`, the sum along the vocabulary), so
fp32 results agree to the last bits of summation order.
"""

import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.tensor_parallel.cross_entropy import label_smoothing_weight
from megatron.core.tensor_parallel.utils import VocabUtility

DEFAULT_CHUNK_ELEMENTS = 1 << 22  # 16 MiB of fp32 per chunk


def _all_reduce_tp(tensor, op):
    if parallel_state.get_tensor_model_parallel_world_size() > 1:
        dist.all_reduce(tensor, op=op, group=parallel_state.get_tensor_model_parallel_group())
    return tensor


def _row_chunks(num_rows, row_width, chunk_elements):
    rows_per_chunk = max(1, chunk_elements // max(1, row_width))
    return [(start, min(start + rows_per_chunk, num_rows)) for start in range(0, num_rows, rows_per_chunk)]


def _local_targets(target, partition_vocab_size):
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    vocab_start, vocab_end = VocabUtility.vocab_range_from_per_partition_vocab_size(
        partition_vocab_size, tp_rank, tp_size)
    target_not_here = (target < vocab_start) | (target >= vocab_end)
    return (target - vocab_start).masked_fill(target_not_here, 0), target_not_here, partition_vocab_size * tp_size


class _FusedVocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, label_smoothing, chunk_elements):
        rows = logits.reshape(-1, logits.size(-1))
        flat_target = target.reshape(-1)
        local_target, target_not_here, vocab_size = _local_targets(flat_target, rows.size(-1))
        row_max = _all_reduce_tp(rows.max(dim=-1).values.float(), dist.ReduceOp.MAX)
        # Rows: target logit (shifted), sum of exponentials, sum of shifted logits (label smoothing only).
        sums = torch.zeros(3 if label_smoothing > 0 else 2, rows.size(0), dtype=torch.float32, device=rows.device)
        for start, end in _row_chunks(rows.size(0), rows.size(-1), chunk_elements):
            shifted = rows[start:end].float() - row_max[start:end].unsqueeze(-1)
            predicted = shifted.gather(-1, local_target[start:end].unsqueeze(-1)).squeeze(-1)
            sums[0, start:end] = predicted.masked_fill(target_not_here[start:end], 0.0)
            if label_smoothing > 0:
                sums[2, start:end] = shifted.sum(dim=-1)
            sums[1, start:end] = shifted.exp_().sum(dim=-1)
        _all_reduce_tp(sums, dist.ReduceOp.SUM)
        log_sum_exp = sums[1].log()
        loss = log_sum_exp - sums[0]
        smoothing = label_smoothing_weight(label_smoothing, vocab_size)
        if smoothing > 0:
            mean_log_probs = sums[2] / vocab_size - log_sum_exp
            loss = (1.0 - smoothing) * loss - smoothing * mean_log_probs
        ctx.smoothing, ctx.vocab_size, ctx.chunk_elements = smoothing, vocab_size, chunk_elements
        ctx.logits_shape = logits.shape
        ctx.save_for_backward(rows, row_max, sums[1].clone(), local_target, target_not_here)
        return loss.reshape(target.shape)

    @staticmethod
    def backward(ctx, grad_output):
        rows, row_max, sum_exp, local_target, target_not_here = ctx.saved_tensors
        grad_rows = grad_output.reshape(-1).float()
        on_target = (~target_not_here).float() * (1.0 - ctx.smoothing)
        grad = torch.empty_like(rows)
        for start, end in _row_chunks(rows.size(0), rows.size(-1), ctx.chunk_elements):
            softmax = (rows[start:end].float() - row_max[start:end].unsqueeze(-1)).exp_()
            softmax.div_(sum_exp[start:end].unsqueeze(-1))
            if ctx.smoothing > 0:
                softmax -= ctx.smoothing / ctx.vocab_size
            softmax.scatter_add_(-1, local_target[start:end].unsqueeze(-1), -on_target[start:end].unsqueeze(-1))
            softmax.mul_(grad_rows[start:end].unsqueeze(-1))
            grad[start:end] = softmax
        return grad.reshape(ctx.logits_shape), None, None, None


def fused_vocab_parallel_cross_entropy(vocab_parallel_logits, target, label_smoothing=0.0,
                                       chunk_elements=DEFAULT_CHUNK_ELEMENTS):
    """Per-token loss `[...]` (fp32) from logits `[..., vocab / tp]` in any float dtype and int64 targets `[...]`
    in [0, vocab); see the module docstring."""
    if vocab_parallel_logits.shape[:-1] != target.shape:
        raise ValueError(
            f"logits shape {tuple(vocab_parallel_logits.shape)} and target shape {tuple(target.shape)} disagree; "
            "logits must be target's shape plus a vocabulary dimension")
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1), got {label_smoothing}")
    if chunk_elements < 1:
        raise ValueError(f"chunk_elements must be positive, got {chunk_elements}")
    return _FusedVocabParallelCrossEntropy.apply(vocab_parallel_logits, target, float(label_smoothing),
                                                 int(chunk_elements))
