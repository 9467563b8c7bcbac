"""Upstream's tokenizers over a SentencePiece `.model` file (`--tokenizer-model`), run by the `sentencepiece`
package (`pip install sentencepiece`):

- `SentencePieceTokenizer`: the model's pieces, then upstream's special tokens `<CLS>`, `<SEP>`, `<EOD>`, `<MASK>`
  and the model's pad / bos / eos pieces (`<PAD>`, `<BOS>`, `<EOS>` where it has none) appended where the model
  lacks them, then `--vocab-extra-ids` `<extra_id_N>` tokens. Their spellings in a text are those tokens; `<EOD>`
  ends a document.
- `GPTSentencePieceTokenizer`: the model as it is; its eos ends a document.
- `Llama2Tokenizer`: the model as it is; `tokenize` starts every text with the model's bos, and its eos ends a
  document.
"""

from megatron.training.tokenizer.abstract_tokenizer import MegatronTokenizer, WithoutClassificationTokens
from megatron.training.tokenizer.file_errors import check_tokenizer_file, reading_tokenizer_files


def _import_sentencepiece(tokenizer_type):
    try:
        import sentencepiece
    except ImportError as error:
        raise ImportError(f"--tokenizer-type {tokenizer_type} reads its --tokenizer-model .model file with the "
                          "`sentencepiece` package, which is not installed: pip install sentencepiece") from error
    return sentencepiece


def load_sentencepiece_model(tokenizer_type, model_file):
    """A `sentencepiece.SentencePieceProcessor` of `model_file`; errors name --tokenizer-model and the path."""
    if model_file is None:
        raise ValueError(f"--tokenizer-type {tokenizer_type} needs --tokenizer-model (the SentencePiece .model file)")
    file_flags = (("--tokenizer-model", model_file),)
    check_tokenizer_file(tokenizer_type, file_flags, model_file)
    sentencepiece = _import_sentencepiece(tokenizer_type)
    with reading_tokenizer_files(tokenizer_type, file_flags, source="sentencepiece"):
        return sentencepiece.SentencePieceProcessor(model_file=model_file)


class SentencePieceTokenizer(MegatronTokenizer):
    """Upstream's `_SentencePieceTokenizer` (see the module docstring for its ids)."""

    def __init__(self, model_file, vocab_extra_ids=0):
        super().__init__(model_file, vocab_extra_ids=vocab_extra_ids)
        self.tokenizer = load_sentencepiece_model(type(self).__name__, model_file)
        self._vocab = {self.tokenizer.id_to_piece(index): index for index in range(len(self.tokenizer))}
        self._inv_vocab = {index: piece for piece, index in self._vocab.items()}
        self._special_tokens = {}
        self._extra_id_tokens = []
        self._add_special_tokens(vocab_extra_ids)

    def _model_piece(self, piece_id, fallback):
        """The model's piece for one of its special ids (-1 where it has none): `fallback` then."""
        return self.tokenizer.id_to_piece(piece_id) if 0 <= piece_id < len(self.tokenizer) else fallback

    def _add_special_token(self, token):
        if token not in self._vocab:
            self._vocab[token] = len(self._vocab)
            self._inv_vocab[self._vocab[token]] = token
        self._special_tokens[token] = self._vocab[token]
        return self._vocab[token]

    def _add_special_tokens(self, vocab_extra_ids):
        self._cls_id = self._add_special_token("<CLS>")
        self._sep_id = self._add_special_token("<SEP>")
        self._eod_id = self._add_special_token("<EOD>")
        self._mask_id = self._add_special_token("<MASK>")
        self._pad_id = self._add_special_token(self._model_piece(self.tokenizer.pad_id(), "<PAD>"))
        self._bos_id = self._add_special_token(self._model_piece(self.tokenizer.bos_id(), "<BOS>"))
        self._eos_id = self._add_special_token(self._model_piece(self.tokenizer.eos_id(), "<EOS>"))
        for index in range(vocab_extra_ids):
            self._extra_id_tokens.append(f"<extra_id_{index}>")
            self._add_special_token(self._extra_id_tokens[-1])
        self._inv_special_tokens = {token_id: token for token, token_id in self._special_tokens.items()}

    def tokenize(self, text):
        """The model's ids of the text between special-token spellings, and the special tokens' ids."""
        ids, start = [], 0
        while True:
            found = [(text.find(token, start), token) for token in self._special_tokens]
            found = [(position, token) for position, token in found if position >= 0]
            if not found:
                break
            position, token = min(found, key=lambda match: match[0])
            ids.extend(self.tokenizer.encode_as_ids(text[start:position]))
            ids.append(self._special_tokens[token])
            start = position + len(token)
        ids.extend(self.tokenizer.encode_as_ids(text[start:]))
        return ids

    def detokenize(self, ids):
        """As upstream's: each special token spelled out with a space on either side."""
        text, start = "", 0
        ids = [int(token_id) for token_id in ids]
        for index, token_id in enumerate(ids):
            if token_id in self._inv_special_tokens:
                text += self.tokenizer.decode_ids(ids[start:index]) + " " + self._inv_special_tokens[token_id] + " "
                start = index + 1
        return text + self.tokenizer.decode_ids(ids[start:])

    def offsets(self, ids, text):
        """Where each id's piece starts in the decoded text (upstream's; sentencepiece >= 0.2.1 names the call
        `decode_ids_as_proto`)."""
        decode = getattr(self.tokenizer, "decode_ids_as_immutable_proto", None) or self.tokenizer.decode_ids_as_proto
        return [piece.begin for piece in decode([int(token_id) for token_id in ids]).pieces]

    @property
    def vocab_size(self):
        return len(self._vocab)

    @property
    def vocab(self):
        return self._vocab

    @property
    def inv_vocab(self):
        return self._inv_vocab

    @property
    def encoder(self):
        return self._vocab

    @property
    def decoder(self):
        return self._inv_vocab

    @property
    def cls(self):
        return self._cls_id

    @property
    def sep(self):
        return self._sep_id

    @property
    def pad(self):
        return self._pad_id

    @property
    def bos(self):
        return self._bos_id

    @property
    def eod(self):
        return self._eod_id

    @property
    def eos(self):
        return self._eos_id

    @property
    def mask(self):
        return self._mask_id

    @property
    def additional_special_tokens_ids(self):
        return [self._vocab[token] for token in self._extra_id_tokens]


class GPTSentencePieceTokenizer(WithoutClassificationTokens, SentencePieceTokenizer):
    """Upstream's `_GPTSentencePieceTokenizer`: the model's own ids, no added tokens; eod is its eos."""

    def __init__(self, model_file):
        super().__init__(model_file, vocab_extra_ids=0)

    def _add_special_tokens(self, vocab_extra_ids):
        self._pad_id = self.tokenizer.pad_id()
        self._bos_id = self.tokenizer.bos_id()
        self._eos_id = self.tokenizer.eos_id()

    def tokenize(self, text):
        return self.tokenizer.encode_as_ids(text)

    def detokenize(self, ids):
        return self.tokenizer.decode_ids([int(token_id) for token_id in ids])

    @property
    def eod(self):
        return self._eos_id


class Llama2Tokenizer(GPTSentencePieceTokenizer):
    """Upstream's `_Llama2Tokenizer`: `tokenize` starts with the model's bos (`bos=True`), and ends with its eos
    only under `eos=True`; eod is the eos."""

    def tokenize(self, text, bos=True, eos=False):
        if not isinstance(text, str):
            raise TypeError(f"Llama2Tokenizer.tokenize takes a str, got {type(text).__name__}")
        ids = self.tokenizer.encode(text)
        return ([self._bos_id] if bos else []) + ids + ([self._eos_id] if eos else [])
