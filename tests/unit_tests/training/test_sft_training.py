"""`pretrain_gpt.py --sft` end to end: conversations packed into rows train on exactly the loss of the same
conversations one per padded sample, at data parallel 2 and at context parallel 2 (upstream's THD split), and so
do those of `pretrain_mamba.py`'s hybrid model (its Mamba layers scanning each conversation on its own)."""

import pytest
import torch

from megatron.training.datasets.sft_dataset import SFTDatasetConfig, build_sft_datasets
from megatron.training.tokenizer.byte_level_tokenizer import ByteLevelTokenizer
from tests.unit_tests.multiprocess_harness import run_on_ranks
from tests.unit_tests.training.datasets.test_sft_dataset import write_conversations

SEQ = 128
SEED = 5
SFT_GPT = (f"--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length {SEQ} "
           f"--max-position-embeddings {SEQ} --position-embedding-type rope --normalization RMSNorm --swiglu "
           "--hidden-dropout 0 --attention-dropout 0 --make-vocab-size-divisible-by 64 --micro-batch-size 1 "
           f"--train-iters 1 --lr 1e-3 --seed {SEED} --init-method-std 0.3 --split 100,0,0 "
           "--tokenizer-type ByteLevelTokenizer --sft "
           "--sft-tokenizer-prompt-format plain --num-workers 0 --log-interval 1 --eval-iters 0 "
           "--distributed-backend gloo --use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params")


# pretrain_mamba.py's hybrid model: Mamba layers scan each packed conversation from a zero state.
HYBRID = "--hybrid-override-pattern M*- --num-layers 3 --mamba-head-dim 8 --mamba-num-groups 2 --mamba-state-dim 8"


def first_batch_conversations(path, rows, pad_multiple):
    """How many conversations (in the epoch's order) the first `rows` packed rows hold."""
    config = SFTDatasetConfig(random_seed=SEED, sequence_length=SEQ, tokenizer=ByteLevelTokenizer(),
                              blend=([path], None), prompt_format="plain", pad_multiple=pad_multiple)
    dataset = build_sft_datasets(config, (rows, 0, 0))[0]
    return sum(len(dataset.conversations_of_sample(row)) for row in range(rows))


def _packed_and_padded_losses(workdir, path, layout_args, pad_multiple, script=None):
    from tests.unit_tests.dist_checkpointing.pretrain_helpers import pretrain_records

    # A first global batch of packed rows whose conversations split evenly over 2 data-parallel ranks unpacked.
    rows = next(rows for rows in range(4, 12, 2) if first_batch_conversations(path, rows, pad_multiple) % 2 == 0)
    conversations = first_batch_conversations(path, rows, pad_multiple)
    assert conversations > rows  # rows do hold several conversations
    argv = f"{SFT_GPT} --data-path {path}"
    if script == "pretrain_mamba":
        argv += f" {HYBRID}"
    name = f"{pad_multiple}{script or ''}"
    packed = pretrain_records(f"{workdir}/packed{name}", f"{argv} --global-batch-size {rows} {layout_args}",
                              script=script)
    padded = pretrain_records(f"{workdir}/padded{name}",
                              f"{argv} --global-batch-size {conversations} --no-sft-packing", script=script)
    return packed[0]["lm loss"], padded[0]["lm loss"]


@pytest.mark.parametrize("world_size", [2])
def test_packed_conversations_train_on_the_loss_of_the_same_conversations_padded(world_size, tmp_path):
    path = write_conversations(tmp_path / "chat.jsonl", 60, seed=3)
    data_parallel = run_on_ranks(world_size, _packed_and_padded_losses, str(tmp_path), path, "", 1)[0]
    context_parallel = run_on_ranks(world_size, _packed_and_padded_losses, str(tmp_path), path,
                                    "--context-parallel-size 2", 4)[0]
    hybrid = run_on_ranks(world_size, _packed_and_padded_losses, str(tmp_path), path, "", 1, "pretrain_mamba")[0]
    hybrid_context_parallel = run_on_ranks(world_size, _packed_and_padded_losses, str(tmp_path), path,
                                           "--context-parallel-size 2", 4, "pretrain_mamba")[0]
    for packed, padded in (data_parallel, context_parallel, hybrid, hybrid_context_parallel):
        # The same per-token losses of the same conversations, summed in another order (fp32).
        torch.testing.assert_close(torch.tensor(packed), torch.tensor(padded), rtol=1e-6, atol=0)
        # --init-method-std 0.3 makes the untrained model's guesses sharp and wrong: above the uniform ln 257 = 5.55
        # (7.47 measured). Attending across the packed conversations moves the loss by 9e-4 to 4e-3 relative.
        assert 6.0 < packed < 9.0
