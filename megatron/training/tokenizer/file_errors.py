"""The errors of the tokenizer file flags (--vocab-file, --merge-file, --tokenizer-model): a missing file, a
directory or an empty file where a file is expected, or a file its tokenizer cannot parse (swapped flags, a corrupt
or foreign file) stops with one message naming --tokenizer-type, each file flag with its path, the reason and what
each flag should name. Training, the inference scripts and tools/preprocess_data.py all build their tokenizers
(and so get these errors) through `build_tokenizer`."""

import contextlib
import os

# What each file flag of a tokenizer type names.
EXPECTED_FILES = {
    ("GPT2BPETokenizer", "--vocab-file"): "vocab.json",
    ("GPT2BPETokenizer", "--merge-file"): "merges.txt",
    ("HuggingFaceTokenizer", "--tokenizer-model"): "a Hugging Face tokenizer directory or its tokenizer.json",
    ("TikTokenizer", "--tokenizer-model"): "a tiktoken .json vocabulary, a list of {rank, token_bytes, token_str}",
    **{(sentencepiece_type, "--tokenizer-model"): "a SentencePiece .model file"
       for sentencepiece_type in ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer")},
}

# The BaseException (not an Exception) the Rust `tokenizers` package raises for some files it cannot read, such as
# a merges.txt whose merges make tokens that the vocab.json lacks.
RUST_PANIC = "PanicException"


class TokenizerFileError(Exception):
    """A tokenizer file flag names no file its tokenizer can read (raised as one of the two kinds below)."""


class TokenizerFileContentError(TokenizerFileError, ValueError):
    """The file is there but holds no tokenizer of its type (empty, unparsable, or one without an end-of-document
    token)."""


class TokenizerFilePathError(TokenizerFileError, FileNotFoundError):
    """No file to read at the path: it is missing, a directory, or the system refuses to open it."""


def tokenizer_file_message(tokenizer_type, file_flags, reason):
    """The message of every `TokenizerFileError`: `file_flags` is ((flag, path), ...), the flags the tokenizer
    read."""
    named = " ".join(f"{flag} {path}" for flag, path in file_flags)
    expected = ", ".join(f"{flag} {EXPECTED_FILES.get((tokenizer_type, flag), 'its file')}" for flag, _ in file_flags)
    return (f"cannot build the --tokenizer-type {tokenizer_type} tokenizer from {named}: {reason}; check that each "
            f"flag names the right file ({expected})")


def check_tokenizer_file(tokenizer_type, file_flags, path):
    """Stop unless `path` (one of `file_flags`' paths, or the file a directory flag leads to) is a non-empty file."""
    if os.path.isdir(path):
        raise TokenizerFilePathError(tokenizer_file_message(tokenizer_type, file_flags,
                                                            f"{path} is a directory, not a file"))
    elif not os.path.exists(path):
        raise TokenizerFilePathError(tokenizer_file_message(tokenizer_type, file_flags, f"{path}: no such file"))
    elif os.path.getsize(path) == 0:
        raise TokenizerFileContentError(tokenizer_file_message(tokenizer_type, file_flags, f"{path} is empty"))


@contextlib.contextmanager
def reading_tokenizer_files(tokenizer_type, file_flags, source=None):
    """Turn what reading `file_flags` raises (the `tokenizers` package raises a bare Exception for a file it cannot
    parse, `json` a JSONDecodeError without the path) into a `TokenizerFileError`, its reason led by `source` (the
    file a directory flag led to, or the loader) where given; a missing package stays an ImportError."""
    try:
        yield
    except BaseException as error:
        panicked = type(error).__name__ == RUST_PANIC
        if isinstance(error, (TokenizerFileError, ImportError)) or not (panicked or isinstance(error, Exception)):
            raise  # already named, a missing package, or KeyboardInterrupt / SystemExit
        reason = str(error).strip() or type(error).__name__
        if panicked:
            reason = f"the tokenizers package failed reading them ({reason})"
        if source is not None:
            reason = f"{source}: {reason}"
        kind = TokenizerFilePathError if isinstance(error, OSError) else TokenizerFileContentError
        raise kind(tokenizer_file_message(tokenizer_type, file_flags, reason)) from error
