"""`HuggingFaceTokenizer`: any `tokenizer.json` loadable by the `tokenizers` package (e.g. a locally trained BPE)."""

import os

from megatron.training.tokenizer.abstract_tokenizer import MegatronTokenizer

EOD_TOKEN_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>", "<|eos|>", "[EOS]", "<|end_of_text|>")
PAD_TOKEN_CANDIDATES = ("<pad>", "<|pad|>", "[PAD]")


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
        raise ValueError("HuggingFaceTokenizer needs --tokenizer-model pointing at a tokenizer.json file")
    path = os.path.join(tokenizer_model, "tokenizer.json") if os.path.isdir(tokenizer_model) else tokenizer_model
    if not os.path.isfile(path):
        raise FileNotFoundError(f"--tokenizer-model {tokenizer_model!r}: no tokenizer file at {path}")
    return path


class TokenizersBackedTokenizer(MegatronTokenizer):
    """Adapter from a `tokenizers.Tokenizer` to the Megatron interface."""

    def __init__(self, backend, eod_token=None, pad_token=None):
        self._backend = backend
        self._eod = self._find_token_id(eod_token, EOD_TOKEN_CANDIDATES, "end-of-document")
        self._pad = self._find_token_id(pad_token, PAD_TOKEN_CANDIDATES, "padding", default=self._eod)

    def _find_token_id(self, requested, candidates, role, default=None):
        names = (requested,) if requested is not None else candidates
        for name in names:
            token_id = self._backend.token_to_id(name)
            if token_id is not None:
                return token_id
        if default is not None:
            return default
        raise ValueError(f"the tokenizer has no {role} token; looked for {', '.join(names)}")

    @property
    def backend(self):
        return self._backend

    def tokenize(self, text):
        return self._backend.encode(text, add_special_tokens=False).ids

    def detokenize(self, token_ids):
        return self._backend.decode([int(token) for token in token_ids], skip_special_tokens=False)

    @property
    def vocab_size(self):
        return self._backend.get_vocab_size(with_added_tokens=True)

    @property
    def eod(self):
        return self._eod

    @property
    def pad(self):
        return self._pad


class HuggingFaceTokenizer(TokenizersBackedTokenizer):
    """Loads `--tokenizer-model path/tokenizer.json` (or a directory holding it) with the `tokenizers` package."""

    def __init__(self, tokenizer_model, eod_token=None, pad_token=None):
        tokenizers = _import_tokenizers()
        self.tokenizer_path = resolve_tokenizer_json(tokenizer_model)
        super().__init__(tokenizers.Tokenizer.from_file(self.tokenizer_path), eod_token, pad_token)
