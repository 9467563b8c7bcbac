"""`ByteLevelTokenizer`: one id per UTF-8 byte plus an end-of-document id; needs no vocabulary files."""

from megatron.training.tokenizer.abstract_tokenizer import MegatronTokenizer

NUM_BYTES = 256


class ByteLevelTokenizer(MegatronTokenizer):
    """Ids 0..255 are bytes, 256 is end-of-document (vocab size 257)."""

    def __init__(self):
        super().__init__()

    def tokenize(self, text):
        return list(text.encode("utf-8"))

    def detokenize(self, token_ids):
        # Special ids carry no text; a byte sequence cut mid-character decodes with a replacement mark.
        return bytes(int(token) for token in token_ids if 0 <= int(token) < NUM_BYTES).decode("utf-8", errors="replace")

    @property
    def vocab_size(self):
        return NUM_BYTES + 1

    @property
    def eod(self):
        return NUM_BYTES
