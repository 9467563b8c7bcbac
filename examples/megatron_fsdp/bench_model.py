"""A self-contained GPT-like model in plain torch, its size presets, and the mock token stream.

Embedding + learned positions, pre-LayerNorm blocks (causal self-attention, GELU MLP), final LayerNorm and an
untied LM head. No dropout and no buffers, so every arm computes the same function and DDP has no buffers to
broadcast. The block class is the FSDP unit for both torch FSDP2 and Megatron-FSDP.
"""

import dataclasses
import math

import torch
import torch.nn.functional as F
from torch import nn


@dataclasses.dataclass(frozen=True)
class GPTBenchConfig:
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    seq_length: int
    vocab_size: int
    global_batch_size: int = 8
    init_method_std: float = 0.02

    def __post_init__(self):
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) must be divisible by num_attention_heads "
                f"({self.num_attention_heads}); change --model or the preset"
            )


MODEL_PRESETS = {
    "tiny": GPTBenchConfig(num_layers=4, hidden_size=256, num_attention_heads=4, seq_length=128, vocab_size=1024),
    "small": GPTBenchConfig(num_layers=12, hidden_size=768, num_attention_heads=12, seq_length=256, vocab_size=8192),
}


class CausalSelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.qkv = nn.Linear(config.hidden_size, 3 * config.hidden_size)
        self.proj = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(self, hidden):
        batch, seq, width = hidden.shape
        query, key, value = self.qkv(hidden).split(width, dim=-1)
        # [b, s, h] -> [b, heads, s, head_dim]
        query, key, value = (t.view(batch, seq, self.num_heads, -1).transpose(1, 2) for t in (query, key, value))
        attended = F.scaled_dot_product_attention(query, key, value, is_causal=True)
        return self.proj(attended.transpose(1, 2).reshape(batch, seq, width))


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.fc_in = nn.Linear(config.hidden_size, 4 * config.hidden_size)
        self.fc_out = nn.Linear(4 * config.hidden_size, config.hidden_size)

    def forward(self, hidden):
        return self.fc_out(F.gelu(self.fc_in(hidden)))


class TransformerBlock(nn.Module):
    """Pre-LN block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, config):
        super().__init__()
        self.attention_norm = nn.LayerNorm(config.hidden_size)
        self.attention = CausalSelfAttention(config)
        self.mlp_norm = nn.LayerNorm(config.hidden_size)
        self.mlp = MLP(config)

    def forward(self, hidden):
        hidden = hidden + self.attention(self.attention_norm(hidden))
        return hidden + self.mlp(self.mlp_norm(hidden))


class BenchGPT(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.token_embedding = nn.Embedding(config.vocab_size, config.hidden_size)
        self.position_embedding = nn.Embedding(config.seq_length, config.hidden_size)
        self.blocks = nn.ModuleList(TransformerBlock(config) for _ in range(config.num_layers))
        self.final_norm = nn.LayerNorm(config.hidden_size)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self._init_weights()

    def _init_weights(self):
        # GPT-2 style: normal(0, std) everywhere, output projections scaled down by depth.
        std = self.config.init_method_std
        output_std = std / math.sqrt(2.0 * self.config.num_layers)
        for name, param in self.named_parameters():
            if param.dim() == 1:
                if name.endswith("norm.weight"):
                    nn.init.ones_(param)
                else:
                    nn.init.zeros_(param)
            elif name.endswith(("proj.weight", "fc_out.weight")):
                nn.init.normal_(param, mean=0.0, std=output_std)
            else:
                nn.init.normal_(param, mean=0.0, std=std)

    def forward(self, tokens, labels):
        """Mean next-token cross-entropy of this rank's micro-batch."""
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        hidden = self.token_embedding(tokens) + self.position_embedding(positions)
        for block in self.blocks:
            hidden = block(hidden)
        logits = self.lm_head(self.final_norm(hidden))
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.reshape(-1))


def build_model(config, seed, device):
    """The same weights on every rank and in every arm: the seed alone decides them."""
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        model = BenchGPT(config)
    finally:
        torch.random.set_rng_state(generator_state)
    return model.to(device)


def mock_batches(config, num_steps, seed):
    """Token ids [steps, global_batch, seq + 1] from a fixed seed; inputs and labels are shifted views."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(
        0, config.vocab_size, (num_steps, config.global_batch_size, config.seq_length + 1), generator=generator
    )


def rank_micro_batch(all_tokens, step, rank, world_size, device):
    """This rank's contiguous slice of the global batch at `step`, as (tokens, labels)."""
    global_batch = all_tokens.shape[1]
    if global_batch % world_size:
        raise ValueError(f"global batch {global_batch} is not divisible by the world size {world_size}")
    per_rank = global_batch // world_size
    sequences = all_tokens[step, rank * per_rank : (rank + 1) * per_rank]
    return sequences[:, :-1].contiguous().to(device), sequences[:, 1:].contiguous().to(device)


def count_parameters(config):
    """Parameter count of `BenchGPT(config)` by formula (checked against the module in the unit test)."""
    hidden, vocab, layers = config.hidden_size, config.vocab_size, config.num_layers
    per_block = (
        2 * (2 * hidden)  # two LayerNorms
        + (hidden * 3 * hidden + 3 * hidden)  # qkv
        + (hidden * hidden + hidden)  # attention output projection
        + (hidden * 4 * hidden + 4 * hidden)  # fc_in
        + (4 * hidden * hidden + hidden)  # fc_out
    )
    embeddings = vocab * hidden + config.seq_length * hidden
    return embeddings + layers * per_block + 2 * hidden + hidden * vocab
