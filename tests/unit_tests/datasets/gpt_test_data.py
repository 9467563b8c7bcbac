"""Small on-disk token datasets shared by the dataset tests."""

import numpy as np

from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

VOCAB_SIZE = 100
EOD = VOCAB_SIZE - 1  # the last id ends documents (EodOnlyTokenizer below; NullTokenizer(VOCAB_SIZE - 1).eod)


class EodOnlyTokenizer:
    """The bit of the tokenizer interface the dataset uses."""

    eod = EOD
    vocab_size = VOCAB_SIZE


def write_documents(prefix, num_documents, seed, min_length=1, max_length=30):
    """Random documents of ids in [0, EOD), each ending with EOD; returns the list of documents."""
    rng = np.random.default_rng(seed)
    documents = []
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    for _ in range(num_documents):
        body = rng.integers(0, EOD, size=int(rng.integers(min_length, max_length + 1)))
        document = np.append(body, EOD)
        builder.add_document(document, [len(document)])
        documents.append(document)
    builder.finalize(prefix + ".idx")
    return documents
