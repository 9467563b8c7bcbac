"""Packed sequences: attention run one sequence at a time against the whole row under the block-diagonal mask.

    python examples/packed_sequences/benchmark_attention.py [--row 2048] [--sequences 4 16 64] [--repeats 5]

For each number of equal sequences in a row of `--row` tokens, both paths in the same process, repetitions
alternating between them (median of the repeats after one warm-up each):
- attention: scaled dot-product attention of 8 heads of 64 over the row, per sequence with the causal flag against
  one masked call, forward only, with the largest difference of their outputs;
- step: a GPT (4 layers x 256, 8 heads, RoPE, fp32) forward and backward on the packed row through
  `GPTModel.forward(packed_seq_params=...)`, the per-sequence path (megatron/core/transformer/packed_attention.py)
  against the masked one (`MAX_RUNS` 0), with the largest difference of their per-token losses.
Prints a markdown table (and writes it with --markdown). One process, no process group beyond a one-rank gloo
world for the model.
"""

import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

from examples.one_process_benchmark import one_process_world, report  # noqa: E402

HEADS, HEAD_DIM, LAYERS, HIDDEN, VOCAB = 8, 64, 4, 256, 1024


def _median_ms(functions, repeats):
    """{name: median milliseconds} of each function, called in alternation `repeats` times after a warm-up."""
    for function in functions.values():
        function()
    times = {name: [] for name in functions}
    for _ in range(repeats):
        for name, function in functions.items():
            start = time.perf_counter()
            function()
            times[name].append((time.perf_counter() - start) * 1000)
    return {name: statistics.median(values) for name, values in times.items()}


def attention_times(row, num_sequences, repeats):
    """(per-sequence ms, masked ms, largest output difference) of bare attention over the row."""
    generator = torch.Generator().manual_seed(0)
    query, key, value = (torch.randn(1, HEADS, row, HEAD_DIM, generator=generator) for _ in range(3))
    length = row // num_sequences
    segments = torch.arange(row) // length
    allowed = (segments[:, None] == segments[None, :]) & torch.ones(row, row, dtype=torch.bool).tril()

    def masked():
        return F.scaled_dot_product_attention(query, key, value, attn_mask=allowed)

    def per_sequence():
        out = torch.empty_like(query)
        for first in range(0, row, length):
            rows = slice(first, first + length)
            out[:, :, rows] = F.scaled_dot_product_attention(query[:, :, rows], key[:, :, rows], value[:, :, rows],
                                                             is_causal=True)
        return out

    times = _median_ms({"runs": per_sequence, "mask": masked}, repeats)
    return times["runs"], times["mask"], (per_sequence() - masked()).abs().max().item()


def step_times(row, num_sequences, repeats):
    """(per-sequence ms, masked ms, largest loss difference) of a GPT training step on the packed row."""
    from megatron.core import tensor_parallel
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer import packed_attention
    from megatron.core.transformer.transformer_config import TransformerConfig

    tensor_parallel.model_parallel_cuda_manual_seed(0)
    config = TransformerConfig(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, hidden_dropout=0.0,
                               attention_dropout=0.0)
    model = GPTModel(config, vocab_size=VOCAB, max_sequence_length=row, position_embedding_type="rope")
    tokens = torch.randint(0, VOCAB, (1, row + 1), generator=torch.Generator().manual_seed(1))
    offsets = torch.arange(0, row + 1, row // num_sequences, dtype=torch.int32)
    losses = {}

    def step(max_runs, name):
        def run():
            packed_attention.MAX_RUNS = max_runs
            params = PackedSeqParams(cu_seqlens_q=offsets, cu_seqlens_kv=offsets, max_seqlen_q=row // num_sequences,
                                     max_seqlen_kv=row // num_sequences)  # a new one per batch, as a loader makes
            model.zero_grad(set_to_none=True)
            loss = model(tokens[:, :-1], None, labels=tokens[:, 1:], packed_seq_params=params)
            loss.sum().backward()
            losses[name] = loss.detach()
        return run

    default_runs = packed_attention.MAX_RUNS
    try:
        times = _median_ms({"runs": step(max(default_runs, num_sequences), "runs"), "mask": step(0, "mask")},
                           repeats)
    finally:
        packed_attention.MAX_RUNS = default_runs
    return times["runs"], times["mask"], (losses["runs"] - losses["mask"]).abs().max().item()


def table(row, sequence_counts, repeats):
    lines = [f"| sequences in a {row}-token row | attention: per sequence / masked (ms) | ratio | max diff | "
             "GPT step: per sequence / masked (ms) | ratio | max loss diff |",
             "|---|---|---|---|---|---|---|"]
    for count in sequence_counts:
        runs, masked, diff = attention_times(row, count, repeats)
        step_runs, step_masked, loss_diff = step_times(row, count, repeats)
        lines.append(f"| {count} of {row // count} | {runs:.1f} / {masked:.1f} | {masked / runs:.2f} x | {diff:.1e} "
                     f"| {step_runs:.0f} / {step_masked:.0f} | {step_masked / step_runs:.2f} x | {loss_diff:.1e} |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--row", type=int, default=2048, help="Tokens of the packed row.")
    parser.add_argument("--sequences", type=int, nargs="+", default=[4, 16, 64],
                        help="Numbers of equal sequences in the row (each must divide --row).")
    parser.add_argument("--repeats", type=int, default=5, help="Timed repetitions of each path.")
    parser.add_argument("--markdown", default=None, help="Also write the table to this file.")
    args = parser.parse_args(argv)
    for count in args.sequences:
        if count < 1 or args.row % count:
            parser.error(f"--sequences {count} must divide --row {args.row}")
    one_process_world(29517)
    return report(table(args.row, args.sequences, args.repeats), args.markdown)


if __name__ == "__main__":
    main()
