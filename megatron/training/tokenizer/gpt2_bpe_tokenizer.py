"""`GPT2BPETokenizer`: byte-level BPE from user-supplied GPT-2 style `vocab.json` + `merges.txt`."""

from megatron.training.tokenizer.abstract_tokenizer import MegatronTokenizer
from megatron.training.tokenizer.file_errors import check_tokenizer_file, reading_tokenizer_files
from megatron.training.tokenizer.huggingface_tokenizer import TokenizersBackedTokenizer, _import_tokenizers

GPT2_EOD_TOKEN = "<|endoftext|>"


class GPT2BPETokenizer(TokenizersBackedTokenizer):
    """GPT-2's byte-level BPE; the end-of-document token is `<|endoftext|>` from the vocabulary file."""

    def __init__(self, vocab_file, merge_file):
        file_flags = (("--vocab-file", vocab_file), ("--merge-file", merge_file))
        MegatronTokenizer.__init__(self, vocab_file, merge_file)
        for flag, path in file_flags:
            if path is None:
                raise ValueError(f"GPT2BPETokenizer needs {flag}")
        for _, path in file_flags:
            check_tokenizer_file("GPT2BPETokenizer", file_flags, path)
        tokenizers = _import_tokenizers()
        with reading_tokenizer_files("GPT2BPETokenizer", file_flags):
            model = tokenizers.models.BPE.from_file(vocab_file, merge_file)
            backend = tokenizers.Tokenizer(model)
            backend.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
            backend.decoder = tokenizers.decoders.ByteLevel()
            super().__init__(backend, eod_token=GPT2_EOD_TOKEN)
