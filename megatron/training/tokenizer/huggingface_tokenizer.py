"""`HuggingFaceTokenizer`: any `tokenizer.json` loadable by the `tokenizers` package (e.g. a locally trained BPE),
or a Hugging Face tokenizer directory without one (a slow tokenizer, or one whose class is code in the directory),
loaded with `transformers.AutoTokenizer.from_pretrained` (`--trust-remote-code` lets that run the directory's code).
"""

import os
import types

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


class PreTrainedTokenizerBackend:
    """The `tokenizers.Tokenizer` calls `TokenizersBackedTokenizer` makes, answered by a `transformers` tokenizer."""

    def __init__(self, pretrained):
        self.pretrained = pretrained

    def encode(self, text, add_special_tokens=False):
        return types.SimpleNamespace(ids=list(self.pretrained.encode(text, add_special_tokens=add_special_tokens)))

    def decode(self, token_ids, skip_special_tokens=False):
        return self.pretrained.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def get_vocab_size(self, with_added_tokens=True):
        return len(self.pretrained)

    def token_to_id(self, token):
        token_id = self.pretrained.convert_tokens_to_ids(token)
        unknown = token_id is None or (token_id == self.pretrained.unk_token_id and token != self.pretrained.unk_token)
        return None if unknown else token_id


def load_pretrained_tokenizer(directory, trust_remote_code=False):
    """`transformers.AutoTokenizer.from_pretrained(directory, trust_remote_code=...)`, for a tokenizer directory
    that has no tokenizer.json."""
    try:
        from transformers import AutoTokenizer
    except ImportError as error:
        raise ImportError(f"--tokenizer-model {directory!r} holds no tokenizer.json; loading it needs the "
                          "`transformers` package: pip install transformers") from error
    return AutoTokenizer.from_pretrained(directory, trust_remote_code=trust_remote_code)


class HuggingFaceTokenizer(TokenizersBackedTokenizer):
    """Loads `--tokenizer-model path/tokenizer.json` (or a directory holding it) with the `tokenizers` package; a
    directory without tokenizer.json with `transformers.AutoTokenizer`, which runs the directory's tokenizer code
    only under `trust_remote_code` (`--trust-remote-code`)."""

    def __init__(self, tokenizer_model, eod_token=None, pad_token=None, trust_remote_code=False):
        if tokenizer_model is not None and os.path.isdir(tokenizer_model) and not os.path.isfile(
                os.path.join(tokenizer_model, "tokenizer.json")):
            self.tokenizer_path = tokenizer_model
            pretrained = load_pretrained_tokenizer(tokenizer_model, trust_remote_code)
            super().__init__(PreTrainedTokenizerBackend(pretrained), eod_token or pretrained.eos_token,
                             pad_token or pretrained.pad_token)
            return
        tokenizers = _import_tokenizers()
        self.tokenizer_path = resolve_tokenizer_json(tokenizer_model)
        super().__init__(tokenizers.Tokenizer.from_file(self.tokenizer_path), eod_token, pad_token)
