"""The attention of a packed row run one sequence at a time.

The block-diagonal causal mask of a packed row (megatron/core/packed_sequences.py) makes each sequence's attention
that of the sequence alone. Running the core attention on each sequence's rows with the causal flag computes the
same rows without the `[t, t]` mask and without the masked products: the sum of the sequences' squared lengths
instead of t^2 (examples/packed_sequences/benchmark_attention.py, table in docs/benchmarks.md: on 2 CPU cores, a
2048-token row of 16 sequences, attention 4.5 ms against 41.4 ms masked, a GPT training step 288 against 569 ms,
with identical values).

Each stretch of padding runs as a sequence of its own: no real token reads a padding row either way, but a padding
row's output differs from the masked call's (where it sees only itself), so it must stay out of the loss, as it
must anyway. The runs are used when nothing else needs the whole-row mask (`attention_runs`): no context
parallelism, no extra attention mask, no sliding window, no attention sinks, no fp16 layer-scaled attention, no
tracking of attention logits; and at most `MAX_RUNS` runs, each a kernel call (many short sequences may be cheaper
as one masked call on a GPU; not measured there).
"""

from functools import partial

import torch

MAX_RUNS = 64


def attention_runs(rows, attention_mask, plain_attention: bool):
    """The runs (first row, row count) to attend one at a time, or None for the masked call over the whole row.
    `plain_attention`: the attention has none of the variants that need the mask (see the module docstring)."""
    if not plain_attention or attention_mask is not None or rows.runs is None or len(rows.runs) > MAX_RUNS:
        return None
    return rows.runs


def attend_per_run(core_attention, query, key, value, attention_mask, runs):
    """`core_attention(query, key, value, None)` (causal) on each run's rows (`[s, b, ...]` inputs), concatenated
    along the rows; `attention_mask` is None (the runs stand for the packed mask)."""
    if attention_mask is not None:
        raise ValueError("attend_per_run: the runs replace the packed mask; pass attention_mask=None")
    return torch.cat([core_attention(query[first:first + count], key[first:first + count],
                                     value[first:first + count], None) for first, count in runs], dim=0)


def per_run_core_attention(core_attention, runs):
    """`core_attention` itself without runs, else the same call made run by run."""
    return core_attention if runs is None else partial(attend_per_run, core_attention, runs=runs)
