"""`NullTokenizer`: text is already token ids separated by spaces; used with `--mock-data` and id-level tests."""

from megatron.training.tokenizer.abstract_tokenizer import MegatronTokenizer, WithoutClassificationTokens


class NullTokenizer(WithoutClassificationTokens, MegatronTokenizer):
    """Text ids `0 .. N - 1` for `--vocab-size N`, and the end-of-document token N after them: N + 1 ids in all,
    as upstream's NullTokenizer (so pre-tokenized data may use every id below N, and the padded vocabulary is
    upstream's)."""

    def __init__(self, vocab_size):
        if vocab_size is None or int(vocab_size) < 1:
            raise ValueError(f"NullTokenizer needs --vocab-size of at least 1 (got {vocab_size})")
        super().__init__(None, vocab_size=vocab_size)
        self._text_ids = int(vocab_size)

    def tokenize(self, text):
        token_ids = [int(piece) for piece in text.split()]
        out_of_range = [token for token in token_ids if not 0 <= token <= self._text_ids]
        if out_of_range:
            raise ValueError(
                f"NullTokenizer got ids {out_of_range[:5]} outside [0, {self._text_ids}] (--vocab-size "
                f"{self._text_ids}: the text ids 0..{self._text_ids - 1} and the end-of-document id "
                f"{self._text_ids}); raise --vocab-size"
            )
        return token_ids

    def detokenize(self, token_ids):
        return " ".join(str(int(token)) for token in token_ids)

    def offsets(self, ids, text):
        """Where each id of `detokenize(ids)` starts: the ids and the single spaces between them."""
        starts, start = [], 0
        for token in ids:
            starts.append(start)
            start += len(str(int(token))) + 1
        return starts

    @property
    def vocab_size(self):
        return self._text_ids + 1

    @property
    def eod(self):
        return self._text_ids
