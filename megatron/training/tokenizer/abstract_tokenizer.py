"""The interface every tokenizer offers to the data pipeline and the training loop."""

import json
from abc import ABC, abstractmethod
from collections import OrderedDict


class MegatronTokenizer(ABC):
    """Text <-> token ids. `eod` ends a document in the packed token stream; `pad` fills unused positions.

    As upstream's: `unique_identifiers` (the class, the tokenizer files and the options it was built with) and
    its JSON `unique_description` tell tokenizers apart; what a tokenizer lacks (`vocab`, `offsets`, `cls`, ...)
    raises NotImplementedError naming the class."""

    def __init__(self, *tokenizer_paths, **tokenizer_options):
        self.unique_identifiers = OrderedDict()
        self.unique_identifiers["class"] = type(self).__name__
        self.unique_identifiers["tokenizer_path"] = list(tokenizer_paths)
        for option, value in tokenizer_options.items():
            self.unique_identifiers[option] = str(value)
        self.unique_description = json.dumps(self.unique_identifiers, indent=4)

    @abstractmethod
    def tokenize(self, text):
        """Token ids (a list of ints) for `text`."""

    @abstractmethod
    def detokenize(self, token_ids):
        """The text for a sequence of ids."""

    def offsets(self, ids, text):
        """The character offset in `text` where each of its token `ids` starts."""
        raise NotImplementedError(f"{type(self).__name__} has no method 'offsets'")

    @property
    def vocab(self):
        """Token -> id dictionary."""
        raise NotImplementedError(f"{type(self).__name__} has no attribute 'vocab'")

    @property
    def inv_vocab(self):
        """Id -> token dictionary."""
        raise NotImplementedError(f"{type(self).__name__} has no attribute 'inv_vocab'")

    @property
    @abstractmethod
    def vocab_size(self):
        """Number of ids this tokenizer can produce (before the training code pads it)."""

    @property
    @abstractmethod
    def eod(self):
        """Id of the end-of-document token."""

    @property
    def pad(self):
        """Id used for padding; the end-of-document id unless the tokenizer has its own."""
        return self.eod

    @property
    def eos(self):
        raise NotImplementedError(f"{type(self).__name__} has no attribute 'eos'")

    @property
    def cls(self):
        raise NotImplementedError(f"{type(self).__name__} has no attribute 'cls'")

    @property
    def sep(self):
        raise NotImplementedError(f"{type(self).__name__} has no attribute 'sep'")

    @property
    def mask(self):
        raise NotImplementedError(f"{type(self).__name__} has no attribute 'mask'")

    def __repr__(self):
        return f"{type(self).__name__}(vocab_size={self.vocab_size}, eod={self.eod}, pad={self.pad})"


class WithoutClassificationTokens:
    """Upstream's answers for a language-model tokenizer: no classification, separator or mask token (-1 each) and
    no additional special tokens (None). Listed before `MegatronTokenizer` among the bases."""

    @property
    def cls(self):
        return -1

    @property
    def sep(self):
        return -1

    @property
    def mask(self):
        return -1

    @property
    def additional_special_tokens_ids(self):
        return None
