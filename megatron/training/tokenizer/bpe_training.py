"""Train a small byte-level BPE with the `tokenizers` package and save it for `HuggingFaceTokenizer`.

The saved `tokenizer.json` loads with `--tokenizer-type HuggingFaceTokenizer --tokenizer-model tokenizer.json`;
the `vocab.json` + `merges.txt` written next to it load with `--tokenizer-type GPT2BPETokenizer`.
"""

import os

from megatron.training.tokenizer.gpt2_bpe_tokenizer import GPT2_EOD_TOKEN
from megatron.training.tokenizer.huggingface_tokenizer import _import_tokenizers

PAD_TOKEN = "<pad>"
DEFAULT_SPECIAL_TOKENS = (GPT2_EOD_TOKEN, PAD_TOKEN)


def train_bpe_tokenizer(texts, vocab_size, min_frequency=2, special_tokens=DEFAULT_SPECIAL_TOKENS):
    """A byte-level BPE `tokenizers.Tokenizer` trained on an iterable of strings.

    All 256 byte symbols are in the initial alphabet, so any text round-trips, whatever the training data.
    """
    tokenizers = _import_tokenizers()
    minimum = 256 + len(special_tokens)
    if vocab_size < minimum:
        raise ValueError(f"a byte-level BPE needs --vocab-size of at least {minimum} (256 bytes + special tokens)")
    backend = tokenizers.Tokenizer(tokenizers.models.BPE())
    backend.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(special_tokens),
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(texts, trainer=trainer)
    return backend


def save_bpe_tokenizer(backend, output_dir):
    """Write `tokenizer.json`, `vocab.json` and `merges.txt` into `output_dir`; returns the tokenizer.json path."""
    os.makedirs(output_dir, exist_ok=True)
    tokenizer_path = os.path.join(output_dir, "tokenizer.json")
    backend.save(tokenizer_path)
    backend.model.save(output_dir)
    return tokenizer_path
