"""`--bf16` trains the same model under every data-parallel wrapper: Megatron DDP, the distributed optimizer,
Megatron-FSDP (ZeRO-3) and FSDP2 start from the same bf16 weights, see the same batches and give the same losses
up to the bound documented in docs/training_flags.md (Precision). The model is the tiny example's kind (RoPE,
RMSNorm, SwiGLU), whose RoPE angles must reach every layer in fp32 under every wrapper."""

import os

import torch
import torch.distributed as dist

from tests.unit_tests.multiprocess_harness import run_on_ranks

STEPS = 3
WRAPPER_FLAGS = {
    "ddp": "",
    "distopt": "--use-distributed-optimizer",
    "mfsdp": "--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params",
    "fsdp2": "--use-torch-fsdp2",
}
# The first step's loss is the same computation everywhere; afterwards the wrappers sum the fp32 gradients in
# different orders, a bf16 weight can round the other way, and the losses may drift apart: 1e-4 of the loss over
# the first steps is the documented bound (pretrain_gpt.py runs of 10 iterations stay within about 2e-5).
RELATIVE_BOUND = 1e-4


def _rope_gpt(fp32_residual=False):
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig
    from tests.unit_tests.distributed.precision_gpt import HEADS, HIDDEN, SEED, SEQ, VOCAB

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel()
    tensor_parallel.model_parallel_cuda_manual_seed(SEED)
    config = TransformerConfig(
        num_layers=2, hidden_size=HIDDEN, num_attention_heads=HEADS, hidden_dropout=0.0, attention_dropout=0.0,
        init_seed=SEED, bf16=True, params_dtype=torch.bfloat16, normalization="RMSNorm", gated_linear_unit=True,
        activation_func=torch.nn.functional.silu, fp32_residual_connection=fp32_residual,
    )
    return GPTModel(config, vocab_size=VOCAB, max_sequence_length=SEQ, share_embeddings_and_output_weights=False,
                    position_embedding_type="rope")


def _bf16_losses(wrapper, fp32_residual=False):
    from megatron.core.distributed import wrap_data_parallel
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.training.arguments import parse_args, validate_args
    from megatron.training.model_config import ddp_config_from_args
    from tests.unit_tests.distributed.precision_gpt import gpt_batch, gpt_loss

    flags = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --micro-batch-size 2 "
             "--train-iters 10 --lr 1e-3 --mock-data --vocab-size 64 --bf16 --untie-embeddings-and-output-weights "
             + WRAPPER_FLAGS[wrapper] + (" --fp32-residual-connection" if fp32_residual else ""))
    os.environ.update({"WORLD_SIZE": str(dist.get_world_size()), "RANK": str(dist.get_rank())})
    args = validate_args(parse_args(args=flags.split()))
    args.data_parallel_size = dist.get_world_size()
    model = _rope_gpt(fp32_residual)
    angle_dtypes, residual_dtypes = set(), set()
    for layer in model.decoder.layers:
        layer.self_attention.register_forward_pre_hook(
            lambda module, inputs, kwargs: angle_dtypes.add(kwargs["rotary_pos_emb"].dtype), with_kwargs=True)
        layer.register_forward_pre_hook(lambda module, inputs: residual_dtypes.add(inputs[0].dtype))
    chunk = wrap_data_parallel(model.config, ddp_config_from_args(args), model)
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="sgd", lr=0.5, sgd_momentum=0.0, clip_grad=0.0, bf16=True,
                        params_dtype=torch.bfloat16, use_distributed_optimizer=args.use_distributed_optimizer),
        [chunk])
    losses = []
    for step in range(STEPS):
        optimizer.zero_grad()
        if hasattr(chunk, "zero_grad_buffer"):
            chunk.zero_grad_buffer()
        loss = gpt_loss(chunk, gpt_batch(step))
        loss.backward()
        chunk.finish_grad_sync()
        success, _, _ = optimizer.step()
        assert success
        mean = loss.detach().float().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / dist.get_world_size())
    return (losses, angle_dtypes, residual_dtypes) if fp32_residual else (losses, angle_dtypes)


def test_bf16_losses_agree_across_data_parallel_wrappers():
    results = {wrapper: run_on_ranks(2, _bf16_losses, wrapper)[0] for wrapper in WRAPPER_FLAGS}
    reference = results["ddp"][0]
    for wrapper, (values, angle_dtypes) in results.items():
        assert angle_dtypes == {torch.float32}, (wrapper, angle_dtypes)
        assert values[0] == reference[0], (wrapper, values, reference)  # same weights, same batch
        for step, (value, expected) in enumerate(zip(values, reference, strict=True)):
            assert abs(value - expected) <= RELATIVE_BOUND * abs(expected), (wrapper, step, values, reference)
    # The steps moved the weights: the losses are not just the initial one repeated.
    assert abs(reference[-1] - reference[0]) > 10 * RELATIVE_BOUND * abs(reference[0]), reference


def test_fp32_residual_stream_reaches_every_layer_under_fsdp2():
    """--fp32-residual-connection: FSDP2 leaves the layers' inputs as they are, so the residual stream stays fp32
    between its layers, as under Megatron DDP."""
    (ddp, _, ddp_residuals), (fsdp2, angles, fsdp2_residuals) = (
        run_on_ranks(2, _bf16_losses, wrapper, True)[0] for wrapper in ("ddp", "fsdp2"))
    assert ddp_residuals == fsdp2_residuals == {torch.float32} and angles == {torch.float32}
    assert fsdp2[0] == ddp[0], (fsdp2, ddp)
    for value, expected in zip(fsdp2, ddp, strict=True):
        assert abs(value - expected) <= RELATIVE_BOUND * abs(expected), (fsdp2, ddp)
