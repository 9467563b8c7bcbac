"""`HuggingFaceTokenizer`: a Hugging Face tokenizer directory (or hub name) loaded with
`transformers.AutoTokenizer.from_pretrained`, as upstream (`--trust-remote-code` lets that run the directory's code),
or a bare `tokenizer.json` (e.g. a locally trained BPE, alone or in a directory without `tokenizer_config.json`)
loaded with the `tokenizers` package.

As upstream's: `tokenize` gives `AutoTokenizer(text).input_ids` (the special tokens the tokenizer adds, such as a
beginning-of-sequence token, included), `eod` is `eos_token_id`, `bos` is `bos_token_id`, and `vocab_size` is
`len(tokenizer)` (added tokens included). `pad` is `pad_token_id`, or `eod` where the tokenizer has none. A pad
token that plain text encodes to (an ordinary token such as GPT-2's `!` made the pad token) is no padding id: `pad`
is then `eod`, so the GPT dataset keeps that real token and its loss (upstream's legacy tokenizer has no `pad`).
"""

import os
import types

from megatron.training.tokenizer.abstract_tokenizer import MegatronTokenizer
from megatron.training.tokenizer.file_errors import check_tokenizer_file, reading_tokenizer_files

EOD_TOKEN_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>", "<|eos|>", "[EOS]", "<|end_of_text|>")
PAD_TOKEN_CANDIDATES = ("<pad>", "<|pad|>", "[PAD]")
BOS_TOKEN_CANDIDATES = ("<s>", "<bos>", "<|begin_of_text|>", "<|startoftext|>", "[BOS]")
# What `save_pretrained` writes beside the vocabulary: a directory holding it is a Hugging Face tokenizer directory.
TOKENIZER_CONFIG = "tokenizer_config.json"


def _import_tokenizers():
    try:
        import tokenizers
    except ImportError as error:
        raise ImportError(
            "this tokenizer type needs the `tokenizers` package: pip install tokenizers (or `pip install -e .[dev]`)"
        ) from error
    return tokenizers


def resolve_tokenizer_json(tokenizer_model):
    """Accept either a tokenizer.json path or a directory that contains one."""
    if tokenizer_model is None:
        raise ValueError("HuggingFaceTokenizer needs --tokenizer-model: a Hugging Face tokenizer directory or name, "
                         "or a tokenizer.json file")
    path = os.path.join(tokenizer_model, "tokenizer.json") if os.path.isdir(tokenizer_model) else tokenizer_model
    check_tokenizer_file("HuggingFaceTokenizer", (("--tokenizer-model", tokenizer_model),), path)
    return path


class TokenizersBackedTokenizer(MegatronTokenizer):
    """Adapter from a `tokenizers.Tokenizer` to the Megatron interface."""

    def __init__(self, backend, eod_token=None, pad_token=None, bos_token=None, search_candidates=True):
        """Special tokens given as None are looked up among the usual spellings when `search_candidates`; else the
        tokenizer has no such token (padding then uses the end-of-document id)."""
        if not hasattr(self, "unique_identifiers"):  # subclasses name their files first
            super().__init__()
        self._backend = backend
        self._vocab = None
        self._eod = self._find_token_id(eod_token, EOD_TOKEN_CANDIDATES, "end-of-document")
        self._pad = self._find_token_id(pad_token, PAD_TOKEN_CANDIDATES if search_candidates else (), "padding",
                                        default=self._eod)
        if self._pad != self._eod and self._plain_text_encodes_to(self._pad):
            # The dataset masks and zeroes `pad` labels: an id that text produces is a real token, not padding.
            self._pad = self._eod
        self._bos = self._find_token_id(bos_token, BOS_TOKEN_CANDIDATES if search_candidates else (),
                                        "beginning-of-sequence", required=False)

    def _find_token_id(self, requested, candidates, role, default=None, required=True):
        names = (requested,) if requested is not None else candidates
        for name in names:
            token_id = self._backend.token_to_id(name)
            if token_id is not None:
                return token_id
        if default is not None or not required:
            return default
        raise ValueError(f"the tokenizer has no {role} token; looked for {', '.join(names)}")

    def _plain_text_encodes_to(self, token_id):
        """Whether the token's own text, its special tokens read as plain text, encodes to `token_id` alone."""
        text = self._backend.decode([token_id], skip_special_tokens=False)
        if not text:
            return False
        if isinstance(self._backend, PreTrainedTokenizerBackend):
            return self._backend.encode_plain_text(text) == [token_id]
        reads_special_tokens_as_text = self._backend.encode_special_tokens
        self._backend.encode_special_tokens = True
        try:
            return self._backend.encode(text, add_special_tokens=False).ids == [token_id]
        finally:
            self._backend.encode_special_tokens = reads_special_tokens_as_text

    @property
    def backend(self):
        return self._backend

    def tokenize(self, text, add_special_tokens=True):
        """The ids of `text`, with the special tokens the tokenizer's post-processor adds (none for a plain BPE)."""
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def detokenize(self, token_ids, skip_special_tokens=False):
        """The text of `token_ids`, their special tokens spelled out unless `skip_special_tokens`."""
        return self._backend.decode([int(token) for token in token_ids], skip_special_tokens=skip_special_tokens)

    def offsets(self, ids, text):
        """Where each of the `ids` of `text` starts in it, as upstream's: from the characters each token of `text`
        re-tokenized covers; a token covering none (a special token) starts where the previous one ended."""
        if isinstance(self._backend, PreTrainedTokenizerBackend):
            spans = self._backend.char_spans(text)
        else:
            encoding = self._backend.encode(text)
            spans = [encoding.token_to_chars(index) for index in range(len(encoding.ids))]
        starts, next_start = [], 0
        for index in range(len(ids)):
            span = spans[index] if index < len(spans) else None
            if span is None:
                starts.append(next_start)
            else:
                starts.append(span[0])
                next_start = span[1]
        return starts

    def _load_vocab(self):
        if self._vocab is None:
            self._vocab = dict(self._backend.get_vocab(with_added_tokens=True))
            self._inv_vocab = {token_id: token for token, token_id in self._vocab.items()}

    @property
    def vocab(self):
        """Token -> id, added tokens included."""
        self._load_vocab()
        return self._vocab

    @property
    def inv_vocab(self):
        """Id -> token, added tokens included."""
        self._load_vocab()
        return self._inv_vocab

    @property
    def encoder(self):
        return self.vocab

    @property
    def decoder(self):
        return self.inv_vocab

    @property
    def vocab_size(self):
        return self._backend.get_vocab_size(with_added_tokens=True)

    @property
    def eod(self):
        return self._eod

    @property
    def bos(self):
        """Id of the beginning-of-sequence token; None where the tokenizer has none."""
        return self._bos

    @property
    def pad(self):
        return self._pad


class PreTrainedTokenizerBackend:
    """The `tokenizers.Tokenizer` calls `TokenizersBackedTokenizer` makes, answered by a `transformers` tokenizer."""

    def __init__(self, pretrained):
        self.pretrained = pretrained

    def encode(self, text, add_special_tokens=True):
        return types.SimpleNamespace(ids=list(self.pretrained.encode(text, add_special_tokens=add_special_tokens)))

    def decode(self, token_ids, skip_special_tokens=False):
        return self.pretrained.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def encode_plain_text(self, text):
        """The ids of `text` with no special tokens added and its special tokens' spellings read as plain text;
        None where the tokenizer (a custom class) cannot read them so."""
        try:
            return list(self.pretrained.encode(text, add_special_tokens=False, split_special_tokens=True))
        except (TypeError, ValueError):
            return None

    def get_vocab_size(self, with_added_tokens=True):
        return len(self.pretrained)

    def get_vocab(self, with_added_tokens=True):
        return self.pretrained.get_vocab()

    def char_spans(self, text):
        """(start, end) of the characters each token of `text` covers; None for a token covering none."""
        encoding = self.pretrained(text)
        spans = [encoding.token_to_chars(index) for index in range(len(encoding.input_ids))]
        return [None if span is None else (span.start, span.end) for span in spans]

    def token_to_id(self, token):
        token_id = self.pretrained.convert_tokens_to_ids(token)
        unknown = token_id is None or (token_id == self.pretrained.unk_token_id and token != self.pretrained.unk_token)
        return None if unknown else token_id


def load_pretrained_tokenizer(tokenizer_model, trust_remote_code=False, **from_pretrained_kwargs):
    """`transformers.AutoTokenizer.from_pretrained(tokenizer_model, trust_remote_code=..., **from_pretrained_kwargs)`:
    a tokenizer directory or a hub name, as upstream."""
    file_flags = (("--tokenizer-model", tokenizer_model),)
    try:
        from transformers import AutoTokenizer
    except ImportError as error:
        raise ImportError(f"--tokenizer-model {tokenizer_model!r} is a Hugging Face tokenizer directory or name; "
                          "loading it needs the `transformers` package: pip install transformers") from error
    with reading_tokenizer_files("HuggingFaceTokenizer", file_flags, source="transformers.AutoTokenizer"):
        return AutoTokenizer.from_pretrained(tokenizer_model, trust_remote_code=trust_remote_code,
                                             **from_pretrained_kwargs)


def loads_with_auto_tokenizer(tokenizer_model):
    """A directory `save_pretrained` wrote (it has tokenizer_config.json), one without tokenizer.json, or a name
    that is no local path; a tokenizer.json file, or a directory holding only one, loads with `tokenizers`."""
    if tokenizer_model is None:
        return False
    if os.path.isfile(tokenizer_model):
        return False
    if os.path.isdir(tokenizer_model):
        return os.path.isfile(os.path.join(tokenizer_model, TOKENIZER_CONFIG)) or not os.path.isfile(
            os.path.join(tokenizer_model, "tokenizer.json"))
    return not tokenizer_model.endswith(".json")


class HuggingFaceTokenizer(TokenizersBackedTokenizer):
    """`--tokenizer-model DIR` (or a hub name) with `transformers.AutoTokenizer`, which runs the directory's tokenizer
    code only under `trust_remote_code` (`--trust-remote-code`); `--tokenizer-model path/tokenizer.json`, or a
    directory holding only that file, with the `tokenizers` package. Further keywords (`padding_side="left"`,
    `use_fast=False`, ...) go to `from_pretrained`, as upstream's; a bare tokenizer.json takes none."""

    def __init__(self, tokenizer_model, eod_token=None, pad_token=None, trust_remote_code=False,
                 **from_pretrained_kwargs):
        file_flags = (("--tokenizer-model", tokenizer_model),)
        MegatronTokenizer.__init__(self, tokenizer_model, trust_remote_code=trust_remote_code, **from_pretrained_kwargs)
        if loads_with_auto_tokenizer(tokenizer_model):
            self.tokenizer_path = tokenizer_model
            pretrained = load_pretrained_tokenizer(tokenizer_model, trust_remote_code, **from_pretrained_kwargs)
            # A tokenizer without an eos_token still gets an end-of-document id from the usual spellings.
            with reading_tokenizer_files("HuggingFaceTokenizer", file_flags):
                super().__init__(PreTrainedTokenizerBackend(pretrained), eod_token or pretrained.eos_token,
                                 pad_token or getattr(pretrained, "pad_token", None),
                                 getattr(pretrained, "bos_token", None), search_candidates=False)
            return
        if from_pretrained_kwargs:
            raise ValueError(
                f"--tokenizer-model {tokenizer_model} is a bare tokenizer.json, read with the `tokenizers` package; "
                f"the keywords {', '.join(sorted(from_pretrained_kwargs))} are for "
                "transformers.AutoTokenizer.from_pretrained: give a tokenizer directory with tokenizer_config.json "
                "(save_pretrained writes one), or drop the keywords")
        tokenizers = _import_tokenizers()
        self.tokenizer_path = resolve_tokenizer_json(tokenizer_model)
        source = None if self.tokenizer_path == tokenizer_model else self.tokenizer_path
        with reading_tokenizer_files("HuggingFaceTokenizer", file_flags, source=source):
            super().__init__(tokenizers.Tokenizer.from_file(self.tokenizer_path), eod_token, pad_token)

    @property
    def eos(self):
        """Id of the end-of-sequence token: the end-of-document one."""
        return self.eod
