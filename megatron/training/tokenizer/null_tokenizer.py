"""`NullTokenizer`: text is already token ids separated by spaces; used with `--mock-data` and id-level tests."""

from megatron.training.tokenizer.abstract_tokenizer import MegatronTokenizer


class NullTokenizer(MegatronTokenizer):
    """Ids `0 .. vocab_size - 1`; the last id is the end-of-document token."""

    def __init__(self, vocab_size):
        if vocab_size is None or int(vocab_size) < 2:
            raise ValueError(f"NullTokenizer needs --vocab-size of at least 2 (got {vocab_size})")
        self._vocab_size = int(vocab_size)

    def tokenize(self, text):
        token_ids = [int(piece) for piece in text.split()]
        out_of_range = [token for token in token_ids if not 0 <= token < self._vocab_size]
        if out_of_range:
            raise ValueError(
                f"NullTokenizer got ids {out_of_range[:5]} outside [0, {self._vocab_size}); raise --vocab-size"
            )
        return token_ids

    def detokenize(self, token_ids):
        return " ".join(str(int(token)) for token in token_ids)

    @property
    def vocab_size(self):
        return self._vocab_size

    @property
    def eod(self):
        return self._vocab_size - 1
