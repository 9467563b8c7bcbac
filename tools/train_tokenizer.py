"""Train a byte-level BPE tokenizer on a JSONL corpus (default: the bundled standard-library corpus).

    python tools/train_tokenizer.py --input data/corpus/stdlib_docs.jsonl --vocab-size 8192 --output-dir tok/
    # -> tok/tokenizer.json (--tokenizer-type HuggingFaceTokenizer --tokenizer-model tok/tokenizer.json)
    #    tok/vocab.json + tok/merges.txt (--tokenizer-type GPT2BPETokenizer --vocab-file ... --merge-file ...)
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir)))

from megatron.training.tokenizer.bpe_training import save_bpe_tokenizer, train_bpe_tokenizer  # noqa: E402

DEFAULT_CORPUS = os.path.join(os.path.dirname(__file__), os.path.pardir, "data", "corpus", "stdlib_docs.jsonl")


def iterate_texts(input_path, json_keys):
    """The `json_keys` strings of every document of the JSONL file; raises ValueError naming the line at fault."""
    with open(input_path, encoding="utf-8") as input_file:
        for line_number, line in enumerate(input_file, start=1):
            if not line.strip():
                continue
            try:
                document = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"--input {input_path} line {line_number} is not JSON ({error})") from None
            if not isinstance(document, dict):
                raise ValueError(f"--input {input_path} line {line_number} is not a JSON object")
            for key in json_keys:
                if not isinstance(document.get(key), str):
                    found = (f"no key {key!r}" if key not in document
                             else f"a {type(document[key]).__name__} under {key!r}, not a string")
                    raise ValueError(f"--json-keys {key}: line {line_number} of --input {input_path} has {found} "
                                     f"(its keys: {', '.join(sorted(document))})")
                yield document[key]


def main(argv=None):
    parser = argparse.ArgumentParser(description="Train a byte-level BPE tokenizer with the `tokenizers` package.")
    parser.add_argument("--input", default=os.path.normpath(DEFAULT_CORPUS), help="JSONL corpus")
    parser.add_argument("--json-keys", nargs="+", default=["text"])
    parser.add_argument("--vocab-size", type=int, required=True)
    parser.add_argument("--min-frequency", type=int, default=2)
    parser.add_argument("--output-dir", required=True)
    args = parser.parse_args(argv)
    if not os.path.isfile(args.input):
        parser.error(f"--input {args.input!r} is not a file (give a JSONL corpus, one JSON document a line)")
    try:
        backend = train_bpe_tokenizer(iterate_texts(args.input, args.json_keys), args.vocab_size, args.min_frequency)
    except ValueError as error:
        raise SystemExit(f"train_tokenizer.py: {error}; nothing was written") from error
    path = save_bpe_tokenizer(backend, args.output_dir)
    print(f"trained a {backend.get_vocab_size()}-token BPE on {args.input}; saved {path}")
    return path


if __name__ == "__main__":
    main()
