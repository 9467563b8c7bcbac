"""The loss of a context-parallel micro-batch: the mean over every token of the global sequence.

Each CP rank holds 1/N of the tokens, so its masked loss sum and token count are partial. The gradient
reduction averages over DP x CP (divides by DP * CP), so a rank back-propagates `N * local_sum / global_count`,
where the global count is the sum over the CP group: summed over CP and divided by N, the gradient is that of
`sum / count` over the whole sequence, exact also when the loss mask leaves the ranks different counts.
With `--calculate-per-token-loss` sums and local counts go out as they are: the schedule sums the counts over
DP x CP and the gradients are divided by that total.
"""

import torch
import torch.distributed as dist


def context_parallel_loss(loss_sum, num_tokens, group, per_token_loss):
    """(loss to back-propagate, token count to divide it by) for the schedule's (loss, count) convention."""
    if group is None or dist.get_world_size(group) == 1 or per_token_loss:
        return loss_sum, num_tokens
    global_count = num_tokens.detach().clone().to(torch.float32)
    dist.all_reduce(global_count, group=group)
    return loss_sum * dist.get_world_size(group), global_count.clamp_min(1.0).to(num_tokens.dtype)
