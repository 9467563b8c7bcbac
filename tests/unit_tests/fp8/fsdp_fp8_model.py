"""A one-layer GPT under delayed FP8 scaling wrapped by Megatron-FSDP ZeRO-3, and its layers' amax histories: what
the FP8 history tests train, save and load."""


def fsdp_fp8_chunk(history_len):
    """A fresh model-parallel state and a Megatron-FSDP ZeRO-3 GPT (1 layer, hidden 16, tied embeddings, init seed
    1234) whose linear layers keep amax histories of `history_len`."""
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.distributed import DistributedDataParallelConfig, FullyShardedDataParallel
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel()
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    config = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2, hidden_dropout=0.0,
                               attention_dropout=0.0, init_seed=1234, fp8="hybrid", fp8_recipe="delayed",
                               fp8_amax_history_len=history_len)
    model = GPTModel(config, vocab_size=32, max_sequence_length=8, share_embeddings_and_output_weights=True)
    ddp_config = DistributedDataParallelConfig(use_megatron_fsdp=True, use_distributed_optimizer=True,
                                               data_parallel_sharding_strategy="optim_grads_params")
    return FullyShardedDataParallel(config, ddp_config, model)


def amax_histories(chunk):
    """Copies of the amax-history buffers of `chunk`'s FP8 layers, in module order."""
    return [module.fp8_amax_history.clone() for module in chunk.modules() if hasattr(module, "fp8_amax_history")]
