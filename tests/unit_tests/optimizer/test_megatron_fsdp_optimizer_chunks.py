"""`MegatronFSDPOptimizer` over several Megatron-FSDP chunks of one rank (the interleaved pipeline's layout): one
optimizer steps every chunk's shards, clips by the global norm over all chunks, counts zeros over all of them and
zeroes every chunk's gradients; it equals Megatron DDP over the same chunks step by step (grad norms, losses and
final weights to 1e-5). (Checkpoints of chunks are covered with pretrain() in
tests/unit_tests/training/test_interleaved_pipeline_training.py.)

Two GPTs of 1 and 2 layers stand in for two chunks; each step's loss is the sum of theirs. `clip_grad` is far
below the gradient norm, so every step is clipped and a per-chunk norm would move the weights differently.
"""

import pytest
import torch

from tests.unit_tests.multiprocess_harness import run_on_ranks

VOCAB, SEQ, MICRO_BATCH, HIDDEN, HEADS = 64, 16, 2, 32, 4
SEED = 1234
STEPS = 3
TOLERANCE = 1e-5


def _chunks(strategy):
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.distributed import DistributedDataParallelConfig, wrap_data_parallel
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel()
    tensor_parallel.model_parallel_cuda_manual_seed(SEED)
    if strategy is None:
        ddp_config = DistributedDataParallelConfig()
    else:
        ddp_config = DistributedDataParallelConfig(use_megatron_fsdp=True, use_distributed_optimizer=True,
                                                   data_parallel_sharding_strategy=strategy)
    chunks = []
    for num_layers in (1, 2):
        config = TransformerConfig(num_layers=num_layers, hidden_size=HIDDEN, num_attention_heads=HEADS,
                                   hidden_dropout=0.0, attention_dropout=0.0, init_seed=SEED + num_layers)
        model = GPTModel(config, vocab_size=VOCAB, max_sequence_length=SEQ, share_embeddings_and_output_weights=True)
        chunks.append(wrap_data_parallel(config, ddp_config, model))
    return chunks


def _batch(step, index):
    rank = torch.distributed.get_rank()
    generator = torch.Generator().manual_seed(1000 * step + 10 * rank + index)
    stream = torch.randint(0, VOCAB // 2, (MICRO_BATCH, SEQ + 1), generator=generator)
    return stream[:, :-1].contiguous(), stream[:, 1:].contiguous()


def _full_weights(chunk):
    if hasattr(chunk, "gathered_parameters"):
        with chunk.gathered_parameters() as model:
            return {name: param.detach().clone() for name, param in model.named_parameters()}
    return {name: param.detach().clone() for name, param in chunk.module.named_parameters()}


def _train(strategy):
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    chunks = _chunks(strategy)
    optimizer = get_megatron_optimizer(
        OptimizerConfig(lr=1e-2, clip_grad=0.05, log_num_zeros_in_grad=True, weight_decay=0.01), chunks)
    result = {"losses": [], "grad_norms": [], "num_zeros": []}
    for step in range(STEPS):
        for chunk in chunks:
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
        total = 0.0
        for index, chunk in enumerate(chunks):
            tokens, labels = _batch(step, index)
            position_ids = torch.arange(SEQ).expand(MICRO_BATCH, SEQ)
            loss = chunk(tokens, position_ids, labels=labels).mean()
            loss.backward()
            total += loss.item()
        finalize_model_grads(chunks)
        success, grad_norm, num_zeros = optimizer.step()
        assert success
        result["losses"].append(total)
        result["grad_norms"].append(float(grad_norm))
        result["num_zeros"].append(float(num_zeros))
    result["final"] = [_full_weights(chunk) for chunk in chunks]
    if strategy is not None:
        result["chunk_optimizers"] = len(optimizer.chunk_optimizers)
        result["lr_reaches_every_chunk"] = all(
            group["lr"] == optimizer.param_groups[0]["lr"]
            for entry in optimizer.chunk_optimizers for group in entry.optimizer.param_groups)
    return result


def _ddp_and_megatron_fsdp():
    reference = _train(None)
    return reference, {strategy: _train(strategy) for strategy in ("optim", "optim_grads_params")}


@pytest.mark.parametrize("world_size", [2])
def test_one_optimizer_over_two_megatron_fsdp_chunks_equals_ddp(world_size):
    for reference, cases in run_on_ranks(world_size, _ddp_and_megatron_fsdp):
        assert len(set(reference["grad_norms"])) == STEPS
        assert min(reference["grad_norms"]) > 0.05  # every step is clipped
        for strategy, case in cases.items():
            assert case["chunk_optimizers"] == 2, strategy
            assert case["lr_reaches_every_chunk"], strategy
            for key in ("losses", "grad_norms"):
                assert case[key] == pytest.approx(reference[key], rel=TOLERANCE, abs=0), (strategy, key)
            assert case["num_zeros"] == pytest.approx(reference["num_zeros"], abs=2), strategy
            for chunk_index, weights in enumerate(reference["final"]):
                for name, value in weights.items():
                    assert torch.allclose(case["final"][chunk_index][name], value, rtol=0, atol=TOLERANCE), (
                        strategy, chunk_index, name)
