"""Megatron's indexed token storage: a flat `.bin` of token ids plus an `.idx` describing where each sequence is.

Layout of the `.idx` file (little endian):

    magic            9 bytes   b"MMIDIDX\\x00\\x00"
    version          uint64    1
    dtype code       uint8     see `DTYPE_CODES`
    sequence count   uint64    S
    document count   uint64    D (= number of documents + 1)
    sequence lengths int32[S]  tokens per sequence
    sequence pointers int64[S] byte offset of each sequence in the `.bin`
    document indices int64[D]  sequence index where each document starts, then S

A document is a run of consecutive sequences (one sequence per document unless sentences were split).
Both files are memory-mapped by the reader, so opening a multi-GB dataset costs nothing up front.
"""

import os
import shutil
import struct

import numpy as np

INDEX_MAGIC = b"MMIDIDX\x00\x00"
INDEX_VERSION = 1
_HEADER_STRUCT = struct.Struct("<QBQQ")  # version, dtype code, sequence count, document count
HEADER_SIZE = len(INDEX_MAGIC) + _HEADER_STRUCT.size

DTYPE_CODES = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}
_CODE_OF_DTYPE = {np.dtype(dtype): code for code, dtype in DTYPE_CODES.items()}


class IndexFileError(ValueError):
    """An `.idx`/`.bin` pair that is missing, corrupt, truncated or inconsistent."""


def data_file_path(path_prefix):
    return path_prefix + ".bin"


def index_file_path(path_prefix):
    return path_prefix + ".idx"


# Megatron-Core's names.
get_bin_path = data_file_path
get_idx_path = index_file_path


def dtype_code(dtype):
    try:
        return _CODE_OF_DTYPE[np.dtype(dtype)]
    except KeyError:
        supported = ", ".join(np.dtype(d).name for d in DTYPE_CODES.values())
        raise ValueError(f"dtype {np.dtype(dtype).name} cannot be stored in an indexed dataset; use one of {supported}")


def optimal_token_dtype(vocab_size):
    """The smallest dtype that holds every id of a vocabulary (uint16 up to 65,500 ids, as Megatron does)."""
    if vocab_size is not None and vocab_size < 65500:
        return np.uint16
    return np.int32


def dataset_exists(path_prefix):
    return os.path.isfile(index_file_path(path_prefix)) and os.path.isfile(data_file_path(path_prefix))


def write_index_file(idx_path, dtype, sequence_lengths, document_indices):
    """Write an `.idx` for sequences stored back to back (pointers follow from the lengths)."""
    lengths = np.asarray(sequence_lengths, dtype=np.int32)
    documents = np.asarray(document_indices, dtype=np.int64)
    itemsize = np.dtype(dtype).itemsize
    pointers = np.zeros(len(lengths), dtype=np.int64)
    if len(lengths) > 1:
        np.cumsum(lengths[:-1].astype(np.int64) * itemsize, out=pointers[1:])
    with open(idx_path, "wb") as index_file:
        index_file.write(INDEX_MAGIC)
        index_file.write(_HEADER_STRUCT.pack(INDEX_VERSION, dtype_code(dtype), len(lengths), len(documents)))
        index_file.write(lengths.tobytes(order="C"))
        index_file.write(pointers.tobytes(order="C"))
        index_file.write(documents.tobytes(order="C"))


class IndexedDatasetBuilder:
    """Streams sequences into a `.bin` and writes the matching `.idx` on `finalize`.

    `add_item` appends one sequence; `end_document` closes the current document; `add_document` does both
    for a document given as a flat token list plus its sequence lengths; `add_index` appends a whole
    existing dataset (used to merge shards written by parallel workers). The arguments are upstream's; as its
    text builder (`multimodal=False`), this one ignores the `mode` / `modes` of sequences.
    """

    def __init__(self, bin_path, dtype=np.int32, multimodal=False):
        if multimodal:
            raise ValueError(f"IndexedDatasetBuilder({bin_path!r}, multimodal=True): multimodal datasets (a mode per "
                             "sequence) are not supported; build text datasets with multimodal=False")
        self.bin_path = bin_path
        self.dtype = np.dtype(dtype)
        dtype_code(self.dtype)  # reject unsupported dtypes before creating the file
        self._data_file = open(bin_path, "wb")
        self._sequence_lengths = []
        self._document_indices = [0]

    def _stored(self, tokens):
        """`tokens` flattened into this builder's dtype; ids the dtype cannot hold are refused, not wrapped around."""
        array = np.asarray(tokens).reshape(-1)
        if array.size and np.issubdtype(self.dtype, np.integer) and np.issubdtype(array.dtype, np.integer):
            limits = np.iinfo(self.dtype)
            low, high = int(array.min()), int(array.max())
            if low < limits.min or high > limits.max:
                raise ValueError(
                    f"token ids {low}..{high} do not fit this builder's dtype {self.dtype.name} ({limits.min}.."
                    f"{limits.max}) and would be stored wrapped around: build with a wider dtype, e.g. "
                    "optimal_token_dtype(tokenizer.vocab_size)"
                )
        return array.astype(self.dtype, copy=False)

    def add_item(self, tokens, mode=0):
        array = self._stored(tokens)
        self._data_file.write(array.tobytes(order="C"))
        self._sequence_lengths.append(array.size)

    def end_document(self):
        self._document_indices.append(len(self._sequence_lengths))

    def add_document(self, tokens, lengths, modes=None):
        array = self._stored(tokens)
        if sum(lengths) != array.size:
            raise ValueError(f"sequence lengths {list(lengths)} do not add up to the {array.size} tokens given")
        self._data_file.write(array.tobytes(order="C"))
        self._sequence_lengths.extend(int(length) for length in lengths)
        self.end_document()

    def add_index(self, path_prefix):
        """Append every sequence and document of the dataset at `path_prefix` (same dtype required)."""
        other = IndexedDataset(path_prefix)
        if other.dtype != self.dtype:
            raise ValueError(
                f"cannot merge {path_prefix}: its dtype is {other.dtype.name}, this builder writes {self.dtype.name}"
            )
        offset = len(self._sequence_lengths)
        self._sequence_lengths.extend(other.sequence_lengths.tolist())
        self._document_indices.extend((offset + other.document_indices[1:]).tolist())
        del other  # release the memory maps before copying the raw bytes
        with open(data_file_path(path_prefix), "rb") as source:
            shutil.copyfileobj(source, self._data_file)

    def close(self):
        """Close the `.bin` file without writing an index (an abandoned build)."""
        self._data_file.close()

    def finalize(self, idx_path):
        self._data_file.close()
        write_index_file(idx_path, self.dtype, self._sequence_lengths, self._document_indices)


class _IndexReader:
    """Validated, memory-mapped view of one `.idx` file."""

    def __init__(self, idx_path, bin_size):
        self.path = idx_path
        file_size = os.path.getsize(idx_path)
        if file_size < HEADER_SIZE:
            self._fail(f"it is {file_size} bytes, shorter than the {HEADER_SIZE}-byte header (truncated?)")
        with open(idx_path, "rb") as index_file:
            magic = index_file.read(len(INDEX_MAGIC))
            if magic != INDEX_MAGIC:
                self._fail(f"bad magic {magic!r}, expected {INDEX_MAGIC!r}: not a Megatron indexed dataset index")
            version, code, sequence_count, document_count = _HEADER_STRUCT.unpack(index_file.read(_HEADER_STRUCT.size))
        if version != INDEX_VERSION:
            self._fail(f"unsupported version {version}, this reader understands version {INDEX_VERSION}")
        if code not in DTYPE_CODES:
            self._fail(f"unknown dtype code {code}, known codes are {sorted(DTYPE_CODES)}")
        self.dtype = np.dtype(DTYPE_CODES[code])
        expected_size = HEADER_SIZE + sequence_count * (4 + 8) + document_count * 8
        if file_size != expected_size:
            self._fail(
                f"header declares {sequence_count} sequences and {document_count} document indices, which need "
                f"{expected_size} bytes, but the file has {file_size} bytes (truncated or corrupt)"
            )
        buffer = np.memmap(idx_path, mode="r", order="C") if file_size > 0 else np.zeros(0, np.uint8)
        offset = HEADER_SIZE
        self.sequence_lengths = np.frombuffer(buffer, dtype=np.int32, count=sequence_count, offset=offset)
        offset += self.sequence_lengths.nbytes
        self.sequence_pointers = np.frombuffer(buffer, dtype=np.int64, count=sequence_count, offset=offset)
        offset += self.sequence_pointers.nbytes
        self.document_indices = np.frombuffer(buffer, dtype=np.int64, count=document_count, offset=offset)
        self._check_consistency(bin_size)

    def _fail(self, problem):
        raise IndexFileError(f"invalid index file {self.path}: {problem}")

    def _check_consistency(self, bin_size):
        lengths = self.sequence_lengths
        if lengths.size and lengths.min() < 0:
            self._fail("it contains negative sequence lengths")
        itemsize = self.dtype.itemsize
        total_bytes = int(lengths.sum(dtype=np.int64)) * itemsize
        if total_bytes != bin_size:
            self._fail(
                f"its sequence lengths add up to {total_bytes} bytes of {self.dtype.name} tokens, but the data file "
                f"has {bin_size} bytes (the .bin and .idx do not belong together, or one is truncated)"
            )
        expected_pointers = np.zeros_like(self.sequence_pointers)
        if lengths.size > 1:
            np.cumsum(lengths[:-1].astype(np.int64) * itemsize, out=expected_pointers[1:])
        if not np.array_equal(expected_pointers, self.sequence_pointers):
            self._fail("its sequence pointers do not match the sequence lengths")
        documents = self.document_indices
        if documents.size == 0 or documents[0] != 0 or documents[-1] != lengths.size:
            self._fail(f"document indices must start at 0 and end at the sequence count {lengths.size}")
        if np.any(np.diff(documents) < 0):
            self._fail("document indices are not non-decreasing")


class _FileTokens:
    """The token ids of a `.bin` file read from it on demand: `tokens[start:stop]` opens the file and reads those
    ids only (no memory map, no copy of the file kept), so any number of ranks and DataLoader workers can read a
    dataset far larger than their memory."""

    def __init__(self, bin_path, dtype):
        self.bin_path = bin_path
        self.dtype = np.dtype(dtype)

    def __getitem__(self, window):
        start, stop = window.start, window.stop
        tokens = np.empty(max(stop - start, 0), dtype=self.dtype)
        buffer = memoryview(tokens).cast("B")
        read = 0
        with open(self.bin_path, "rb", buffering=0) as data_file:
            data_file.seek(start * self.dtype.itemsize)
            while read < tokens.nbytes:  # a raw read may return fewer bytes than asked for
                got = data_file.readinto(buffer[read:])
                if not got:
                    break
                read += got
        if read != tokens.nbytes:
            raise IndexFileError(f"{self.bin_path} ended after {read} of the {tokens.nbytes} bytes its index "
                                 f"places at byte {start * self.dtype.itemsize} (was it truncated?)")
        return tokens


class IndexedDataset:
    """Read-only access to the sequences of `path_prefix.bin` / `path_prefix.idx`.

    `dataset[i]` is sequence i as a numpy array; `dataset[a:b]` is a list of sequences; `get(i, offset,
    length)` reads part of a sequence without touching the rest. With `mmap=False` (`--no-mmap-bin-files`) the
    `.bin` is not memory-mapped: each read takes only the tokens it needs from the file, as upstream's (for
    filesystems where mapping is slow); nothing of the file is kept in memory.
    The arguments are upstream's, in its order; its multimodal datasets (a mode per sequence) and object storage
    (`object_storage_config`, `s3_config`: accepted as None) are not supported.
    """

    def __init__(self, path_prefix, multimodal=False, mmap=True, object_storage_config=None, s3_config=None):
        if object_storage_config is not None or s3_config is not None:
            raise ValueError(f"IndexedDataset({path_prefix!r}): reading from object storage (object_storage_config, "
                             "s3_config) is not supported; copy the .bin/.idx files to a local or shared filesystem "
                             "and open them with these arguments left None")
        if multimodal:
            raise ValueError(f"IndexedDataset({path_prefix!r}, multimodal=True): multimodal datasets (a mode per "
                             "sequence) are not supported; open text datasets with multimodal=False")
        self._open(path_prefix, mmap)

    @staticmethod
    def exists(path_prefix):
        """Whether both `path_prefix.idx` and `path_prefix.bin` exist, as upstream's."""
        return dataset_exists(path_prefix)

    def _open(self, path_prefix, mmap=True):
        self.path_prefix = path_prefix
        self.mmap = bool(mmap)
        bin_path, idx_path = data_file_path(path_prefix), index_file_path(path_prefix)
        missing = [path for path in (idx_path, bin_path) if not os.path.isfile(path)]
        if missing:
            raise FileNotFoundError(f"indexed dataset {path_prefix!r} is missing {', '.join(missing)}")
        bin_size = os.path.getsize(bin_path)
        self._index = _IndexReader(idx_path, bin_size)
        self.dtype = self._index.dtype
        # np.memmap cannot map an empty file; an empty dataset gets an empty array instead.
        if bin_size == 0:
            self._tokens = np.zeros(0, self.dtype)
        elif self.mmap:
            self._tokens = np.memmap(bin_path, mode="r", dtype=self.dtype, order="C")
        else:
            self._tokens = _FileTokens(bin_path, self.dtype)

    def __getstate__(self):
        # Reopen by path in another process (e.g. a spawned DataLoader worker) instead of pickling the maps.
        return (self.path_prefix, self.mmap)

    def __setstate__(self, state):
        path_prefix, mmap = state if isinstance(state, tuple) else (state, True)
        self._open(path_prefix, mmap)

    @property
    def sequence_lengths(self):
        return self._index.sequence_lengths

    @property
    def sequence_pointers(self):
        return self._index.sequence_pointers

    @property
    def document_indices(self):
        return self._index.document_indices

    @property
    def sequence_modes(self):
        """None: text datasets have no sequence modes (upstream's value without multimodal)."""
        return None

    def get_document_indices(self):
        """`document_indices`, by upstream's older accessor."""
        return self._index.document_indices

    def set_document_indices(self, document_indices):
        """Replace `document_indices` (upstream's accessor): which sequences make up each document."""
        self._index.document_indices = np.asarray(document_indices, dtype=np.int64)

    @property
    def num_documents(self):
        return len(self._index.document_indices) - 1

    def __len__(self):
        return len(self._index.sequence_lengths)

    def _token_start(self, idx):
        return int(self._index.sequence_pointers[idx]) // self.dtype.itemsize

    def __getitem__(self, idx):
        if isinstance(idx, slice):
            start, stop, step = idx.indices(len(self))
            if step != 1:
                raise ValueError("indexed datasets only support contiguous slices")
            return [self[i] for i in range(start, stop)]
        idx = int(idx)
        if idx < 0:
            idx += len(self)
        if not 0 <= idx < len(self):
            raise IndexError(f"sequence index {idx} out of range for {len(self)} sequences in {self.path_prefix}")
        start = self._token_start(idx)
        return np.array(self._tokens[start : start + int(self._index.sequence_lengths[idx])])

    def get(self, idx, offset=0, length=None):
        """Tokens `[offset, offset + length)` of sequence `idx` (to its end when `length` is None)."""
        sequence_length = int(self._index.sequence_lengths[idx])
        if length is None:
            length = sequence_length - offset
        if offset < 0 or length < 0 or offset + length > sequence_length:
            raise IndexError(
                f"cannot read {length} tokens at offset {offset} from sequence {idx} of length {sequence_length}"
            )
        start = self._token_start(idx) + offset
        return np.array(self._tokens[start : start + length])

    def document(self, document_idx):
        """All sequences of one document concatenated."""
        first, last = self._index.document_indices[document_idx], self._index.document_indices[document_idx + 1]
        if first == last:
            return np.zeros(0, dtype=self.dtype)
        start = self._token_start(first)
        stop = self._token_start(last - 1) + int(self._index.sequence_lengths[last - 1])
        return np.array(self._tokens[start:stop])
