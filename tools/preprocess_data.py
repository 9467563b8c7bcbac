"""Tokenize a JSONL corpus into Megatron's indexed format (`PREFIX_<key>_document.bin` / `.idx`).

    python tools/preprocess_data.py --input corpus.jsonl --output-prefix my_corpus \
        --tokenizer-type GPT2BPETokenizer --vocab-file vocab.json --merge-file merges.txt \
        --json-keys text --append-eod --workers 4

Each input line is one JSON document; each `--json-keys` key gives one output dataset in which every document is
one sequence. A key whose value is a list of strings is a document already split into sentences: one sequence per
non-empty sentence. A document whose text is empty is kept as a document of no sequences (as upstream), so document
i of every key's `.idx` is the i-th JSON line; blank lines are skipped. `--split-sentences` splits text values into
sentences with nltk's punkt models (`pip install nltk`, then `python -m nltk.downloader punkt_tab`) and writes
`PREFIX_<key>_sentence.bin` / `.idx`. Documents are tokenized by a pool of `--workers` processes in chunks, and
results are written in input order, so the output does not depend on the number of workers. `--input` may also be
a glob pattern (`'shards/*.jsonl'`), as upstream's with `--partitions`: the matching files are read in the sorted
order of their names; it may name several files or patterns, read in the order given; files ending in `.gz` are
read through gzip. A line that is not UTF-8 JSON, lacks a key
or holds text the tokenizer refuses stops the run, naming its file and line; the outputs are written as `.partial`
files and renamed at the end, so a failed run leaves a dataset already at the prefix as it was.
"""

import argparse
import glob
import gzip
import json
import multiprocessing
import os
import sys
import time

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir)))

from megatron.core.datasets.indexed_dataset import (  # noqa: E402
    IndexedDatasetBuilder,
    data_file_path,
    index_file_path,
    optimal_token_dtype,
)
from megatron.training.tokenizer.arguments import add_tokenizer_file_arguments, vocab_extra_ids_refusal  # noqa: E402
from megatron.training.tokenizer import TOKENIZER_TYPES, TokenizerFileError, build_tokenizer_from_args  # noqa: E402

DOCUMENTS_PER_CHUNK = 32
# The outputs are written as PREFIX_<key>_document.bin.partial / .idx.partial and renamed when the run succeeds.
PARTIAL_SUFFIX = ".partial"
# Punkt is slow on very long texts: --split-sentences splits a text in pieces of this many characters (as upstream).
SENTENCE_SPLIT_PIECE_CHARACTERS = 1_000_000

# Each worker process builds its own tokenizer once (tokenizers are not cheap to pickle per document).
_worker_tokenizer = None
_worker_splitter = None
_worker_settings = None


def _tokenizer_from_args(args):
    return build_tokenizer_from_args(args)


def sentence_splitter(lang, keep_newlines):
    """nltk's punkt sentence splitter for `--lang`; with `--keep-newlines`, one that leaves the whitespace after a
    sentence (newlines included) at its end instead of dropping it. Raises SystemExit when nltk or its punkt data
    for the language is missing."""
    try:
        from nltk.tokenize import punkt
    except ImportError:
        raise SystemExit("--split-sentences needs the nltk package, which is not installed: pip install nltk, then "
                         "python -m nltk.downloader punkt_tab (or drop --split-sentences: each document is then "
                         "one sequence, which is what GPT training reads)") from None
    try:
        if hasattr(punkt, "PunktTokenizer"):  # nltk >= 3.9 reads the punkt_tab tables
            splitter = punkt.PunktTokenizer(lang)
        else:
            import nltk

            splitter = nltk.data.load(f"tokenizers/punkt/{lang}.pickle")
    except (LookupError, OSError, ValueError) as error:
        # nltk's message is a banner of asterisks around "Resource punkt_tab not found." and search paths.
        first_line = next((line.strip() for line in str(error).splitlines() if any(c.isalnum() for c in line)),
                          type(error).__name__)
        raise SystemExit(f"--split-sentences --lang {lang}: nltk has no punkt model for this language ({first_line}); "
                         "run python -m nltk.downloader punkt_tab (set NLTK_DATA to where it is installed), or give "
                         "another --lang") from None
    if not keep_newlines:
        return splitter

    class KeepWhitespaceLanguageVars(punkt.PunktLanguageVars):
        # Punkt's own pattern requires whitespace after a sentence end and consumes it; here the whitespace is
        # optional and stays with the sentence, so newlines in the text survive the split.
        _period_context_fmt = r"""
            \S*                          # word material
            %(SentEndChars)s             # a possible sentence end
            \s*                          # the whitespace after it, kept
            (?=(?P<after_tok>
                %(NonWord)s              # punctuation
                |
                (?P<next_tok>\S+)        # or the next word
            ))"""

    return punkt.PunktSentenceTokenizer(train_text=splitter._params, lang_vars=KeepWhitespaceLanguageVars())


def _split_sentences(splitter, text):
    pieces = range(0, len(text), SENTENCE_SPLIT_PIECE_CHARACTERS)
    return [sentence for start in pieces
            for sentence in splitter.tokenize(text[start:start + SENTENCE_SPLIT_PIECE_CHARACTERS])]


def _initialize_worker(args, splitter_factory=None):
    global _worker_tokenizer, _worker_splitter, _worker_settings
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    _worker_tokenizer = _tokenizer_from_args(args)
    _worker_splitter = None
    if args.split_sentences:
        _worker_splitter = (splitter_factory or sentence_splitter)(args.lang, args.keep_newlines)
    _worker_settings = (tuple(args.json_keys), args.append_eod)


def _sentences_of(value):
    """The texts of one key's value: [value] for a string (split with --split-sentences), the list of a list of
    strings; None when it is neither."""
    if isinstance(value, str):
        return _split_sentences(_worker_splitter, value) if _worker_splitter is not None else [value]
    if isinstance(value, list) and all(isinstance(sentence, str) for sentence in value):
        return value
    return None


def _unencodable_text_problem(text):
    """What makes `text` no Unicode text a tokenizer takes (a lone surrogate, from a JSON escape such as "\\ud800"
    without its pair), or None."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        return (f"holds a lone surrogate {text[error.start]!r} at character {error.start}, which is not Unicode "
                "text; repair or drop the document")
    return None


def _hint(error):
    """What to do about a tokenizer error whose message does not say: NullTokenizer reads integers only."""
    if type(_worker_tokenizer).__name__ == "NullTokenizer" and "invalid literal for int()" in str(error):
        return (" (--tokenizer-type NullTokenizer reads each text as token ids separated by whitespace; tokenize "
                "words with a real tokenizer)")
    return ""


def encode_document(raw_line):
    """One JSONL line (bytes) -> ({key: (token ids, sequence lengths)}, bytes read, None), or (None, bytes read,
    what is wrong with it) for a document the keys or the tokenizer cannot take (reported by the reader, with its
    line number). Each non-empty sentence is one sequence (a whole text is one sentence without --split-sentences);
    --append-eod ends the last one with the eod. A blank line is no document: ({}, bytes read, None)."""
    json_keys, append_eod = _worker_settings
    if not raw_line.strip():
        return {}, len(raw_line), None
    try:
        line = raw_line.decode("utf-8")
    except UnicodeDecodeError as error:
        return None, len(raw_line), (f"not UTF-8 text (byte 0x{raw_line[error.start]:02x} at byte {error.start} of "
                                     "the line); the input must be UTF-8 encoded JSON lines")
    try:
        document = json.loads(line)
    except ValueError as error:
        return None, len(raw_line), f"not a JSON document ({error})"
    if not isinstance(document, dict):
        return None, len(raw_line), (f"not a JSON object but a {type(document).__name__}; each line must be "
                                     "{key: text}")
    encoded = {}
    for key in json_keys:
        if key not in document:
            return None, len(raw_line), f"document has no key {key!r} (keys: {sorted(document)}); check --json-keys"
        sentences = _sentences_of(document[key])
        if sentences is None:
            return None, len(raw_line), (f"{key!r} must be a string or a list of strings (sentences), got "
                                         f"{type(document[key]).__name__} {json.dumps(document[key])[:40]}")
        token_ids, lengths = [], []
        try:
            for sentence in sentences:
                sentence_ids = _worker_tokenizer.tokenize(sentence)
                if sentence_ids:
                    token_ids.extend(sentence_ids)
                    lengths.append(len(sentence_ids))
        except (ValueError, TypeError) as error:  # the `tokenizers` package raises TypeError for a lone surrogate
            return None, len(raw_line), f"{key!r}: {_unencodable_text_problem(sentence) or error}{_hint(error)}"
        if token_ids and append_eod:
            token_ids.append(_worker_tokenizer.eod)
            lengths[-1] += 1
        encoded[key] = (token_ids, lengths)
    return encoded, len(raw_line), None


class ProgressLog:
    """Prints documents/s and MB/s every `interval` documents (to `stream`, by default the current stderr)."""

    def __init__(self, interval, stream=None):
        self.interval = interval
        self.stream = sys.stderr if stream is None else stream
        self.start = time.perf_counter()
        self.documents = 0
        self.bytes_read = 0

    def update(self, bytes_read):
        self.documents += 1
        self.bytes_read += bytes_read
        if self.interval > 0 and self.documents % self.interval == 0:
            self.report()

    def report(self):
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        print(
            f"processed {self.documents} documents ({self.documents / elapsed:.1f} docs/s, "
            f"{self.bytes_read / elapsed / 1e6:.3f} MB/s)",
            file=self.stream,
            flush=True,
        )


def input_files(patterns):
    """The files `--input` names, in its order: each file itself, else the files matching it as a glob pattern,
    sorted. `patterns` is one path or pattern, or a list of them."""
    return [path for pattern in ([patterns] if isinstance(patterns, str) else patterns)
            for path in _files_of_pattern(pattern)]


def _files_of_pattern(pattern):
    if os.path.isfile(pattern):
        return [pattern]
    return sorted(path for path in glob.glob(pattern) if os.path.isfile(path))


def _open_binary(path):
    """The file's bytes (decompressed for .gz); lines are decoded one by one, so a byte that is not UTF-8 is named
    with its line."""
    return gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb")


def _read_lines(paths):
    for path in paths:
        with _open_binary(path) as input_file:
            yield from input_file


def _line_origin(paths, line_number):
    """(file, line in that file) of line `line_number` (from 1) of the files read one after another."""
    for path in paths:
        with _open_binary(path) as input_file:
            lines = sum(1 for _ in input_file)
        if line_number <= lines:
            return path, line_number
        line_number -= lines
    return paths[-1], line_number


def output_prefix_for_key(output_prefix, key, split_sentences=False):
    return f"{output_prefix}_{key}_{'sentence' if split_sentences else 'document'}"


def _partial(path):
    """Where `path` is written until the run succeeds: a failed run leaves a dataset already at `path` as it was."""
    return path + PARTIAL_SUFFIX


def _remove_partial_outputs(builders, prefixes):
    """A failed run leaves nothing of its own behind (and no `.bin` without its `.idx`)."""
    for key, prefix in prefixes.items():
        builders[key].close()
        if os.path.exists(_partial(data_file_path(prefix))):
            os.remove(_partial(data_file_path(prefix)))


def _finalize_outputs(builders, prefixes):
    """Write each key's index, then move its `.bin` and `.idx` to their names (replacing an earlier run's)."""
    for key, prefix in prefixes.items():
        builders[key].finalize(_partial(index_file_path(prefix)))
        for path in (data_file_path(prefix), index_file_path(prefix)):
            os.replace(_partial(path), path)


def preprocess(args, splitter_factory=None):
    """Run the conversion; returns {json key: output path prefix}. `splitter_factory(lang, keep_newlines)` builds
    the --split-sentences splitter (default: nltk's punkt, `sentence_splitter`)."""
    try:
        tokenizer = _tokenizer_from_args(args)
    except TokenizerFileError as error:  # a file the tokenizer cannot read: the message names the flags and paths
        raise SystemExit(str(error)) from error
    except (ValueError, OSError, ImportError) as error:  # a missing flag or package, named in the message
        raise SystemExit(f"cannot build the --tokenizer-type {args.tokenizer_type} tokenizer: {error}") from error
    if args.split_sentences:  # fail here, before any worker starts, when nltk or its data is missing
        (splitter_factory or sentence_splitter)(args.lang, args.keep_newlines)
    os.makedirs(os.path.dirname(os.path.abspath(args.output_prefix)), exist_ok=True)
    dtype = optimal_token_dtype(tokenizer.vocab_size)
    prefixes = {key: output_prefix_for_key(args.output_prefix, key, args.split_sentences) for key in args.json_keys}
    builders = {key: IndexedDatasetBuilder(_partial(data_file_path(prefix)), dtype=dtype)
                for key, prefix in prefixes.items()}
    progress = ProgressLog(args.log_interval)
    paths = input_files(args.input)
    lines = _read_lines(paths)
    if args.workers > 1:
        pool = multiprocessing.Pool(args.workers, initializer=_initialize_worker,
                                    initargs=(args, splitter_factory))
        encoded_documents = pool.imap(encode_document, lines, DOCUMENTS_PER_CHUNK)
    else:
        pool = None
        _initialize_worker(args, splitter_factory)
        encoded_documents = map(encode_document, lines)
    try:
        for line_number, (encoded, bytes_read, problem) in enumerate(encoded_documents, start=1):
            if problem is not None:
                _remove_partial_outputs(builders, prefixes)
                path, line_in_file = _line_origin(paths, line_number)
                raise SystemExit(f"{path}, line {line_in_file}: {problem}; nothing was written")
            for key, (token_ids, lengths) in encoded.items():
                # An empty text stays a document (of no sequences), keeping every key aligned with the input.
                builders[key].add_document(token_ids, lengths)
            progress.update(bytes_read)
    except SystemExit:
        raise
    except BaseException:
        _remove_partial_outputs(builders, prefixes)
        raise
    finally:
        if pool is not None:
            pool.close()
            pool.join()
        lines.close()
    _finalize_outputs(builders, prefixes)
    progress.report()
    return prefixes


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description="Tokenize JSONL documents into Megatron .bin/.idx files.")
    group = parser.add_argument_group("input")
    group.add_argument("--input", required=True, nargs="+",
                       help="JSONL file, one JSON document per line, or a glob pattern of such files (read in sorted "
                       "order); several are read one after another; .gz files are decompressed")
    group.add_argument("--json-keys", nargs="+", default=["text"], help="keys to tokenize, one output per key")
    group.add_argument("--split-sentences", action="store_true",
                       help="split each text into sentences (nltk punkt; needs nltk installed), one sequence per "
                       "sentence, written as PREFIX_<key>_sentence")
    group.add_argument("--keep-newlines", action="store_true",
                       help="with --split-sentences: keep the newlines between sentences (without it, a text is "
                       "tokenized whole, newlines included)")
    group.add_argument("--lang", default="english", help="with --split-sentences: the language of the punkt model")
    group = parser.add_argument_group("tokenizer")
    group.add_argument("--tokenizer-type", required=True, choices=TOKENIZER_TYPES,
                       help=f"one of {', '.join(TOKENIZER_TYPES)} (the SentencePiece types need the sentencepiece "
                       "package)")
    group.add_argument("--vocab-size", type=int, default=None,
                       help="for NullTokenizer; for TikTokenizer, the vocabulary with the special tokens "
                       "(default 131072)")
    # --vocab-file, --merge-file, --tokenizer-model, --trust-remote-code, tiktoken settings, --vocab-extra-ids
    add_tokenizer_file_arguments(group)
    group.add_argument("--legacy-tokenizer", action="store_true",
                       help="accepted for upstream scripts (upstream then uses megatron.training.tokenizer); the "
                       "tokenizers here are always those of megatron.training.tokenizer")
    group.add_argument("--append-eod", action="store_true", help="end every document with the eod token")
    group = parser.add_argument_group("output")
    group.add_argument("--output-prefix", required=True, help="writes PREFIX_<key>_document.bin/.idx")
    group = parser.add_argument_group("runtime")
    group.add_argument("--workers", type=int, default=1, help="tokenizer processes")
    group.add_argument("--partitions", type=int, default=1,
                       help="accepted for upstream scripts; the input is read as one stream by the --workers pool, so "
                       "the output is the same for any value: documents in input order")
    group.add_argument("--keep-sequential-samples", action="store_true",
                       help="accepted for upstream scripts: documents are always written in input order")
    group.add_argument("--log-interval", type=int, default=1000, help="progress line every N documents")
    args = parser.parse_args(argv)
    if args.workers < 1:
        parser.error("--workers must be at least 1")
    if args.partitions < 1:
        parser.error("--partitions must be at least 1")
    if vocab_extra_ids_refusal(args.vocab_extra_ids, args.tokenizer_type):
        parser.error(vocab_extra_ids_refusal(args.vocab_extra_ids, args.tokenizer_type))
    for pattern in args.input:
        if not input_files(pattern):
            parser.error(f"--input {pattern!r} is not a file and matches no file as a glob pattern (give a JSONL "
                         "file, one JSON document per line, or a quoted pattern such as 'shards/*.jsonl')")
    if not args.split_sentences:
        for flag, given in (("--keep-newlines", args.keep_newlines), (f"--lang {args.lang}", args.lang != "english")):
            if given:
                print(f"note: {flag} has no effect without --split-sentences: each text is tokenized whole, "
                      "newlines included", file=sys.stderr)
    return args


def main(argv=None):
    return preprocess(parse_args(argv))


if __name__ == "__main__":
    main()
