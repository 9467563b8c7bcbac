"""A tiny GPT in fp32 or bf16, tied or untied, for the precision and memory-accounting tests (DP only)."""

import torch

VOCAB, SEQ, MICRO_BATCH, HIDDEN, HEADS = 64, 16, 2, 32, 4
SEED = 1234


def build_gpt(bf16=False, untie=False, num_layers=2):
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel()
    tensor_parallel.model_parallel_cuda_manual_seed(SEED)
    config = TransformerConfig(
        num_layers=num_layers, hidden_size=HIDDEN, num_attention_heads=HEADS, hidden_dropout=0.0,
        attention_dropout=0.0, init_seed=SEED, bf16=bf16, params_dtype=torch.bfloat16 if bf16 else torch.float32,
    )
    return GPTModel(config, vocab_size=VOCAB, max_sequence_length=SEQ, share_embeddings_and_output_weights=not untie)


def gpt_batch(step):
    from megatron.core import parallel_state

    generator = torch.Generator().manual_seed(1000 * step + parallel_state.get_data_parallel_rank())
    stream = torch.randint(0, VOCAB // 2, (MICRO_BATCH, SEQ + 1), generator=generator)
    return {"tokens": stream[:, :-1].contiguous(), "labels": stream[:, 1:].contiguous(),
            "loss_mask": torch.ones(MICRO_BATCH, SEQ),
            "position_ids": torch.arange(SEQ).expand(MICRO_BATCH, SEQ).contiguous()}


def gpt_loss(chunk, batch):
    """Mean per-token loss of `batch` through `chunk` (fp32 reduction of the model's output)."""
    per_token = chunk(batch["tokens"], batch["position_ids"], labels=batch["labels"])
    return (per_token.float() * batch["loss_mask"]).sum() / batch["loss_mask"].sum()
