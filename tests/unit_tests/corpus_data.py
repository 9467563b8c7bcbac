"""A slice of the bundled corpus (data/corpus/stdlib_docs.jsonl) as an indexed dataset of byte-level tokens."""

import json
import os

import numpy as np

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CORPUS = os.path.join(REPO_ROOT, "data", "corpus", "stdlib_docs.jsonl")
BYTE_LEVEL_EOD = 256


def write_corpus_prefix(directory, num_documents):
    """Tokenize the first `num_documents` documents as ByteLevelTokenizer does (bytes, then end-of-document);
    returns the `--data-path` prefix."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    prefix = os.path.join(str(directory), "stdlib_docs_text_document")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    with open(CORPUS, encoding="utf-8") as corpus:
        for _, line in zip(range(num_documents), corpus):
            ids = list(json.loads(line)["text"].encode("utf-8")) + [BYTE_LEVEL_EOD]
            builder.add_document(np.array(ids, dtype=np.uint16), [len(ids)])
    builder.finalize(prefix + ".idx")
    return prefix
