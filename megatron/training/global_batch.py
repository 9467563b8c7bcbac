"""One global batch through the pipeline schedule, and the loss it reports, for training and evaluation alike."""

import torch
import torch.distributed as dist

from megatron.core import parallel_state

LOSS_NAME = "lm loss"


def loss_sums(losses_reduced, device):
    """Sum of [loss sum, token count] over the microbatch reports of this rank (zeros off the last stage)."""
    total = torch.zeros(2, dtype=torch.float64, device=device)
    for report in losses_reduced:
        value = report[LOSS_NAME]
        if torch.is_tensor(value) and value.numel() == 2:
            total += value.detach().to(torch.float64)
        else:  # a per-microbatch mean: count it as one unit
            total += torch.tensor([float(value), 1.0], dtype=torch.float64, device=device)
    return total


def reduce_reported_loss(losses_reduced, device, without_tokens=float("nan")):
    """The token-weighted mean loss over all microbatches of all data-parallel ranks, on every rank;
    `without_tokens` when no token was counted (every loss-mask entry zero).

    The last pipeline stage reduces over data-parallel ranks and broadcasts along its pipeline group, so
    every rank (not only the logging one) holds the same number.
    """
    total = loss_sums(losses_reduced, device)
    if parallel_state.is_pipeline_last_stage():
        dist.all_reduce(total, group=parallel_state.get_data_parallel_group(with_context_parallel=True))
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        pipeline_group = parallel_state.get_pipeline_model_parallel_group()
        last_stage_rank = dist.get_process_group_ranks(pipeline_group)[-1]
        dist.broadcast(total, src=last_stage_rank, group=pipeline_group)
    loss_sum, count = total.tolist()
    return loss_sum / count if count > 0 else without_tokens


def run_schedule(forward_step_func, data_iterator, model, args, forward_only, collect_non_loss_data=False,
                 num_microbatches=None):
    """One global batch through the pipeline schedule; returns the last stage's per-microbatch loss reports (with
    `collect_non_loss_data`, what its loss functions return for `non_loss_data=True`). `num_microbatches` defaults
    to the training batch's (`get_num_microbatches()`, which follows a --rampup-batch-size ramp)."""
    from megatron.core.num_microbatches_calculator import get_num_microbatches
    from megatron.core.pipeline_parallel import get_forward_backward_func

    return get_forward_backward_func()(
        forward_step_func=forward_step_func,
        data_iterator=data_iterator,
        model=model,
        num_microbatches=get_num_microbatches() if num_microbatches is None else num_microbatches,
        seq_length=args.seq_length,
        micro_batch_size=args.micro_batch_size,
        decoder_seq_length=args.seq_length,
        forward_only=forward_only,
        collect_non_loss_data=collect_non_loss_data,
    )
