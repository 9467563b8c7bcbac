"""Learnable attention sinks (`softmax_offset`) built on the meta device (`--init-model-with-meta-device`) and
materialised by Megatron-FSDP: every parameter, the sinks included, gets the eager build's values (zeros for the
sinks), for standard and multi-latent attention, and the first loss is the eager one. Materialisation calls the
`reset_parameters()` of each module that owns parameters, so the attention module that owns `softmax_offset` must
have one (that the reset zeroes the sinks is checked in test_attention_variants / test_mla_attention_variants).
(FSDP2 takes a materialised model only: `--init-model-with-meta-device` needs `--use-megatron-fsdp`.)"""

import pytest
import torch
import torch.distributed as dist

from tests.unit_tests.multiprocess_harness import run_on_ranks

VOCAB, SEQ, BATCH, HIDDEN, HEADS, SEED = 64, 16, 2, 32, 4, 1234
MLA_SHAPE = dict(multi_latent_attention=True, kv_lora_rank=12, qk_head_dim=6, qk_pos_emb_head_dim=4, v_head_dim=8)


def _gpt(meta, mla):
    from megatron.core import tensor_parallel
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    tensor_parallel.model_parallel_cuda_manual_seed(SEED)
    torch.manual_seed(SEED)  # meta materialisation draws from the default generator on every rank alike
    config = TransformerConfig(num_layers=2, hidden_size=HIDDEN, num_attention_heads=HEADS, hidden_dropout=0.0,
                               attention_dropout=0.0, init_seed=SEED, init_model_with_meta_device=meta,
                               softmax_type="learnable", window_size=(4, 0), window_attn_skip_freq=2,
                               **(MLA_SHAPE if mla else {}))
    return GPTModel(config, vocab_size=VOCAB, max_sequence_length=SEQ, position_embedding_type="rope",
                    share_embeddings_and_output_weights=True)


def _first_loss(model):
    stream = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(dist.get_rank()))
    loss = model(stream[:, :-1], torch.arange(SEQ).expand(BATCH, -1), labels=stream[:, 1:]).sum()
    loss.backward()
    return loss.item()


def _meta_equals_eager(mla):
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallelConfig, FullyShardedDataParallel

    parallel_state.initialize_model_parallel()
    try:
        eager = _gpt(False, mla)
        meta = _gpt(True, mla)
        offsets_were_meta = [p.is_meta for n, p in meta.named_parameters() if n.endswith("softmax_offset")]
        ddp_config = DistributedDataParallelConfig(use_megatron_fsdp=True, use_distributed_optimizer=True,
                                                   data_parallel_sharding_strategy="optim_grads_params")
        chunk = FullyShardedDataParallel(meta.config, ddp_config, meta)
        with chunk.gathered_parameters() as model:
            materialised = {name: param.detach().clone() for name, param in model.named_parameters()}
        expected = dict(eager.named_parameters())
        errors = {name: (value - expected[name]).abs().max().item() for name, value in materialised.items()}
        offsets = {name: value.tolist() for name, value in materialised.items() if name.endswith("softmax_offset")}
        loss = _first_loss(chunk)
        eager_loss = _first_loss(eager)
        return offsets_were_meta, offsets, errors, loss, eager_loss
    finally:
        parallel_state.destroy_model_parallel()


@pytest.mark.parametrize("world_size", [2])
@pytest.mark.parametrize("mla", [False, True], ids=["self_attention", "multi_latent_attention"])
def test_meta_device_sinks_materialise_to_the_eager_zeros(world_size, mla):
    for offsets_were_meta, offsets, errors, loss, eager_loss in run_on_ranks(world_size, _meta_equals_eager, mla):
        assert offsets_were_meta == [True, True]
        assert offsets == {f"decoder.layers.{i}.self_attention.softmax_offset": [0.0] * HEADS for i in (0, 1)}
        assert max(errors.values()) == 0.0, {name: e for name, e in errors.items() if e != 0.0}
        assert loss == pytest.approx(eager_loss, rel=1e-6, abs=0)
