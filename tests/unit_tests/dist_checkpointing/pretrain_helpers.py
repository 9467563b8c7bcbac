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


TIED = "TIED"  # in extra_args: train with tied input/output embeddings (TINY_GPT unties them)


def tiny_gpt_argv(extra_args):
    base = TINY_GPT
    if TIED in extra_args.split():
        base = base.replace("--untie-embeddings-and-output-weights", "")
        extra_args = " ".join(arg for arg in extra_args.split() if arg != TIED)
    return f"{base} {extra_args}"


def pretrain_records(workdir, argv, forward_step=None, script=None):
    """pretrain() with the full command line `argv` on the calling rank pool; returns the training records of the
    metrics file (one dict per iteration, as the last rank writes them) on every rank. `script`: "pretrain_mamba"
    trains that script's hybrid model (default: pretrain_gpt.py's GPT)."""
    import pretrain_gpt
    from megatron.core.enums import ModelType
    from megatron.training.training import pretrain

    model_provider, args_defaults = pretrain_gpt.model_provider, {}
    if script == "pretrain_mamba":
        import pretrain_mamba

        model_provider, args_defaults = pretrain_mamba.model_provider, {"is_hybrid_model": True}

    os.makedirs(workdir, exist_ok=True)
    metrics = os.path.join(workdir, f"metrics_{zlib.crc32(argv.encode()):08x}.jsonl")
    if torch.distributed.get_rank() == 0 and os.path.exists(metrics):
        os.remove(metrics)
    torch.distributed.barrier()
    pretrain(pretrain_gpt.train_valid_test_datasets_provider, model_provider,
             ModelType.encoder_or_decoder, forward_step or pretrain_gpt.forward_step, args_defaults=args_defaults,
             argv=f"{argv} --metrics-file {metrics}".split())
    torch.distributed.barrier()
    with open(metrics) as stream:
        records = [json.loads(line) for line in stream if line.strip()]
    return [record for record in records if record.get("split") == "train"]


def run_pretrain(workdir, extra_args, forward_step=None):
    """pretrain() with TINY_GPT + `extra_args` on the calling rank pool; returns {iteration: lm loss} on every
    rank (read from the metrics file the last rank writes)."""
    records = pretrain_records(workdir, tiny_gpt_argv(extra_args), forward_step)
    return {record["iteration"]: record["lm loss"] for record in records}


class TrainingState:
    """Model chunks, optimizer and scheduler built from TINY_GPT + `extra_args`, as pretrain() builds them."""

    def __init__(self, extra_args):
        import pretrain_gpt
        from megatron.training.initialize import initialize_megatron
        from megatron.training.model_setup import setup_model_and_optimizer

        # As pretrain(): initialize_megatron() builds the tokenizer (padding the vocabulary) and the
        # number-of-microbatches calculator.
        args = initialize_megatron(None, {}, args=tiny_gpt_argv(extra_args).split())
        self.args = args
        self.model, self.optimizer, self.scheduler, _ = setup_model_and_optimizer(pretrain_gpt.model_provider, args)
        self.args.consumed_train_samples = 0

    def train_steps(self, count):
        """`count` optimizer steps on synthetic gradients (enough to give the optimizer state)."""
        for _ in range(count):
            for chunk in self.model:
                chunk.zero_grad_buffer()
            for chunk in self.model:
                for param in chunk.parameters():
                    grad = torch.full_like(param, 0.01) + 0.001 * param.detach()
                    if getattr(param, "main_grad", None) is not None:
                        param.main_grad.copy_(grad)
                    else:
                        param.grad = grad
            self.optimizer.step()
            self.scheduler.step(increment=self.args.global_batch_size)

    def close(self):
        from megatron.core import parallel_state
        from megatron.core.num_microbatches_calculator import destroy_num_microbatches_calculator

        destroy_num_microbatches_calculator()
        parallel_state.destroy_model_parallel()
