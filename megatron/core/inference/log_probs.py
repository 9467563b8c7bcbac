"""Log-probabilities of generation under the model's distribution: the softmax of the logits (before temperature
and filtering) over the real vocabulary, the tokenizer's `vocab_size` first rows; the rows a padded vocabulary
adds (`--make-vocab-size-divisible-by`) get no probability mass. Pure tensor functions: no process group."""

from typing import Dict, List, Optional, Tuple

import torch


def real_vocab_log_softmax(logits: torch.Tensor, vocab_size: Optional[int]) -> torch.Tensor:
    """fp32 log-softmax of `[..., V]` logits over their first `vocab_size` entries (all of them when None)."""
    return torch.log_softmax(logits[..., :vocab_size].float(), dim=-1)


def target_log_probs(logits: torch.Tensor, targets: torch.Tensor, vocab_size: Optional[int]) -> torch.Tensor:
    """log p(targets) under softmax(logits) over the real vocabulary: `[b, s, V]`, `[b, s]` -> `[b, s]` fp32."""
    return real_vocab_log_softmax(logits, vocab_size).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def top_n_log_probs(logits: torch.Tensor, n: int, vocab_size: Optional[int]) -> Tuple[torch.Tensor, torch.Tensor]:
    """The `n` largest log-probabilities over the real vocabulary and their token ids, most likely first:
    `[b, s, V]` -> (`[b, s, n]` fp32, `[b, s, n]` int64)."""
    return torch.topk(real_vocab_log_softmax(logits, vocab_size), n, dim=-1)


def check_top_n(n: int, vocab_size: int):
    """Raise ValueError naming the flag when `n` most likely tokens cannot be listed from `vocab_size`."""
    if n > vocab_size:
        raise ValueError(f"--top-n-logprobs {n} exceeds the vocabulary size {vocab_size}: ask for at most "
                         f"{vocab_size} tokens")


def top_n_dicts(values: torch.Tensor, ids: torch.Tensor) -> List[Dict[int, float]]:
    """`[s, n]` log-probabilities and ids -> one `{token id: log-probability}` per position, most likely first."""
    return [dict(zip(row_ids, row_values)) for row_ids, row_values in zip(ids.tolist(), values.tolist())]


def top_n_by_text(top_n: List[Dict[int, float]], tokenizer) -> List[Dict[str, float]]:
    """Each position's `{token id: log-probability}` keyed by the token detokenized alone (upstream's form), most
    likely first; of ids that detokenize alike, the likeliest keeps the entry."""
    named = []
    for position in top_n:
        entries = {}
        for token, log_prob in position.items():
            entries.setdefault(tokenizer.detokenize([token]), log_prob)
        named.append(entries)
    return named
