"""Pretrain a GPT model: `torchrun --nproc-per-node N pretrain_gpt.py --num-layers ... --mock-data ...`.

Supplies the three pieces `pretrain()` needs: the model of a pipeline stage, the forward step with its loss,
and the train/valid/test datasets (mock token ids, `--data-path` files with blending and `--split`, or chat
conversations under `--sft`).
"""

from functools import partial

import torch

from megatron.core import parallel_state
from megatron.core.datasets.gpt_dataset import build_gpt_datasets
from megatron.core.enums import ModelType
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.packed_sequences import cut_packed_batch_for_cp_rank
from megatron.core.rerun_state_machine import get_rerun_state_machine
from megatron.core.timers import timed
from megatron.core.transformer.context_parallel import get_batch_on_this_cp_rank
from megatron.core.transformer.multi_token_prediction import (
    masked_depth_losses,
    mtp_depth_losses_or_none,
    mtp_loss_for_backward,
    track_mtp_losses,
)
from megatron.training.datasets.gpt_dataset_config import gpt_dataset_config_from_args
from megatron.training.datasets.sft_dataset import build_sft_datasets
from megatron.training.datasets.sft_dataset_config import sft_dataset_config_from_args
from megatron.training.global_vars import get_args, get_timers, get_tokenizer
from megatron.training.model_config import core_transformer_config_from_args
from megatron.training.packed_batch import packed_seq_params_from_batch
from megatron.training.training import pretrain

# --check-for-spiky-loss: a microbatch loss this many times the largest of the first losses is rejected.
SPIKY_LOSS_FACTOR = 10


def model_provider(pre_process=True, post_process=True):
    """The GPT layers of this pipeline stage, shaped by the command line."""
    args = get_args()
    return GPTModel(
        config=core_transformer_config_from_args(args),
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
        rotary_percent=args.rotary_percent,
        rotary_base=args.rotary_base,
        rope_scaling=args.use_rope_scaling,
        rope_scaling_factor=args.rope_scaling_factor,
    )


BATCH_KEYS = ("tokens", "labels", "loss_mask", "position_ids", "attention_mask")


def get_batch(data_iterator):
    """The next micro-batch on this process's device (every stage draws it, keeping iterators in step), cut to
    this context-parallel rank's two chunks of the sequence. Only the keys the step reads are kept (as upstream's
    get_batch), so a blend's per-sample `dataset_id` does not reach the sequence split. A batch of packed
    sequences (with `cu_seqlens`, megatron/training/packed_batch.py) also gets its `packed_seq_params`."""
    batch = next(data_iterator)
    device = get_args().device
    packed_seq_params = packed_seq_params_from_batch(batch, device)
    batch = {key: value.to(device, non_blocking=True) for key, value in batch.items() if key in BATCH_KEYS}
    if packed_seq_params is None:
        return get_batch_on_this_cp_rank(batch)
    # Packed sequences: each one cut into 2 x CP chunks (upstream's THD split), the model told where they lie.
    batch = cut_packed_batch_for_cp_rank(batch, packed_seq_params)
    batch["packed_seq_params"] = packed_seq_params
    return batch


def loss_func(loss_mask, output_tensor, packed_seq_params=None):
    """(masked loss sum, token count, report): the schedule divides the loss by the count.

    The report is this rank's [sum, count]; the training loop sums reports over DP x CP. Under context
    parallelism both are this rank's part of each sequence; the schedule makes the loss the whole sequence's mean
    (`context_parallel_loss`).

    With multi-token prediction (`--mtp-num-layers`) the model also returns each depth's per-token losses: their
    term (`--mtp-loss-scaling-factor` / N times the sum of the depths' masked means) joins the loss for the
    backward, and in training each depth's sum and count are kept for the `mtp_k loss` log fields; the report
    (`lm loss`) stays the main model's. On packed sequences (`packed_seq_params`) the depths' loss masks shift
    within each sequence.
    """
    output_tensor, depth_losses = mtp_depth_losses_or_none(output_tensor)
    losses = output_tensor.float().reshape(-1)
    mask = loss_mask.float().reshape(-1)
    loss_sum = torch.sum(losses * mask)
    num_tokens = mask.sum()
    report = torch.stack([loss_sum.detach(), num_tokens.detach()])
    cp_size = parallel_state.get_context_parallel_world_size()
    group = parallel_state.get_context_parallel_group() if cp_size > 1 else None  # the CP ranks share each sequence
    if depth_losses is not None:
        args = get_args()
        depth_sums, depth_counts = masked_depth_losses(depth_losses, loss_mask, cp_group=group,
                                                       packed_seq_params=packed_seq_params)
        if torch.is_grad_enabled():  # a training pass (evaluation runs under no_grad)
            track_mtp_losses(depth_sums, depth_counts)
        loss_sum = loss_sum + mtp_loss_for_backward(depth_sums, depth_counts, args.mtp_loss_scaling_factor,
                                                    num_tokens, args.calculate_per_token_loss, cp_group=group)
    validate_loss(loss_sum, get_args())
    return loss_sum, num_tokens, {"lm loss": report}


def validate_loss(loss, args):
    """Hand this rank's microbatch loss to the rerun state machine: NaN and Inf are fatal (unless
    --no-check-for-nan-in-loss-and-grad), a spike is not (--check-for-spiky-loss). The forward pass is
    deterministic, so a rerun must reproduce the value exactly (tolerance 0)."""
    machine = get_rerun_state_machine()
    if args.check_for_nan_in_loss_and_grad:
        machine.validate_result(loss, torch.isnan, "found NaN in local forward loss calculation", fatal=True)
        machine.validate_result(loss, torch.isinf, "found Inf in local forward loss calculation", fatal=True)
    if args.check_for_spiky_loss:
        machine.validate_result(
            loss,
            partial(machine.is_unexpectedly_large, threshold=SPIKY_LOSS_FACTOR, context="loss"),
            "Spiky loss",
            fatal=False,
        )


def forward_step(data_iterator, model):
    """Forward one micro-batch; returns (per-token loss on the last stage / hidden states elsewhere, loss_func)."""
    with timed(get_timers(), "batch-generator", log_level=2):
        batch = get_batch(data_iterator)
    packed = {"packed_seq_params": batch["packed_seq_params"]} if "packed_seq_params" in batch else {}
    output_tensor = model(
        batch["tokens"], batch["position_ids"], attention_mask=batch.get("attention_mask"), labels=batch["labels"],
        **packed,
    )
    return output_tensor, partial(loss_func, batch["loss_mask"], **packed)


def train_valid_test_datasets_provider(train_valid_test_num_samples):
    """GPT datasets of the requested sizes from --mock-data, --data-path (weights, --split) or the per-split
    --train/valid/test-data-path, with every data flag (megatron/training/datasets/gpt_dataset_config.py); under
    --sft, chat conversations from those paths' JSON-lines files (megatron/training/datasets/sft_dataset.py)."""
    args = get_args()
    if args.sft:
        return build_sft_datasets(sft_dataset_config_from_args(args, get_tokenizer()), train_valid_test_num_samples)
    config = gpt_dataset_config_from_args(args, get_tokenizer())
    return build_gpt_datasets(config, train_valid_test_num_samples)


if __name__ == "__main__":
    pretrain(train_valid_test_datasets_provider, model_provider, ModelType.encoder_or_decoder, forward_step)
