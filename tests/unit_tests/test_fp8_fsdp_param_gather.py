"""`--fp8-param-gather` with Megatron-FSDP (ZeRO-3) on 4 ranks, at DP=4 and at TP=2 x DP=2: a small GPT in FP8
(hybrid, tensorwise scaling; layer 0 kept out of FP8) trained with and without FP8 parameter gathering.

- The gathered weights equal the reference: the unsharded fp32 main weight quantized with the scale of the
  amax agreed over the DP shards and the TP partitions, then dequantized; every rank holds the same scale.
- The FP8 weights' all-gathers move exactly 1/4 of the bytes the same weights cost in fp32 (communication
  counters), everything else is gathered as before.
- Losses equal FP8 training without parameter gathering (and with it, built on the meta device): under tensorwise scaling both quantize each weight
  with the amax of the full weight, so the GEMMs see the same FP8 operands (summation order only: 1e-5).
"""

import types

import pytest
import torch

from tests.unit_tests.multiprocess_harness import run_on_ranks
from tests.unit_tests.pipeline_parallel.test_gpt_pipeline import _forward_step

VOCAB, SEQ, MICRO_BATCH, HIDDEN, HEADS, LAYERS = 64, 16, 2, 32, 4, 2
SEED = 1234
STEPS = 3
PARITY_TOLERANCE = 1e-5


def _build(tp, fp8_param_gather, meta=False):
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.distributed import DistributedDataParallelConfig, FullyShardedDataParallel
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    tensor_parallel.model_parallel_cuda_manual_seed(SEED)
    config = TransformerConfig(
        num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, hidden_dropout=0.0, attention_dropout=0.0,
        init_seed=SEED, tensor_model_parallel_size=tp, fp8="hybrid", fp8_recipe="tensorwise",
        fp8_param=fp8_param_gather, first_last_layers_bf16=True, num_layers_at_start_in_bf16=1,
        num_layers_at_end_in_bf16=0, init_model_with_meta_device=meta,
    )
    model = GPTModel(config, vocab_size=VOCAB, max_sequence_length=SEQ, share_embeddings_and_output_weights=True)
    ddp_config = DistributedDataParallelConfig(
        use_megatron_fsdp=True, use_distributed_optimizer=True, overlap_grad_reduce=True, overlap_param_gather=True,
        data_parallel_sharding_strategy="optim_grads_params", fp8_param_gather=fp8_param_gather)
    return config, FullyShardedDataParallel(config, ddp_config, model)


def _batches(step):
    from megatron.core import parallel_state

    generator = torch.Generator().manual_seed(1000 * step + parallel_state.get_data_parallel_rank())
    stream = torch.randint(0, VOCAB // 2, (MICRO_BATCH, SEQ + 1), generator=generator)
    return [{"tokens": stream[:, :-1].contiguous(), "labels": stream[:, 1:].contiguous(),
             "loss_mask": torch.ones(MICRO_BATCH, SEQ), "position_ids": torch.arange(SEQ).expand(MICRO_BATCH, SEQ)}]


def _train(tp, fp8_param_gather, meta=False):
    """Losses of STEPS steps, and the all-gather bytes of the last step: in total (the communication counter)
    and per wire dtype (counted at the package's all-gather)."""
    import megatron_fsdp.collectives as fsdp_collectives

    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.training.model_setup import install_schedule_hooks
    from megatron.training.training import reduce_reported_loss

    config, chunk = _build(tp, fp8_param_gather, meta)
    optimizer = get_megatron_optimizer(OptimizerConfig(lr=3e-3, clip_grad=1.0), [chunk])
    install_schedule_hooks([chunk], optimizer, types.SimpleNamespace(fp16=False))
    bytes_by_dtype = {}
    original = fsdp_collectives.all_gather_flat
    original_in_place = fsdp_collectives.all_gather_pieces_in_place

    def count(pieces, group):
        world = fsdp_collectives.group_size(group)
        key = str(pieces[0].dtype)
        sent = sum(piece.numel() * piece.element_size() for piece in pieces) * (world - 1)
        bytes_by_dtype[key] = bytes_by_dtype.get(key, 0) + sent

    def counting_all_gather(output, shard, group, counter, async_op=False):
        count([shard], group)
        return original(output, shard, group, counter, async_op=async_op)

    def counting_all_gather_in_place(outputs, own_pieces, group, counter, async_op=False):  # fp32 groups on gloo
        count(own_pieces, group)
        return original_in_place(outputs, own_pieces, group, counter, async_op=async_op)

    losses = []
    for step in range(STEPS):
        if step == STEPS - 1:
            chunk.module.reset_communication_counters()
            fsdp_collectives.all_gather_flat = counting_all_gather
            fsdp_collectives.all_gather_pieces_in_place = counting_all_gather_in_place
        try:
            chunk.zero_grad_buffer()
            optimizer.zero_grad()
            reports = get_forward_backward_func()(
                forward_step_func=_forward_step, data_iterator=iter(_batches(step)), model=[chunk],
                num_microbatches=1, seq_length=SEQ, micro_batch_size=MICRO_BATCH)
            success, _, _ = optimizer.step()
            assert success
        finally:
            fsdp_collectives.all_gather_flat = original
            fsdp_collectives.all_gather_pieces_in_place = original_in_place
        losses.append(reduce_reported_loss(reports, torch.device("cpu")))
    all_gather_bytes = chunk.communication_report()["all_gather"]
    return config, chunk, losses, all_gather_bytes, bytes_by_dtype


def _full_main_weight(chunk, weight):
    """The unsharded (TP-local) fp32 main weight of `weight`, assembled from the DP shards' pieces."""
    import torch.distributed as dist

    group, index = chunk.module.param_to_group[id(weight)]
    piece = group.main_pieces[index]
    full = torch.zeros(weight.numel(), dtype=torch.float32)
    full[piece.param_start:piece.param_end] = group.main_param_views[index]
    dist.all_reduce(full, group=chunk.module.topology.dp_group)  # pieces are disjoint
    return full.view(weight.shape)


def _check_gathered_weights(config, chunk):
    import torch.distributed as dist

    from megatron.core import fp8_utils, parallel_state
    from megatron.core.fp8.params import fp8_weight_params

    # At rest the module shows placeholders for its ZeRO-3 parameters: take the parameters they stand for.
    weights = [chunk.real_parameter(param) for param in fp8_weight_params(chunk.module.module, config)]
    mains = [_full_main_weight(chunk, weight) for weight in weights]
    tp_group = parallel_state.get_tensor_model_parallel_group()
    scales, mismatches = [], []
    with chunk.gathered_parameters() as model:
        for weight, main in zip(weights, mains):
            amax = main.abs().max().reshape(1)
            dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=tp_group)
            expected = fp8_utils.quantize(main, torch.float8_e4m3fn,
                                          fp8_utils.scale_from_amax(amax[0], torch.float8_e4m3fn))
            fp8_weight = weight.fp8_weight
            ok = (fp8_utils.is_float8tensor(fp8_weight) and fp8_weight.dtype == torch.float8_e4m3fn
                  and torch.equal(fp8_weight.data.view(torch.uint8), expected.data.view(torch.uint8))
                  and torch.equal(fp8_weight.scale, expected.scale)
                  and torch.equal(weight.detach(), expected.dequantize()))
            if not ok:
                mismatches.append(tuple(weight.shape))
            scales.append(float(fp8_weight.scale))
        layer0_plain = all(not hasattr(p, "fp8_weight") for p in model.decoder.layers[0].parameters())
    released_plain = all(not hasattr(weight, "fp8_weight") for weight in weights)
    return {"num_weights": len(weights), "fp8_elements": sum(w.numel() for w in weights), "mismatches": mismatches,
            "scales": scales, "layer0_plain": layer0_plain, "released_plain": released_plain}


def _fsdp_fp8_param_gather_on_ranks():
    import torch.distributed as dist

    results = {}
    for tp in (1, 2):
        _, _, plain_losses, plain_bytes, plain_by_dtype = _train(tp, fp8_param_gather=False)
        config, chunk, losses, fp8_bytes, fp8_by_dtype = _train(tp, fp8_param_gather=True)
        results[tp] = {"plain_losses": plain_losses, "losses": losses, "plain_bytes": plain_bytes,
                       "plain_by_dtype": plain_by_dtype, "fp8_bytes": fp8_bytes, "fp8_by_dtype": fp8_by_dtype,
                       "dp_size": dist.get_world_size() // tp, **_check_gathered_weights(config, chunk)}
    # Built on the meta device and materialised unit by unit: the FP8 weights are selected before the
    # parameters are replaced, and training is the same.
    results["meta_losses"] = _train(2, fp8_param_gather=True, meta=True)[2]
    return results


def test_fp8_param_gather_under_megatron_fsdp_at_dp4_and_tp2_dp2():
    results = run_on_ranks(4, _fsdp_fp8_param_gather_on_ranks)
    for rank, per_layout in enumerate(results):
        assert per_layout.pop("meta_losses") == pytest.approx(per_layout[2]["losses"], abs=PARITY_TOLERANCE)
        for tp, result in per_layout.items():
            context = f"rank {rank}, tp {tp}"
            assert result["losses"] == pytest.approx(result["plain_losses"], abs=PARITY_TOLERANCE), context
            assert result["plain_losses"][-1] < result["plain_losses"][0], context  # it trains
            assert result["num_weights"] == 4, context  # layer 1: qkv, proj, fc1, fc2 (layer 0 stays out)
            assert result["mismatches"] == [], context
            assert result["layer0_plain"] and result["released_plain"], context
            # Bytes of the last step: the counter's total is what the package's all-gathers sent; the FP8 weights
            # travel as uint8, and the fp32 run spends exactly 4x their bytes on the same weights (no padding:
            # every parameter size is a multiple of DP).
            assert set(result["plain_by_dtype"]) == {"torch.float32"}, context
            assert set(result["fp8_by_dtype"]) == {"torch.float32", "torch.uint8"}, context
            assert sum(result["plain_by_dtype"].values()) == result["plain_bytes"], context
            assert sum(result["fp8_by_dtype"].values()) == result["fp8_bytes"], context
            fp8_weight_bytes = result["fp8_by_dtype"]["torch.uint8"]
            fp32_bytes_of_same_weights = result["plain_bytes"] - result["fp8_by_dtype"]["torch.float32"]
            assert fp32_bytes_of_same_weights == 4 * fp8_weight_bytes, context
            # Each FP8 weight is gathered once per step: they are all in layer 1, the last unit, which stays
            # gathered from its forward to its backward; each rank receives the other ranks' shards.
            dp = result["dp_size"]
            assert fp8_weight_bytes == result["fp8_elements"] * (dp - 1) // dp, context
    for tp in (1, 2):
        # One scale per weight, the same on every rank (DP shards and TP partitions).
        assert all(per_layout[tp]["scales"] == results[0][tp]["scales"] for per_layout in results)
