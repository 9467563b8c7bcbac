"""The memory line against the storages a rank holds where counting tensors' elements falls short: the host
copies `--optimizer-cpu-offload` keeps (gradients, copies of kept main views), and FSDP2's padded shards on a rank
whose rows fall short (DP3 over a model whose rows do not divide by 3)."""

import torch

from tests.unit_tests.multiprocess_harness import run_on_ranks
from tests.unit_tests.training.test_memory_line_storages import TOLERANCE, held_storage_bytes


def _line_versus_storages(ddp_fields, optimizer_fields, bf16, untie):
    from megatron.core.distributed import DistributedDataParallelConfig, wrap_data_parallel
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.training.training_log import memory_usage
    from tests.unit_tests.distributed.precision_gpt import build_gpt, gpt_batch, gpt_loss

    model = build_gpt(bf16=bf16, untie=untie, num_layers=1)
    chunk = wrap_data_parallel(model.config, DistributedDataParallelConfig(grad_reduce_in_fp32=bf16, **ddp_fields),
                               model)
    optimizer = get_megatron_optimizer(OptimizerConfig(lr=1e-3, bf16=bf16, **optimizer_fields), [chunk])
    chunk.zero_grad_buffer()
    optimizer.zero_grad()
    gpt_loss(chunk, gpt_batch(0)).backward()
    chunk.finish_grad_sync()
    optimizer.step()
    line = memory_usage([chunk], optimizer, torch.device("cpu"))
    return line["params_bytes"] + line["grads_bytes"] + line["optimizer_state_bytes"], held_storage_bytes(
        chunk, optimizer)


def _assert_within_tolerance(results):
    for rank, (reported, held) in enumerate(results):
        assert abs(reported - held) <= TOLERANCE * held, (rank, reported, held)


def test_optimizer_cpu_offload_host_copies_are_counted():
    """Half of the main parameters step on the host: their host gradients and host copies count."""
    _assert_within_tolerance(run_on_ranks(
        2, _line_versus_storages, dict(use_distributed_optimizer=True),
        dict(use_distributed_optimizer=True, use_precision_aware_optimizer=True, exp_avg_dtype=torch.bfloat16,
             exp_avg_sq_dtype=torch.bfloat16, optimizer_cpu_offload=True, optimizer_offload_fraction=0.5),
        True, False))


def test_fsdp2_padded_shards_of_the_last_rank_are_counted():
    """64 vocabulary rows over 3 ranks: 22, 22, 20; the last rank's shard storages still hold 22 rows."""
    _assert_within_tolerance(run_on_ranks(3, _line_versus_storages, dict(use_torch_fsdp2=True), {}, False, True))
