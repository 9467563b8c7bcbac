"""Tokenize a JSONL corpus into Megatron's indexed format (`PREFIX_<key>_document.bin` / `.idx`).

    python tools/preprocess_data.py --input corpus.jsonl --output-prefix my_corpus \
        --tokenizer-type GPT2BPETokenizer --vocab-file vocab.json --merge-file merges.txt \
        --json-keys text --append-eod --workers 4

Each input line is one JSON document; each `--json-keys` key gives one output dataset in which every
non-empty document is one sequence. Documents are tokenized by a pool of `--workers` processes in chunks, and
results are written in input order, so the output does not depend on the number of workers.
"""

import argparse
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
from megatron.training.argument_groups.data import add_tokenizer_file_arguments  # noqa: E402
from megatron.training.tokenizer import TOKENIZER_TYPES, build_tokenizer_from_args  # noqa: E402

DOCUMENTS_PER_CHUNK = 32

# Each worker process builds its own tokenizer once (tokenizers are not cheap to pickle per document).
_worker_tokenizer = None
_worker_settings = None


def _tokenizer_from_args(args):
    return build_tokenizer_from_args(args)


def _initialize_worker(args):
    global _worker_tokenizer, _worker_settings
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    _worker_tokenizer = _tokenizer_from_args(args)
    _worker_settings = (tuple(args.json_keys), args.append_eod)


def encode_document(line):
    """One JSONL line -> ({key: token ids}, bytes read, None), or (None, bytes read, what is wrong with it) for a
    document the keys or the tokenizer cannot take (reported by the reader, with its line number). Blank lines
    yield no tokens."""
    json_keys, append_eod = _worker_settings
    if not line.strip():
        return {key: [] for key in json_keys}, len(line), None
    try:
        document = json.loads(line)
    except ValueError as error:
        return None, len(line), f"not a JSON document ({error})"
    encoded = {}
    for key in json_keys:
        if key not in document:
            return None, len(line), f"document has no key {key!r} (keys: {sorted(document)}); check --json-keys"
        try:
            token_ids = _worker_tokenizer.tokenize(document[key])
        except ValueError as error:
            return None, len(line), f"{key!r}: {error}"
        if token_ids and append_eod:
            token_ids.append(_worker_tokenizer.eod)
        encoded[key] = token_ids
    return encoded, len(line), None


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


def output_prefix_for_key(output_prefix, key):
    return f"{output_prefix}_{key}_document"


def _remove_partial_outputs(builders, prefixes):
    """A failed run leaves no `.bin` without its `.idx` behind."""
    for key, prefix in prefixes.items():
        builders[key].close()
        if os.path.exists(data_file_path(prefix)):
            os.remove(data_file_path(prefix))


def preprocess(args):
    """Run the conversion; returns {json key: output path prefix}."""
    try:
        tokenizer = _tokenizer_from_args(args)
    except (ValueError, OSError, ImportError) as error:  # a missing file, flag or package, named in the message
        raise SystemExit(f"cannot build the --tokenizer-type {args.tokenizer_type} tokenizer: {error}") from error
    os.makedirs(os.path.dirname(os.path.abspath(args.output_prefix)), exist_ok=True)
    dtype = optimal_token_dtype(tokenizer.vocab_size)
    prefixes = {key: output_prefix_for_key(args.output_prefix, key) for key in args.json_keys}
    builders = {key: IndexedDatasetBuilder(data_file_path(prefix), dtype=dtype) for key, prefix in prefixes.items()}
    progress = ProgressLog(args.log_interval)
    with open(args.input, "r", encoding="utf-8") as input_file:
        if args.workers > 1:
            pool = multiprocessing.Pool(args.workers, initializer=_initialize_worker, initargs=(args,))
            encoded_documents = pool.imap(encode_document, input_file, DOCUMENTS_PER_CHUNK)
        else:
            pool = None
            _initialize_worker(args)
            encoded_documents = map(encode_document, input_file)
        try:
            for line_number, (encoded, bytes_read, problem) in enumerate(encoded_documents, start=1):
                if problem is not None:
                    _remove_partial_outputs(builders, prefixes)
                    raise SystemExit(f"{args.input}, line {line_number}: {problem}; nothing was written")
                for key, token_ids in encoded.items():
                    if token_ids:
                        builders[key].add_document(token_ids, [len(token_ids)])
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
    for key, prefix in prefixes.items():
        builders[key].finalize(index_file_path(prefix))
    progress.report()
    return prefixes


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description="Tokenize JSONL documents into Megatron .bin/.idx files.")
    group = parser.add_argument_group("input")
    group.add_argument("--input", required=True, help="JSONL file, one JSON document per line")
    group.add_argument("--json-keys", nargs="+", default=["text"], help="keys to tokenize, one output per key")
    group.add_argument("--split-sentences", action="store_true",
                       help="not supported: every document is written as one sequence (GPT training packs "
                       "documents, so sentence boundaries are not needed); drop the flag")
    group.add_argument("--keep-newlines", action="store_true", help="only with --split-sentences (not supported)")
    group.add_argument("--lang", default="english", help="only with --split-sentences (not supported)")
    group = parser.add_argument_group("tokenizer")
    group.add_argument("--tokenizer-type", required=True, choices=TOKENIZER_TYPES)
    group.add_argument("--vocab-size", type=int, default=None,
                       help="for NullTokenizer; for TikTokenizer, the vocabulary with the special tokens "
                       "(default 131072)")
    add_tokenizer_file_arguments(group)  # --vocab-file, --merge-file, --tokenizer-model, tiktoken settings
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
    if args.split_sentences or args.keep_newlines:
        parser.error("--split-sentences (and --keep-newlines) are not supported: each document is written as one "
                     "sequence of PREFIX_<key>_document, which is what GPT training reads; drop the flags")
    if not os.path.isfile(args.input):
        parser.error(f"--input {args.input!r} is not a file (a JSONL file, one JSON document per line)")
    return args


def main(argv=None):
    return preprocess(parse_args(argv))


if __name__ == "__main__":
    main()
