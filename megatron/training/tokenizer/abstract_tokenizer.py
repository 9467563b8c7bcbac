"""The interface every tokenizer offers to the data pipeline and the training loop."""

from abc import ABC, abstractmethod


class MegatronTokenizer(ABC):
    """Text <-> token ids. `eod` ends a document in the packed token stream; `pad` fills unused positions."""

    @abstractmethod
    def tokenize(self, text):
        """Token ids (a list of ints) for `text`, with no special tokens added."""

    @abstractmethod
    def detokenize(self, token_ids):
        """The text for a sequence of ids."""

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

    def __repr__(self):
        return f"{type(self).__name__}(vocab_size={self.vocab_size}, eod={self.eod}, pad={self.pad})"
