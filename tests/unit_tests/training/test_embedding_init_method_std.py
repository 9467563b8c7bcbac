"""`--embedding-init-method-std` through `pretrain()`: the embeddings start from normal(0, that std) and take no
weight decay; without the flag they start from normal(0, --init-method-std) and are decayed.

The check needs no optimizer replay: the padding rows of the vocabulary (120 tokens padded to 128) and the
position rows past the sequence length (16 of 24) are never looked up, so their gradients are zero and AdamW
leaves them at their initial values times prod_t(1 - lr_t * wd) over the steps, with wd = 0 for parameters
exempt from weight decay. Those initial values are drawn here by hand, from each table's init seed (see
`init_seeds`), and the learning rates come from the schedule's formula.
"""

import math

import pytest
import torch

from megatron.core.models.common.embeddings.language_model_embedding import (
    position_embedding_init_seed,
    word_embedding_init_seed,
)
from tests.unit_tests.multiprocess_harness import run_on_ranks

SEED = 1234  # --seed's default
EMBEDDING_STD, INIT_STD, WEIGHT_DECAY = 1.0, 0.02, 0.1
TRUE_VOCAB, PADDED_VOCAB, HIDDEN = 120, 128, 32  # TINY_GPT's --vocab-size, padded to a multiple of 64
SEQ_LENGTH, MAX_POSITIONS = 16, 24
ITERATIONS = 3
SCHEDULE = (f"--weight-decay {WEIGHT_DECAY} --max-position-embeddings {MAX_POSITIONS} --num-layers 1 "
            f"--global-batch-size 2 --train-iters {ITERATIONS} --lr-decay-iters {ITERATIONS} --lr-warmup-iters 1")
# TINY_GPT's --lr 5e-3 --min-lr 5e-4, cosine: step 0 is the warmup's first (lr 0), then cosine over 2 steps.
LEARNING_RATES = (0.0, 5e-3, 5e-4 + (5e-3 - 5e-4) * 0.5 * (1 + math.cos(math.pi * 0.5)))


def _initial_table(seed, rows, std):
    generator = torch.Generator().manual_seed(seed)
    return torch.empty(rows, HIDDEN).normal_(0.0, std, generator=generator)


def _train_and_read_embeddings(workdir, extra_args):
    import pretrain_gpt
    from megatron.core.distributed import unwrap_model
    from tests.unit_tests.dist_checkpointing.pretrain_helpers import run_pretrain

    models = []

    def forward_step(data_iterator, model):
        models.append(model)
        return pretrain_gpt.forward_step(data_iterator, model)

    losses = run_pretrain(workdir, f"{SCHEDULE} {extra_args}", forward_step)
    embedding = unwrap_model(models[0]).embedding
    return (losses, embedding.word_embeddings.weight.detach().clone(),
            embedding.position_embeddings.weight.detach().clone())


@pytest.mark.parametrize("flag_set", [True, False], ids=["embedding_std_set", "unset"])
def test_embeddings_start_from_the_requested_std_and_take_no_weight_decay(tmp_path, flag_set):
    extra_args = f"--embedding-init-method-std {EMBEDDING_STD}" if flag_set else ""
    losses, word, position = run_on_ranks(1, _train_and_read_embeddings, str(tmp_path), extra_args)[0]
    assert sorted(losses) == list(range(1, ITERATIONS + 1))
    assert all(math.isfinite(loss) for loss in losses.values())

    std = EMBEDDING_STD if flag_set else INIT_STD
    initial_word = _initial_table(word_embedding_init_seed(SEED), PADDED_VOCAB, std)
    initial_position = _initial_table(position_embedding_init_seed(SEED), MAX_POSITIONS, std)
    assert word.shape == initial_word.shape and position.shape == initial_position.shape
    # The rows the tokens and positions use were trained.
    assert not torch.equal(word[:TRUE_VOCAB - 1], initial_word[:TRUE_VOCAB - 1])
    assert not torch.equal(position[:SEQ_LENGTH], initial_position[:SEQ_LENGTH])
    # Never looked up: the initial draws, untouched with the flag, shrunk by every step's weight decay without it.
    unused_word, unused_position = word[TRUE_VOCAB:], position[SEQ_LENGTH:]
    if flag_set:
        assert torch.equal(unused_word, initial_word[TRUE_VOCAB:])
        assert torch.equal(unused_position, initial_position[SEQ_LENGTH:])
    else:
        shrink = math.prod(1 - lr * WEIGHT_DECAY for lr in LEARNING_RATES)
        torch.testing.assert_close(unused_word, initial_word[TRUE_VOCAB:] * shrink, rtol=1e-6, atol=0)
        torch.testing.assert_close(unused_position, initial_position[SEQ_LENGTH:] * shrink, rtol=1e-6, atol=0)
