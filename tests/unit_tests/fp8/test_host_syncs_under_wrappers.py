"""FP8 adds no host-sync call to a training step (two microbatches, the amax reduction, the optimizer step)
under any data-parallel wrapper: Megatron DDP, the distributed optimizer (with and without `--fp8-param-gather`),
Megatron-FSDP at each ZeRO level (ZeRO-3 with and without `--fp8-param-gather`) and FSDP2, under both torch-native
recipes. Each FP8 run is compared with the same wrapper in fp32, over one step after a warm-up step (DP=2)."""

import pytest

from tests.unit_tests.fp8.test_scaling import counting_host_syncs
from tests.unit_tests.multiprocess_harness import run_on_ranks

WRAPPERS = {
    "ddp": {},
    "distopt": {"use_distributed_optimizer": True},
    "distopt + fp8 param gather": {"use_distributed_optimizer": True, "fp8_param_gather": True},
    "mfsdp optim": {"use_megatron_fsdp": True, "data_parallel_sharding_strategy": "optim"},
    "mfsdp optim_grads": {"use_megatron_fsdp": True, "data_parallel_sharding_strategy": "optim_grads"},
    "mfsdp optim_grads_params": {"use_megatron_fsdp": True, "data_parallel_sharding_strategy": "optim_grads_params"},
    "mfsdp optim_grads_params + fp8 param gather": {"use_megatron_fsdp": True, "fp8_param_gather": True,
                                                    "data_parallel_sharding_strategy": "optim_grads_params"},
    "fsdp2": {"use_torch_fsdp2": True},
}
RECIPES = (None, "tensorwise", "delayed")


def _step_syncs(wrapper_fields, recipe):
    """Host-sync calls of one training step of a 2-layer GPT under the wrapper, after a warm-up step."""
    import torch
    import torch.distributed as dist
    import torch.optim.adam as torch_adam

    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallelConfig, wrap_data_parallel
    from megatron.core.fp8_utils import reduce_fp8_amaxes
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from tests.unit_tests.models.gpt.gpt_test_utils import fixed_batch, seeded_model, tiny_config

    fields = dict(wrapper_fields)
    fp8_param_gather = fields.pop("fp8_param_gather", False) and recipe is not None
    if fields.get("use_megatron_fsdp"):
        fields["use_distributed_optimizer"] = True
    fp8 = {} if recipe is None else {"fp8": "hybrid", "fp8_recipe": recipe, "fp8_amax_history_len": 4,
                                     "fp8_param": fp8_param_gather}
    parallel_state.initialize_model_parallel()
    config = tiny_config(**fp8)
    untied = fields.get("use_torch_fsdp2", False)
    model = seeded_model(config, share_embeddings_and_output_weights=not untied)
    chunk = wrap_data_parallel(config, DistributedDataParallelConfig(fp8_param_gather=fp8_param_gather, **fields),
                               model)
    tokens, labels, position_ids = fixed_batch(seed=7 + dist.get_rank())

    optimizer = get_megatron_optimizer(OptimizerConfig(
        lr=1e-3, clip_grad=1.0, use_distributed_optimizer=fields.get("use_distributed_optimizer", False)), [chunk])

    def step():
        chunk.zero_grad_buffer()
        optimizer.zero_grad()
        for _ in range(2):
            chunk(tokens, position_ids, None, labels=labels).sum().backward()
        chunk.finish_grad_sync()
        reduce_fp8_amaxes([chunk])
        assert optimizer.step()[0]

    step()  # warm-up: lazily built state, first scales and caches
    # torch's Adam reads its step counters with .item(): host tensors under every wrapper (no device sync), and
    # how many it reads depends on how the optimizer groups the parameters, not on FP8.
    original_item, adam_get_value = torch.Tensor.item, torch_adam._get_value
    torch_adam._get_value = lambda x: original_item(x) if isinstance(x, torch.Tensor) else x
    try:
        with counting_host_syncs() as syncs:
            step()
    finally:
        torch_adam._get_value = adam_get_value
    parallel_state.destroy_model_parallel()
    return syncs


def _all_syncs():
    return {(name, recipe): _step_syncs(fields, recipe) for name, fields in WRAPPERS.items() for recipe in RECIPES}


@pytest.fixture(scope="module")
def syncs_on_ranks():
    return run_on_ranks(2, _all_syncs)


@pytest.mark.parametrize("wrapper", list(WRAPPERS))
def test_fp8_adds_no_host_sync_under_the_wrapper(syncs_on_ranks, wrapper):
    for rank_syncs in syncs_on_ranks:
        baseline = rank_syncs[(wrapper, None)]
        for recipe in ("tensorwise", "delayed"):
            assert rank_syncs[(wrapper, recipe)] == baseline, (wrapper, recipe, rank_syncs[(wrapper, recipe)])
