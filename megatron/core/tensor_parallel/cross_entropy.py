"""Cross entropy over logits whose vocabulary dimension is split across tensor-parallel ranks.

Never gathers the full vocabulary: the maximum logit and the sum of exponentials are all-reduced over the
tensor-parallel group (max first, so exponentials cannot overflow), and the target's logit is contributed
by the one rank whose vocabulary range holds it. Computed in fp32; the gradient returns in the logits' dtype.

Label smoothing `eps` follows upstream Megatron (not `torch.nn.functional.cross_entropy`): the smoothed target
keeps `1 - eps` on the label and spreads `eps` evenly over the other `V - 1` tokens of the whole vocabulary
(`label_smoothing_weight`), so the loss is the same at every tensor-parallel size.
"""

import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.tensor_parallel.utils import VocabUtility


def label_smoothing_weight(label_smoothing, vocab_size):
    """The weight `s` of the mean log-probability in the smoothed loss `(1 - s) * ce - s * mean(log p)`: with
    `s = eps * V / (V - 1)` the target is `1 - eps` on the label and `eps / (V - 1)` on each other token."""
    if label_smoothing == 0 or vocab_size < 2:
        return 0.0
    return label_smoothing * vocab_size / (vocab_size - 1)


def _all_reduce_tp(tensor, op=dist.ReduceOp.SUM):
    if parallel_state.get_tensor_model_parallel_world_size() > 1:
        dist.all_reduce(tensor, op=op, group=parallel_state.get_tensor_model_parallel_group())
    return tensor


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, vocab_parallel_logits, target, label_smoothing):
        logits = vocab_parallel_logits.float()
        logits_max = _all_reduce_tp(logits.max(dim=-1).values, dist.ReduceOp.MAX)
        shifted = logits - logits_max.unsqueeze(-1)

        partition_vocab_size = logits.size(-1)
        tp_rank = parallel_state.get_tensor_model_parallel_rank()
        tp_size = parallel_state.get_tensor_model_parallel_world_size()
        vocab_start, vocab_end = VocabUtility.vocab_range_from_per_partition_vocab_size(
            partition_vocab_size, tp_rank, tp_size
        )
        target_not_here = (target < vocab_start) | (target >= vocab_end)
        local_target = (target - vocab_start).masked_fill(target_not_here, 0)
        predicted = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(target_not_here, 0.0)
        predicted = _all_reduce_tp(predicted)

        exp_logits = shifted.exp()
        sum_exp = _all_reduce_tp(exp_logits.sum(dim=-1))
        log_sum_exp = sum_exp.log()
        loss = log_sum_exp - predicted

        vocab_size = partition_vocab_size * tp_size
        smoothing = label_smoothing_weight(label_smoothing, vocab_size)
        if smoothing > 0:
            # The mean log-probability over the whole vocabulary: each rank's partial sum, summed across ranks.
            mean_log_probs = _all_reduce_tp((shifted - log_sum_exp.unsqueeze(-1)).sum(dim=-1)) / vocab_size
            loss = (1.0 - smoothing) * loss - smoothing * mean_log_probs

        softmax = exp_logits.div_(sum_exp.unsqueeze(-1))
        ctx.smoothing = smoothing
        ctx.vocab_size = vocab_size
        ctx.input_dtype = vocab_parallel_logits.dtype
        ctx.save_for_backward(softmax, target_not_here, local_target)
        return loss

    @staticmethod
    def backward(ctx, grad_output):
        softmax, target_not_here, local_target = ctx.saved_tensors
        grad = softmax.clone()
        on_target = (~target_not_here).to(grad.dtype)
        if ctx.smoothing > 0:
            grad -= ctx.smoothing / ctx.vocab_size
            on_target = on_target * (1.0 - ctx.smoothing)
        grad.scatter_add_(-1, local_target.unsqueeze(-1), -on_target.unsqueeze(-1))
        grad.mul_(grad_output.float().unsqueeze(-1))
        return grad.to(ctx.input_dtype), None, None


def vocab_parallel_cross_entropy(vocab_parallel_logits, target, label_smoothing=0.0):
    """Per-token loss `[...]` (fp32) from logits `[..., vocab / tp]` and int64 targets `[...]` in [0, vocab)."""
    if vocab_parallel_logits.shape[:-1] != target.shape:
        raise ValueError(
            f"logits shape {tuple(vocab_parallel_logits.shape)} and target shape {tuple(target.shape)} disagree; "
            "logits must be target's shape plus a vocabulary dimension"
        )
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1), got {label_smoothing}")
    return _VocabParallelCrossEntropy.apply(vocab_parallel_logits, target, float(label_smoothing))
