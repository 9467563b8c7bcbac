"""Run `pretrain()` in-process on rank pools and read back the per-iteration losses."""

import json
import os
import zlib

import torch

TINY_GPT = (
    "--num-layers 4 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --max-position-embeddings 16 "
    "--micro-batch-size 2 --global-batch-size 8 --lr 5e-3 --min-lr 5e-4 --lr-decay-style cosine "
    "--lr-warmup-iters 2 --lr-decay-iters 8 --train-iters 8 --mock-data --tokenizer-type NullTokenizer "
    "--vocab-size 120 --make-vocab-size-divisible-by 64 --hidden-dropout 0 --attention-dropout 0 --num-workers 0 "
    "--log-interval 100 --eval-iters 0 --distributed-backend gloo --swiglu --untie-embeddings-and-output-weights"
)


def run_pretrain(workdir, extra_args, forward_step=None):
    """pretrain() with TINY_GPT + `extra_args` on the calling rank pool; returns {iteration: lm loss} on every
    rank (read from the metrics file the last rank writes)."""
    import pretrain_gpt
    from megatron.core.enums import ModelType
    from megatron.training.training import pretrain

    os.makedirs(workdir, exist_ok=True)
    metrics = os.path.join(workdir, f"metrics_{zlib.crc32(extra_args.encode()):08x}.jsonl")
    if torch.distributed.get_rank() == 0 and os.path.exists(metrics):
        os.remove(metrics)
    torch.distributed.barrier()
    argv = f"{TINY_GPT} --metrics-file {metrics} {extra_args}".split()
    pretrain(pretrain_gpt.train_valid_test_datasets_provider, pretrain_gpt.model_provider,
             ModelType.encoder_or_decoder, forward_step or pretrain_gpt.forward_step, argv=argv)
    torch.distributed.barrier()
    with open(metrics) as stream:
        records = [json.loads(line) for line in stream if line.strip()]
    return {record["iteration"]: record["lm loss"] for record in records if record.get("split") == "train"}
