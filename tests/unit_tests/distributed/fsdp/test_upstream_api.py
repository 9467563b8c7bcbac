"""Upstream Megatron-FSDP API that user scripts call: compute weights as main weights
(`main_params_dtype=None`), `set_model_auto_sync`, `maxpool_double_buffer`, an optimizer built on a meta-device
model, meta-device init of torch modules without a public `reset_parameters()` (nn.MultiheadAttention), and
`split_dtensor` / `uneven_dtensor_to_full_tensor`."""

import pytest
import torch
import torch.nn as nn

from tests.unit_tests.distributed.fsdp import fsdp_test_models as models
from tests.unit_tests.multiprocess_harness import run_on_ranks

NUM_STEPS = 2


def _reference_low_precision(num_steps, dtype=torch.bfloat16):
    """Single-process AdamW stepping the bf16 weights themselves (no fp32 copy)."""
    return models.train_single_process(models.make_model(0, dtype), num_steps, dtype)


def _reference_attention(num_steps):
    """Single-process AdamW training of the eager AttentionModel on the full batch."""
    torch.manual_seed(3)
    return models.train_single_process(AttentionModel(), num_steps)


class AttentionModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(models.IN_FEATURES, 8)
        self.attention = nn.MultiheadAttention(8, 2, batch_first=True)
        self.out = nn.Linear(8, models.IN_FEATURES)

    def forward(self, x):
        h = self.inp(x).unsqueeze(1)
        return self.out(self.attention(h, h, h, need_weights=False)[0].squeeze(1))


def _api_checks():
    import torch.distributed as dist

    import megatron_fsdp
    from megatron_fsdp.uneven_dtensor import split_dtensor, uneven_dtensor_to_full_tensor

    results = {}
    # main_params_dtype=None: AdamW steps the bf16 compute weights (shards) directly, no fp32 copy.
    for strategy in (1, 3):
        module = models.make_model(0, torch.bfloat16)
        optimizer = models.make_optimizer([p for p in module.parameters() if p.requires_grad])
        model, optimizer = megatron_fsdp.fully_shard(
            module, optimizer, fsdp_unit_modules=[models.Block], zero_dp_strategy=strategy,
            mixed_precision_policy=megatron_fsdp.MixedPrecisionPolicy(main_params_dtype=None))
        weight_bytes = {"shards": sum(2 * g.layout.shard_numel for g in model.groups),
                        "full": sum(2 * g.layout.padded_numel for g in model.groups)}
        results[("no_main", strategy)] = (models.train_sharded(model, optimizer, NUM_STEPS, torch.bfloat16),
                                          models.precision_of(model, optimizer), model.memory_report(), weight_bytes)

    # set_model_auto_sync: strategy 1 reduces only in the last microbatch's backward.
    for auto_sync_last_only in (False, True):
        module = models.make_model(0)
        optimizer = models.make_optimizer([p for p in module.parameters() if p.requires_grad])
        model, optimizer = megatron_fsdp.fully_shard(module, optimizer, fsdp_unit_modules=[models.Block],
                                                     zero_dp_strategy=1)
        if auto_sync_last_only:
            calls = {"count": 0}
            original_forward = model.forward

            def forward(*args, **kwargs):  # microbatches 0, 1 without sync, 2 with (3 per step)
                model.set_model_auto_sync(calls["count"] % 3 == 2)
                calls["count"] += 1
                return original_forward(*args, **kwargs)

            model.forward = forward
        model.no_sync = lambda: models._null()
        losses = models.train_sharded(model, optimizer, NUM_STEPS, microbatches=3)
        results[("auto_sync", auto_sync_last_only)] = (losses, model.communication_report()["all_reduce"] +
                                                       model.communication_report()["reduce_scatter"])

    # maxpool_double_buffer: the two-slot gather pool.
    module = models.make_model(0)
    optimizer = models.make_optimizer([p for p in module.parameters() if p.requires_grad])
    model, optimizer = megatron_fsdp.fully_shard(module, optimizer, fsdp_unit_modules=[models.Block],
                                                 maxpool_double_buffer=True)
    results["maxpool"] = (model.pool is not None, models.train_sharded(model, optimizer, NUM_STEPS))

    # An optimizer built on the meta-device model before wrapping is re-pointed at the materialised parameters.
    torch.manual_seed(0)
    with torch.device("meta"):
        meta_module = models.TinyModel()
    optimizer = models.make_optimizer([p for p in meta_module.parameters() if p.requires_grad])
    torch.manual_seed(0)
    model, optimizer = megatron_fsdp.fully_shard(meta_module, optimizer, fsdp_unit_modules=[models.Block],
                                                 init_model_with_meta_device=True)
    results["meta_optimizer"] = models.train_sharded(model, optimizer, NUM_STEPS)

    # nn.MultiheadAttention has only a private _reset_parameters(); meta init equals an eager build.
    torch.manual_seed(3)
    eager = AttentionModel()
    torch.manual_seed(3)
    with torch.device("meta"):
        meta_attention = AttentionModel()
    torch.manual_seed(3)
    wrapped = megatron_fsdp.fully_shard_model(meta_attention, fsdp_unit_modules=[nn.MultiheadAttention],
                                              init_model_with_meta_device=True)
    results["attention"] = ({k: v.detach().clone() for k, v in eager.state_dict().items()},
                            models.full_params(wrapped))
    # ... and trains like the eager module (its forward reads in_proj_weight / out_proj directly).
    torch.manual_seed(3)
    with torch.device("meta"):
        meta_attention = AttentionModel()
    optimizer = models.make_optimizer(meta_attention.parameters())
    torch.manual_seed(3)
    model_attention, optimizer = megatron_fsdp.fully_shard(
        meta_attention, optimizer, fsdp_unit_modules=[nn.MultiheadAttention], zero_dp_strategy=3,
        init_model_with_meta_device=True)
    results["attention_training"] = models.train_sharded(model_attention, optimizer, NUM_STEPS + 1)

    # split_dtensor / uneven_dtensor_to_full_tensor on a row-sharded state-dict DTensor (7 rows: 4 + 3 at DP 2).
    weight = model.state_dict()["blocks.0.fc1.weight"]
    full = weight.full_tensor()
    splits = {}
    for dim, sections in ((0, [2, 5]), (0, 3), (1, [6, 7])):
        pieces = split_dtensor(weight, sections, dim=dim)
        splits[(dim, str(sections))] = ([uneven_dtensor_to_full_tensor(p) for p in pieces],
                                        list(torch.split(full, sections, dim=dim)),
                                        [p.to_local().data_ptr() == 0 or p.to_local().untyped_storage().data_ptr()
                                         == weight.to_local().untyped_storage().data_ptr() for p in pieces])
    results["splits"] = splits
    results["rank"] = dist.get_rank()
    return results


def _split_checkpoint_round_trip(directory):
    """Pieces made with update_uneven_dtensor_chunk_meta=True save with DCP and load back into fresh pieces."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    import torch.distributed as dist
    from megatron_fsdp.uneven_dtensor import make_row_sharded_dtensor, split_dtensor, uneven_dtensor_to_full_tensor

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    full = torch.arange(7 * 3, dtype=torch.float32).view(7, 3)
    rows = full[[0, 1, 2, 3]] if dist.get_rank() == 0 else full[[4, 5, 6]]
    source = make_row_sharded_dtensor(rows, full.shape, mesh, 0)
    pieces = split_dtensor(source, [2, 5], update_uneven_dtensor_chunk_meta=True)
    dcp.save({f"piece{i}": p for i, p in enumerate(pieces)}, checkpoint_id=directory)
    target = make_row_sharded_dtensor(torch.zeros_like(rows), full.shape, mesh, 0)
    fresh = split_dtensor(target, [2, 5], update_uneven_dtensor_chunk_meta=True)
    dcp.load({f"piece{i}": p for i, p in enumerate(fresh)}, checkpoint_id=directory)
    return torch.equal(uneven_dtensor_to_full_tensor(target), full)


@pytest.mark.parametrize("world_size", [2])
def test_upstream_api(world_size, tmp_path):
    reference, _ = models.reference_losses(NUM_STEPS)
    reference_bf16 = _reference_low_precision(NUM_STEPS)
    reference_attention = _reference_attention(NUM_STEPS + 1)
    for results in run_on_ranks(world_size, _api_checks):
        for strategy in (1, 3):
            losses, precision, memory, weight_bytes = results[("no_main", strategy)]
            assert precision == ({torch.bfloat16}, {torch.bfloat16}), strategy
            # bf16 gradients summed over ranks instead of computed on the whole batch: test_parity's tolerance
            assert losses == pytest.approx(reference_bf16, abs=2e-2), strategy
            # the main weights are the compute weights (strategy 1: this rank's rows of them) or the compute shards
            # (strategy 3): one bf16 copy of the weights in all
            held = (memory["compute_weights"], memory["main_weights"])
            if strategy == 1:
                assert held == (weight_bytes["full"], 0), held
            else:
                assert sum(held) == weight_bytes["shards"], (held, weight_bytes)

        always, always_bytes = results[("auto_sync", False)]
        last_only, last_only_bytes = results[("auto_sync", True)]
        assert always == pytest.approx(reference, abs=1e-5) and last_only == pytest.approx(reference, abs=1e-5)
        assert last_only_bytes * 3 == always_bytes  # one gradient all-reduce per step instead of three

        has_pool, losses = results["maxpool"]
        assert has_pool and losses == pytest.approx(reference, abs=1e-5)
        assert results["meta_optimizer"] == pytest.approx(reference, abs=1e-5)

        assert results["attention_training"] == pytest.approx(reference_attention, abs=1e-5)
        assert results["attention_training"][-1] < results["attention_training"][0]  # it really trained

        eager, meta = results["attention"]
        assert set(meta) == set(eager)
        for name, value in eager.items():
            torch.testing.assert_close(meta[name], value, rtol=0, atol=0, msg=name)

        for key, (assembled, expected, views) in results["splits"].items():
            assert len(assembled) == len(expected), key
            for got, want in zip(assembled, expected):
                assert torch.equal(got, want), key
            assert all(views), key  # pieces are views of the local block, not copies
    assert all(run_on_ranks(world_size, _split_checkpoint_round_trip, str(tmp_path / "pieces")))
