"""Supervised fine-tuning: conversations packed into rows (`--sft`) against one padded conversation per sample
(`--no-sft-packing`), on the same conversations.

    python examples/sft/benchmark_packing.py [--conversations 200] [--seq-length 512] [--repeats 3]

The conversations are the first `--conversations` of tools/build_sft_conversations.py's (questions about the
standard library from the bundled corpus), rendered in chatml with the byte-level tokenizer and served by
`SFTDataset` in its two layouts (one epoch each: every conversation once). A GPT (4 layers x 128, 4 heads, RoPE,
fp32, the README run's shape) runs forward and backward over every sample of the epoch, one sample at a time; the
layouts alternate over `--repeats` timed epochs after a warm-up one (median). Both layouts train the same tokens,
so the summed loss of the epoch must agree (fp32 sums in another order): the table shows both sums. Prints a markdown
table (and writes it with --markdown). One process, a one-rank gloo world for the model.
"""

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

from examples.one_process_benchmark import one_process_world, report  # noqa: E402

LAYERS, HIDDEN, HEADS = 4, 128, 4


def sft_epoch(path, seq_length, pack):
    """The samples of one epoch of the conversations in `path` (a list of dicts, batched as `[1, s]`)."""
    from megatron.training.datasets.sft_dataset import SFTDatasetConfig, build_sft_datasets
    from megatron.training.tokenizer.byte_level_tokenizer import ByteLevelTokenizer

    config = SFTDatasetConfig(random_seed=1234, sequence_length=seq_length, tokenizer=ByteLevelTokenizer(),
                              blend=([path], None), prompt_format="chatml", pack=pack)
    dataset = build_sft_datasets(config, (None, 0, 0))[0]  # None: one epoch
    return [{key: value[None] for key, value in dataset[index].items()} for index in range(len(dataset))]


def epoch_loss(model, samples):
    """Forward and backward over every sample; the summed loss of the trained tokens (a float)."""
    from megatron.training.packed_batch import packed_seq_params_from_batch

    total = 0.0
    for sample in samples:
        packed = packed_seq_params_from_batch(sample, "cpu")
        extra = {} if packed is None else {"packed_seq_params": packed}
        positions = None if packed is not None else sample["position_ids"]
        losses = model(sample["tokens"], positions, labels=sample["labels"], **extra)
        loss = (losses * sample["loss_mask"]).sum()
        loss.backward()
        total += loss.item()
    return total


def table(path, seq_length, repeats):
    from megatron.core import tensor_parallel
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    tensor_parallel.model_parallel_cuda_manual_seed(0)
    config = TransformerConfig(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, hidden_dropout=0.0,
                               attention_dropout=0.0, normalization="RMSNorm", gated_linear_unit=True)
    model = GPTModel(config, vocab_size=320, max_sequence_length=seq_length, position_embedding_type="rope")
    epochs = {"packed": sft_epoch(path, seq_length, True), "padded": sft_epoch(path, seq_length, False)}
    sums, times = {}, {name: [] for name in epochs}
    for name, samples in epochs.items():  # warm-up
        sums[name] = epoch_loss(model, samples)
    for _ in range(repeats):
        for name, samples in epochs.items():
            model.zero_grad(set_to_none=True)
            start = time.perf_counter()
            sums[name] = epoch_loss(model, samples)
            times[name].append(time.perf_counter() - start)
    conversations = len(epochs["padded"])
    trained = int(sum(sample["loss_mask"].sum() for sample in epochs["padded"]))
    lines = [f"| layout ({conversations} conversations, {seq_length}-token samples) | samples | tokens run | "
             "trained tokens | padding | epoch (s) | conversations / s | summed loss |",
             "|---|---|---|---|---|---|---|---|"]
    for name, samples in epochs.items():
        run = len(samples) * seq_length
        real = int(sum(int(sample["loss_mask"].sum()) + _untrained_real(sample) for sample in samples))
        seconds = statistics.median(times[name])
        lines.append(f"| {name} | {len(samples)} | {run} | {trained} | {1 - real / run:.0%} | {seconds:.2f} | "
                     f"{conversations / seconds:.1f} | {sums[name]:.4f} |")
    return "\n".join(lines), sums


def _untrained_real(sample):
    """Real (non-padding) positions of a sample that the loss does not train: the prompts' positions."""
    from megatron.training.tokenizer.byte_level_tokenizer import ByteLevelTokenizer

    return int(((sample["tokens"] != ByteLevelTokenizer().pad) & (sample["loss_mask"] == 0)).sum())


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conversations", type=int, default=200, help="How many of the built conversations.")
    parser.add_argument("--seq-length", type=int, default=512, help="Tokens of a sample (a packed row).")
    parser.add_argument("--repeats", type=int, default=3, help="Timed epochs of each layout.")
    parser.add_argument("--markdown", default=None, help="Also write the table to this file.")
    args = parser.parse_args(argv)
    if args.conversations < 1 or args.seq_length < 2 or args.repeats < 1:
        parser.error("--conversations, --repeats must be at least 1 and --seq-length at least 2")
    from tools.build_sft_conversations import main as build_conversations

    one_process_world(29519)
    path = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"sft_benchmark_{args.conversations}.jsonl")
    build_conversations(["--output", path, "--max-conversations", str(args.conversations)])
    return report(table(path, args.seq_length, args.repeats)[0], args.markdown)


if __name__ == "__main__":
    main()
