"""Tokenizers behind one interface (`tokenize`, `detokenize`, `vocab_size`, `eod`, `pad`) and `build_tokenizer`."""

from megatron.training.tokenizer.abstract_tokenizer import MegatronTokenizer
from megatron.training.tokenizer.byte_level_tokenizer import ByteLevelTokenizer
from megatron.training.tokenizer.file_errors import TokenizerFileError
from megatron.training.tokenizer.gpt2_bpe_tokenizer import GPT2BPETokenizer
from megatron.training.tokenizer.huggingface_tokenizer import HuggingFaceTokenizer
from megatron.training.tokenizer.null_tokenizer import NullTokenizer
from megatron.training.tokenizer.sentencepiece_tokenizer import (
    GPTSentencePieceTokenizer,
    Llama2Tokenizer,
    SentencePieceTokenizer,
)
from megatron.training.tokenizer.sft_tokenizer import SFTTokenizer
from megatron.training.tokenizer.tokenizer import (
    TOKENIZER_TYPES,
    build_tokenizer,
    build_tokenizer_from_args,
    exact_padding_divisor,
    pad_vocab_size,
    padded_vocab_message,
)

__all__ = [
    "MegatronTokenizer",
    "ByteLevelTokenizer",
    "GPT2BPETokenizer",
    "HuggingFaceTokenizer",
    "NullTokenizer",
    "SentencePieceTokenizer",
    "GPTSentencePieceTokenizer",
    "Llama2Tokenizer",
    "SFTTokenizer",
    "TOKENIZER_TYPES",
    "TokenizerFileError",
    "build_tokenizer",
    "build_tokenizer_from_args",
    "exact_padding_divisor",
    "pad_vocab_size",
    "padded_vocab_message",
]
