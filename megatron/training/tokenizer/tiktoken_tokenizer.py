"""`TikTokenizer` (`--tokenizer-type TikTokenizer`): a byte-level BPE over a tiktoken-format vocabulary, with
upstream Megatron-LM's file format, pre-tokenizer patterns and special-token layout, run by the `tiktoken`
package.

- Vocabulary file (`--tokenizer-model`, `.json`): a list of `{"rank": i, "token_bytes": base64, "token_str": s}`
  in rank order; the first 256 ranks are the single bytes 0..255. Ranks beyond the inner vocabulary
  (`vocab_size - num_special_tokens`) are dropped; a file of fewer ranks leaves the ids above them unused, and
  `vocab_size` is `--vocab-size` (default 131072) either way, as upstream.
- Ids: `0 .. num_special_tokens - 1` are special tokens (the given list, then `<SPECIAL_i>` fillers);
  BPE rank `r` has id `r + num_special_tokens`. `<unk>`, `<s>` and `</s>` must be among the specials; `</s>` ends
  a document (`eod`).
- Pre-tokenizer (`--tiktoken-pattern`): v1 splits numbers into single digits, v2 into groups of up to three.
"""

import base64
import json
import os

from megatron.training.tokenizer.abstract_tokenizer import MegatronTokenizer
from megatron.training.tokenizer.file_errors import (
    TokenizerFileContentError,
    check_tokenizer_file,
    reading_tokenizer_files,
    tokenizer_file_message,
)

PATTERN_V1 = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|"
              r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}|"
              r" ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
PATTERN_V2 = PATTERN_V1.replace(r"|\p{N}|", r"|\p{N}{1,3}|")
PATTERNS = {"v1": PATTERN_V1, "v2": PATTERN_V2}
DEFAULT_SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<mask>", "<pad>", "<cls>", "<sep>")
REQUIRED_SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")
DEFAULT_VOCAB_SIZE = 2**17
DEFAULT_NUM_SPECIAL_TOKENS = 1000


def load_mergeable_ranks(path, max_vocab=None):
    """{token bytes: rank} from a tiktoken-format JSON vocabulary, keeping the first `max_vocab` ranks."""
    file_flags = (("--tokenizer-model", path),)
    if not str(path).endswith(".json"):
        raise TokenizerFileContentError(tokenizer_file_message("TikTokenizer", file_flags,
                                                               "TikTokenizer reads a .json vocabulary"))
    check_tokenizer_file("TikTokenizer", file_flags, path)
    with reading_tokenizer_files("TikTokenizer", file_flags):
        with open(path, encoding="utf-8") as handle:
            entries = json.load(handle)
        if not isinstance(entries, list):
            raise ValueError("expected a JSON list of vocabulary entries")
        if max_vocab is not None:
            entries = entries[:max_vocab]
        ranks = {}
        for index, entry in enumerate(entries):
            if not isinstance(entry, dict) or set(entry) != {"rank", "token_bytes", "token_str"}:
                raise ValueError(f"entry {index} must have exactly the keys rank, token_bytes, token_str")
            if entry["rank"] != index:
                raise ValueError(f"entry {index} has rank {entry['rank']}; ranks must be 0, 1, 2, ... in order")
            token = base64.b64decode(entry["token_bytes"])
            if index < 256 and token != bytes([index]):
                raise ValueError(f"rank {index} must be the single byte {index}")
            if token in ranks:
                raise ValueError(f"token {token!r} appears twice")
            ranks[token] = index
    return ranks


def _tiktoken():
    try:
        import tiktoken
    except ImportError:
        raise ValueError("--tokenizer-type TikTokenizer needs the tiktoken package: pip install tiktoken") from None
    return tiktoken


class TikTokenizer(MegatronTokenizer):
    def __init__(self, path, pattern="v2", vocab_size=None, num_special_tokens=DEFAULT_NUM_SPECIAL_TOKENS,
                 special_tokens=None):
        if pattern not in PATTERNS:
            raise ValueError(f"--tiktoken-pattern {pattern!r}: choose v1 or v2")
        super().__init__(path, pattern=pattern, vocab_size=vocab_size, num_special_tokens=num_special_tokens,
                         special_tokens=special_tokens)
        vocab_size = DEFAULT_VOCAB_SIZE if vocab_size is None else int(vocab_size)
        special_tokens = list(DEFAULT_SPECIAL_TOKENS if special_tokens is None else special_tokens)
        missing = [token for token in REQUIRED_SPECIAL_TOKENS if token not in special_tokens]
        if missing:
            raise ValueError(f"--tiktoken-special-tokens must include {', '.join(REQUIRED_SPECIAL_TOKENS)}; "
                             f"missing {', '.join(missing)}")
        if len(special_tokens) > num_special_tokens:
            raise ValueError(f"{len(special_tokens)} --tiktoken-special-tokens exceed --tiktoken-num-special-tokens "
                             f"({num_special_tokens})")
        fillers = [f"<SPECIAL_{index}>" for index in range(len(special_tokens), num_special_tokens)]
        self.special_tokens = special_tokens + fillers
        if len(set(self.special_tokens)) != num_special_tokens:
            raise ValueError(f"--tiktoken-special-tokens has duplicates: {special_tokens}")
        self.num_special_tokens = num_special_tokens
        inner_vocab_size = vocab_size - num_special_tokens
        if inner_vocab_size < 256:
            raise ValueError(f"--vocab-size ({vocab_size}) must leave at least the 256 byte tokens beside "
                             f"--tiktoken-num-special-tokens ({num_special_tokens})")
        # As upstream, a vocabulary file of fewer tokens leaves the ids above them unused (vocab_size stays).
        ranks = load_mergeable_ranks(path, max_vocab=inner_vocab_size)
        self.pattern = PATTERNS[pattern]
        self._vocab_size = vocab_size
        self._encoding = _tiktoken().Encoding(name=os.path.basename(os.path.dirname(os.path.abspath(path))) or "tik",
                                              pat_str=self.pattern, mergeable_ranks=ranks, special_tokens={})
        self._special_ids = {token: index for index, token in enumerate(self.special_tokens)}

    def tokenize(self, text, bos=False, eos=False):
        """Ids of `text` (special-token spellings in it are ordinary text), optionally framed by `<s>` / `</s>`."""
        ids = [rank + self.num_special_tokens for rank in self._encoding.encode_ordinary(text)]
        return ([self.bos] if bos else []) + ids + ([self.eod] if eos else [])

    def detokenize(self, token_ids):
        """Text of the BPE ids; special ids are left out."""
        ranks = [int(token) - self.num_special_tokens for token in token_ids
                 if int(token) >= self.num_special_tokens]
        return self._encoding.decode(ranks)

    def offsets(self, ids, text):
        """Where each of `ids` starts in `detokenize(ids)` (`text`); a special id, which has no text, starts where
        the text before it ends."""
        ranks = [int(token) - self.num_special_tokens for token in ids if int(token) >= self.num_special_tokens]
        decoded, rank_starts = self._encoding.decode_with_offsets(ranks)
        rank_ends = rank_starts[1:] + [len(decoded)]
        starts, next_start, rank_index = [], 0, 0
        for token in ids:
            if int(token) >= self.num_special_tokens:
                starts.append(rank_starts[rank_index])
                next_start = rank_ends[rank_index]
                rank_index += 1
            else:
                starts.append(next_start)
        return starts

    @property
    def vocab_size(self):
        return self._vocab_size

    @property
    def eos(self):
        return self._special_ids["</s>"]

    @property
    def bos(self):
        return self._special_ids["<s>"]

    @property
    def eod(self):
        return self._special_ids["</s>"]

    @property
    def unk(self):
        return self._special_ids["<unk>"]

    @property
    def pad(self):
        return self._special_ids.get("<pad>", self.eod)
