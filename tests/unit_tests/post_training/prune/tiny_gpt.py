"""A tiny GPTModel for the width-pruning tests, fixed batches of a learnable token pattern, and a short training
run so importance has something to find."""

import torch

from megatron.core import tensor_parallel
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.transformer.transformer_config import TransformerConfig
from tests.unit_tests.test_utilities import Utils

VOCAB, SEQ, BATCH, SEED = 64, 16, 8, 1234


def tiny_config(**overrides):
    fields = dict(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64, hidden_dropout=0.0,
                  attention_dropout=0.0, normalization="RMSNorm", gated_linear_unit=True, init_seed=SEED,
                  use_cpu_initialization=True)  # CPU tests, also on a machine with a GPU
    fields.update(overrides)
    return TransformerConfig(**fields)


def tiny_gpt(config=None, **model_kwargs):
    Utils.initialize_model_parallel()
    tensor_parallel.model_parallel_cuda_manual_seed(SEED)
    model_kwargs.setdefault("vocab_size", VOCAB)
    model_kwargs.setdefault("max_sequence_length", SEQ)
    model_kwargs.setdefault("share_embeddings_and_output_weights", True)
    return GPTModel(config or tiny_config(), **model_kwargs)


def batch(step):
    """tokens, labels, positions `[BATCH, SEQ]`: sequences counting up by a per-row stride from a random start
    (mod VOCAB), so the next token is predictable from the two before it."""
    generator = torch.Generator().manual_seed(100 + step)
    start = torch.randint(0, VOCAB, (BATCH, 1), generator=generator)
    stride = torch.randint(1, 5, (BATCH, 1), generator=generator)
    stream = (start + stride * torch.arange(SEQ + 1)) % VOCAB
    positions = torch.arange(SEQ).unsqueeze(0).expand(BATCH, SEQ)
    return stream[:, :-1].contiguous(), stream[:, 1:].contiguous(), positions


def mean_loss(model, batches):
    with torch.no_grad():
        return sum(model(tokens, positions, labels=labels).mean().item()
                   for tokens, labels, positions in batches) / len(batches)


def train(model, steps, lr=1e-2):
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    for step in range(steps):
        tokens, labels, positions = batch(step % 8)
        optimizer.zero_grad()
        model(tokens, positions, labels=labels).mean().backward()
        optimizer.step()
    return model.eval()


def forward_loop(batches):
    def run(model):
        for tokens, _, positions in batches:
            model(tokens, positions)

    return run
