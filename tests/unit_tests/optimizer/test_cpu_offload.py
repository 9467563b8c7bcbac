"""Optimizer CPU offload (`--optimizer-cpu-offload`): the split, training equal to no offload under the
distributed optimizer and Megatron-FSDP, checkpoints equal and loadable across offload settings, the flag
rules, and the copy helpers (pinned memory and side streams on CUDA; the same logic synchronously on the CPU)."""

import copy

import pytest
import torch

from megatron.core.optimizer import OptimizerConfig
from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer, offload_split
from tests.unit_tests.multiprocess_harness import run_on_ranks

LR = 1e-2
STEPS, SAVE_AFTER = 3, 1
SETTINGS = {
    "none": {},
    "all": dict(optimizer_cpu_offload=True),
    "half": dict(optimizer_cpu_offload=True, optimizer_offload_fraction=0.5),
    "half_overlap": dict(optimizer_cpu_offload=True, optimizer_offload_fraction=0.5,
                         overlap_cpu_optimizer_d2h_h2d=True),
    "all_torch": dict(optimizer_cpu_offload=True, use_torch_optimizer_for_cpu_offload=True),
}


def test_offload_split_takes_whole_tensors_in_order_until_the_fraction_is_reached():
    assert offload_split([4, 4, 2], 1.0) == [True, True, True]
    assert offload_split([4, 4, 2], 0.0) == [False, False, False]
    assert offload_split([4, 4, 2], 0.4) == [True, False, False]  # 4 reaches 4
    assert offload_split([4, 4, 2], 0.5) == [True, True, False]  # 4 < 5: the crossing tensor goes too
    assert offload_split([2, 8, 1], 0.1) == [True, False, False]  # a prefix: later small tensors stay
    assert offload_split([0, 3, 3], 0.5) == [False, True, False]  # empty tensors stay on the device
    with pytest.raises(ValueError, match="--optimizer-offload-fraction"):
        offload_split([1], 1.5)


# ---- training on two data-parallel ranks --------------------------------------------------------------------
def _build(wrapper, setting):
    from megatron.core.distributed import DistributedDataParallelConfig, wrap_data_parallel
    from megatron.core.optimizer import get_megatron_optimizer
    from tests.unit_tests.distributed.precision_gpt import build_gpt

    model = build_gpt()
    if wrapper == "distributed_optimizer":
        ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=True)
    else:
        ddp_config = DistributedDataParallelConfig(use_megatron_fsdp=True, use_distributed_optimizer=True,
                                                   data_parallel_sharding_strategy=wrapper)
    chunk = wrap_data_parallel(model.config, ddp_config, model)
    config = OptimizerConfig(lr=LR, use_distributed_optimizer=True, use_precision_aware_optimizer=True,
                             **SETTINGS[setting])
    return chunk, get_megatron_optimizer(config, [chunk])


def _train(chunk, optimizer, steps):
    from tests.unit_tests.distributed.precision_gpt import gpt_batch, gpt_loss

    losses, norms = [], []
    for step in steps:
        chunk.zero_grad_buffer()
        optimizer.zero_grad()
        loss = gpt_loss(chunk, gpt_batch(step))
        loss.backward()
        chunk.finish_grad_sync()
        update_successful, grad_norm, _ = optimizer.step()
        assert update_successful
        losses.append(loss.item())
        norms.append(float(grad_norm))
    return losses, norms


def _cloned(tree):
    """A copy of a state dict whose tensors (DTensors included) are clones (deepcopy fails on some DTensors).
    A DTensor is rebuilt around a clone of its local shard: cloning it directly runs DTensor's sharding
    propagation, which misses its cache for every new mesh and shape."""
    if isinstance(tree, dict):
        return {key: _cloned(value) for key, value in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_cloned(value) for value in tree)
    if hasattr(tree, "to_local"):
        from torch.distributed.tensor import DTensor

        return DTensor.from_local(tree.to_local().detach().clone(), tree.device_mesh, tree.placements,
                                  run_check=False, shape=tree.shape, stride=tree.stride())
    return tree.detach().clone() if torch.is_tensor(tree) else copy.deepcopy(tree)


def _checkpoint(chunk, optimizer):
    return _cloned({"model": chunk.state_dict(), "optimizer": optimizer.state_dict()})


def _local(value):
    return value.to_local() if hasattr(value, "to_local") else value


def _differences(a, b, path=""):
    """Where two checkpoints differ in keys, tensor dtypes or values (empty: identical)."""
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            return [f"{path}: keys {sorted(map(str, set(a) ^ set(b)))}"]
        return [d for key in a for d in _differences(a[key], b[key], f"{path}/{key}")]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return [f"{path}: lengths {len(a)} != {len(b)}"]
        return [d for index, (x, y) in enumerate(zip(a, b)) for d in _differences(x, y, f"{path}/{index}")]
    if torch.is_tensor(a) and torch.is_tensor(b):
        a, b = _local(a), _local(b)
        if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(a.cpu(), b.cpu()):
            return [f"{path}: tensors differ"]
        return []
    return [] if a == b else [f"{path}: {a!r} != {b!r}"]


def _layout(optimizer):
    """How the hybrid optimizer split this rank's main parameters, and that the offloaded ones really live in
    separate host copies whose state is the host optimizer's."""
    hybrid = optimizer.optimizer
    assert isinstance(hybrid, HybridDeviceOptimizer)
    entries = hybrid.offloaded
    main = [param for group in hybrid.param_groups for param in group["params"] if param.numel()]
    host_states = [optimizer_.state for optimizer_, _ in hybrid.host_steps]
    return {
        "offloaded_numel": sum(entry.device_param.numel() for entry in entries),
        "last_offloaded_numel": entries[-1].device_param.numel() if entries else 0,
        "total_numel": sum(param.numel() for param in main),
        "offloaded_prefix": all(main[index] is entry.device_param for index, entry in enumerate(entries)),
        # fp32 model: the main parameters are views the wrapper keeps reading (the distributed optimizer's shards of
        # its parameter buffer, Megatron-FSDP's main weights) and keep a separate host copy.
        "relocated": [entry.relocated for entry in entries],
        "main_in_host_buffer": all(entry.device_param.data_ptr() == entry.host_param.data_ptr()
                                   and entry.device_param.untyped_storage().nbytes() == entry.host_param.nbytes
                                   for entry in entries if entry.relocated),
        "separate_copies": all(entry.relocated or entry.host_param.data_ptr() != entry.device_param.data_ptr()
                               for entry in entries),
        "shared_state": all(any(hybrid.state[entry.device_param] is states.get(entry.host_param) for states in
                                host_states) for entry in entries),
        "host_optimizers": len(hybrid.host_steps),
        "device_optimizer": hybrid.device_optimizer is not None,
    }


def _offload_runs(wrapper):
    runs, checkpoints, layouts = {}, {}, {}
    for setting in SETTINGS:
        chunk, optimizer = _build(wrapper, setting)
        first = _train(chunk, optimizer, range(SAVE_AFTER))
        checkpoints[setting] = _checkpoint(chunk, optimizer)
        rest = _train(chunk, optimizer, range(SAVE_AFTER, STEPS))
        runs[setting] = (first[0] + rest[0], first[1] + rest[1])
        if setting != "none":
            layouts[setting] = _layout(optimizer)
    differences = {setting: _differences(checkpoints["none"], checkpoints[setting]) for setting in SETTINGS}
    # Resume each direction across offload settings: the next losses equal the uninterrupted run's.
    resumed = {}
    for saved_with, loaded_with in (("all", "none"), ("none", "half"), ("half", "all_torch")):
        chunk, optimizer = _build(wrapper, loaded_with)
        chunk.load_state_dict(checkpoints[saved_with]["model"])
        optimizer.load_state_dict(_cloned(checkpoints[saved_with]["optimizer"]))
        resumed[saved_with, loaded_with] = _train(chunk, optimizer, range(SAVE_AFTER, STEPS))[0]
    return {"runs": runs, "layouts": layouts, "resumed": resumed, "differences": differences}


@pytest.mark.parametrize("world_size", [2])
@pytest.mark.parametrize("wrapper", ["distributed_optimizer", "optim", "optim_grads_params"])
def test_offload_trains_and_checkpoints_like_no_offload(world_size, wrapper):
    for result in run_on_ranks(world_size, _offload_runs, wrapper):
        losses, norms = result["runs"]["none"]
        assert losses[-1] < losses[0]  # it trains
        for setting in ("all", "half", "half_overlap"):
            # The host steps with the same AdamW arithmetic in fp32: the same numbers (within 1e-6).
            assert result["runs"][setting][0] == pytest.approx(losses, rel=1e-6, abs=0), setting
            assert result["runs"][setting][1] == pytest.approx(norms, rel=1e-6, abs=0), setting
            assert result["differences"][setting] == [], setting
        # torch's multi-tensor AdamW on the host: the same update up to its kernels' rounding.
        assert result["runs"]["all_torch"][0] == pytest.approx(losses, rel=1e-6, abs=0)
        assert result["differences"]["all_torch"] == []
        layouts = result["layouts"]
        all_, half = layouts["all"], layouts["half"]
        assert all_["offloaded_numel"] == all_["total_numel"] > 0 and not all_["device_optimizer"]
        # Offloaded until half is reached: the tensor that crosses it is the last one on the host.
        assert half["offloaded_numel"] - half["last_offloaded_numel"] < half["total_numel"] / 2
        assert half["total_numel"] / 2 <= half["offloaded_numel"] < half["total_numel"] and half["device_optimizer"]
        assert layouts["half_overlap"]["host_optimizers"] > 1 == half["host_optimizers"]  # one per parameter
        for layout in layouts.values():
            assert layout["offloaded_prefix"] and layout["separate_copies"] and layout["shared_state"]
            assert layout["main_in_host_buffer"]
            # Only the optimizer's own clones leave the device: an fp32 model has none (see the bf16 test below).
            assert set(layout["relocated"]) == {False}
        for (saved_with, loaded_with), resumed_losses in result["resumed"].items():
            expected = result["runs"][loaded_with][0][SAVE_AFTER:]
            assert resumed_losses == pytest.approx(expected, rel=1e-6, abs=0), (saved_with, loaded_with)


def _distributed_optimizer_offload_against_device(dtype):
    """A toy model under the distributed optimizer with every main parameter offloaded, next to the same model
    without offload: where the offloaded main parameters live, and whether both step to the same weights, also
    after the model's weights are replaced (a load without optimizer state) between steps."""
    import torch.distributed as dist

    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.model_parallel_config import ModelParallelConfig
    from megatron.core.optimizer import get_megatron_optimizer
    from tests.unit_tests.optimizer.toy_models import build_toy_model, mse_loss, toy_batch

    half = dtype != torch.float32
    runs = []
    for setting in ("none", "all"):
        model = build_toy_model(dtype=dtype)
        ddp = DistributedDataParallel(ModelParallelConfig(), DistributedDataParallelConfig(
            use_distributed_optimizer=True, bucket_size=40, grad_reduce_in_fp32=half), model)
        config = OptimizerConfig(lr=LR, use_distributed_optimizer=True, use_precision_aware_optimizer=True,
                                 bf16=half, **SETTINGS[setting])
        runs.append((model, ddp, get_megatron_optimizer(config, [ddp])))
    replacement = build_toy_model(seed=5, dtype=dtype).state_dict()
    downloads_per_step = []  # device -> host copies of the offloaded run's steps after the first
    for step in range(3):
        if step == 2:
            for model, _, optimizer in runs:
                model.load_state_dict(replacement)
                optimizer.reload_model_params()
        for model, ddp, optimizer in runs:
            inputs, targets = toy_batch(step + 10 * dist.get_rank(), 2, dtype=dtype)
            ddp.zero_grad_buffer()
            optimizer.zero_grad()
            mse_loss(ddp, inputs, targets).backward()
            finalize_model_grads([ddp])
            if step == 1 and model is runs[1][0]:  # the copy stream exists once the first step built the split
                download = optimizer.optimizer._download
                download.copy = (lambda copy: lambda *args: copies.append(args) or copy(*args))(download.copy)
            copies = []
            assert optimizer.step()[0]
            if step > 0 and model is runs[1][0]:
                downloads_per_step.append(len(copies))
    (reference, _, _), (offloaded, ddp, optimizer) = runs
    buffer_storages = {buffer.param_data.untyped_storage().data_ptr() for buffer in ddp.buffers}
    entries = optimizer.optimizer.offloaded
    return {
        "offloaded": len(entries) == len(optimizer.main_params()) > 0,
        "relocated": [entry.relocated for entry in entries],
        "device_param_in_buffer": [entry.device_param.untyped_storage().data_ptr() in buffer_storages
                                   for entry in entries],
        "equal": all(torch.equal(a, b) for a, b in zip(offloaded.parameters(), reference.parameters(), strict=True)),
        "downloads_per_step": downloads_per_step,
        "num_offloaded": len(entries),
    }


@pytest.mark.parametrize("world_size", [2])
def test_distributed_optimizer_offloads_buffer_views_by_copy_and_main_copies_by_move(world_size):
    """fp32: the main parameters are the parameter buffer's own values, so each offloaded one is stepped in a host
    copy and written back; bf16: the fp32 main copies themselves move to the host. Both equal no offload."""
    for result in run_on_ranks(world_size, _distributed_optimizer_offload_against_device, torch.float32):
        assert result["offloaded"] and result["equal"]
        assert not any(result["relocated"]) and all(result["device_param_in_buffer"])
        # A step moves each gradient to the host; the host copy of the values is refreshed only after the
        # weights were replaced (step 2), not after the parameter all-gather, which rewrites the shard unchanged.
        count = result["num_offloaded"]
        assert result["downloads_per_step"] == [count, 2 * count]
    for result in run_on_ranks(world_size, _distributed_optimizer_offload_against_device, torch.bfloat16):
        assert result["offloaded"] and result["equal"]
        assert all(result["relocated"]) and not any(result["device_param_in_buffer"])


# ---- flags --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(optimizer_cpu_offload=True, use_distributed_optimizer=True),
         r"--optimizer-cpu-offload\) needs use_precision_aware_optimizer"),
        (dict(overlap_cpu_optimizer_d2h_h2d=True), r"--overlap-cpu-optimizer-d2h-h2d\) needs optimizer_cpu_offload"),
        (dict(use_torch_optimizer_for_cpu_offload=True), r"--use-torch-optimizer-for-cpu-offload\) needs"),
        (dict(optimizer_offload_fraction=1.5), r"--optimizer-offload-fraction\) must lie in \[0, 1\]"),
        (dict(optimizer_cpu_offload=True, use_precision_aware_optimizer=True, use_distributed_optimizer=True,
              use_torch_optimizer_for_cpu_offload=True, exp_avg_dtype=torch.bfloat16),
         r"keeps fp32 state; drop --exp-avg-dtype"),
    ],
)
def test_config_rules_name_the_flags(kwargs, message):
    with pytest.raises(ValueError, match=message):
        OptimizerConfig(lr=1e-3, **kwargs)


@pytest.mark.parametrize(
    "extra, message",
    [
        ("--optimizer-cpu-offload --use-distributed-optimizer", r"--optimizer-cpu-offload needs "
         r"--use-precision-aware-optimizer"),
        ("--optimizer-cpu-offload --use-precision-aware-optimizer", r"needs the distributed optimizer"),
        ("--overlap-cpu-optimizer-d2h-h2d", r"--overlap-cpu-optimizer-d2h-h2d needs --optimizer-cpu-offload"),
        ("--use-torch-optimizer-for-cpu-offload",
         r"--use-torch-optimizer-for-cpu-offload needs --optimizer-cpu-offload"),
        ("--optimizer-offload-fraction 0.5", r"--optimizer-offload-fraction needs --optimizer-cpu-offload"),
        ("--optimizer-cpu-offload --use-precision-aware-optimizer --use-distributed-optimizer "
         "--optimizer-offload-fraction 2", r"--optimizer-offload-fraction must lie in \[0, 1\]"),
    ],
)
def test_flag_rules_name_the_flags(extra, message):
    from tests.unit_tests.training.test_arguments import validated

    with pytest.raises(ValueError, match=message):
        validated(extra)


@pytest.mark.parametrize("pin_cpu_grads, pin_cpu_params", [(True, True), (False, True), (True, False)])
def test_upstreams_pin_cpu_fields_choose_the_host_memory(monkeypatch, pin_cpu_grads, pin_cpu_params):
    """OptimizerConfig.pin_cpu_grads / pin_cpu_params (upstream's fields, default True) reach the host buffers:
    pinned where the compute device can use pinned memory (an accelerator, stood in for by the meta device)."""
    from megatron.core.offloading import placement
    from megatron.core.optimizer.cpu_offloading import hybrid_optimizer_factory

    monkeypatch.setattr(placement, "pinning_available", lambda: True)
    config = OptimizerConfig(lr=LR, use_distributed_optimizer=True, use_precision_aware_optimizer=True,
                             optimizer_cpu_offload=True, pin_cpu_grads=pin_cpu_grads, pin_cpu_params=pin_cpu_params)
    build = hybrid_optimizer_factory(config, lambda groups: torch.optim.AdamW(groups, lr=LR))
    hybrid = build([{"params": [torch.nn.Parameter(torch.zeros(4, device="meta"))]}])
    assert (hybrid.grad_placement.pin_memory, hybrid.placement.pin_memory) == (pin_cpu_grads, pin_cpu_params)


def test_fp16_moments_are_stored_scaled_by_the_host_optimizer_too(monkeypatch):
    """`--exp-avg-dtype fp16 --exp-avg-sq-dtype fp16` with offload: accepted, and the host part steps with the
    same per-tensor scaled fp16 moments as the device part (equal to one precision-aware AdamW), keeping its
    scales through a state dict round trip."""
    from megatron.core.optimizer.cpu_offloading import host_optimizer_factory
    from megatron.core.optimizer.precision_aware_adam import PrecisionAwareAdamW, build_precision_aware_adam
    from megatron.training.model_config import optimizer_config_from_args
    from tests.unit_tests.training.test_arguments import validated

    monkeypatch.setenv("WORLD_SIZE", "1")
    config = optimizer_config_from_args(validated(
        "--use-distributed-optimizer --use-precision-aware-optimizer --optimizer-cpu-offload "
        "--optimizer-offload-fraction 0.5 --exp-avg-dtype fp16 --exp-avg-sq-dtype fp16"))
    assert (config.exp_avg_dtype, config.exp_avg_sq_dtype) == (torch.float16, torch.float16)
    generator = torch.Generator().manual_seed(0)
    values = [torch.randn(64, generator=generator), torch.randn(64, generator=generator)]
    grads = [[torch.randn(64, generator=generator) * 1e-6 for _ in values] for _ in range(3)]

    def device_factory(groups):
        return build_precision_aware_adam(groups, config, torch.device("cpu"))

    params = [torch.nn.Parameter(value.clone()) for value in values]
    hybrid = HybridDeviceOptimizer([{"params": params}], device_factory, host_optimizer_factory(config),
                                   offload_fraction=0.5)
    reference_params = [torch.nn.Parameter(value.clone()) for value in values]
    reference = device_factory([{"params": reference_params}])
    for step_grads in grads:
        for param, reference_param, grad in zip(params, reference_params, step_grads):
            param.decoupled_grad, reference_param.decoupled_grad = grad.clone(), grad.clone()
        hybrid.step()
        reference.step()
    host_optimizer = hybrid.host_steps[0][0]
    assert isinstance(host_optimizer, PrecisionAwareAdamW) and hybrid.offloaded_params() == [params[0]]
    for param, reference_param in zip(params, reference_params):
        assert torch.equal(param, reference_param)
        for key in ("exp_avg", "exp_avg_scale", "exp_avg_sq", "exp_avg_sq_scale"):
            assert torch.equal(hybrid.state[param][key], reference.state[reference_param][key]), key
        assert hybrid.state[param]["exp_avg_sq"].dtype == torch.float16
        value = hybrid.get_unscaled_state(param, "exp_avg_sq")
        assert torch.equal(value, reference.get_unscaled_state(reference_param, "exp_avg_sq")) and value.min() > 0
    saved = copy.deepcopy(hybrid.state_dict())
    restored = HybridDeviceOptimizer([{"params": [torch.nn.Parameter(p.detach().clone()) for p in params]}],
                                     device_factory, host_optimizer_factory(config), offload_fraction=0.5)
    restored.load_state_dict(saved)
    for index, param in enumerate(restored.param_groups[0]["params"]):
        for key, value in saved["state"][index].items():
            assert restored.state[param][key].dtype == value.dtype and torch.equal(restored.state[param][key], value)


def test_flags_reach_the_optimizer_config(monkeypatch):
    from megatron.training.model_config import optimizer_config_from_args
    from tests.unit_tests.training.test_arguments import validated

    monkeypatch.setenv("WORLD_SIZE", "1")
    args = validated("--use-megatron-fsdp --use-precision-aware-optimizer --optimizer-cpu-offload "
                     "--optimizer-offload-fraction 0.25 --overlap-cpu-optimizer-d2h-h2d "
                     "--use-torch-optimizer-for-cpu-offload")
    config = optimizer_config_from_args(args)
    assert (config.optimizer_cpu_offload, config.optimizer_offload_fraction, config.overlap_cpu_optimizer_d2h_h2d,
            config.use_torch_optimizer_for_cpu_offload) == (True, 0.25, True, True)
    defaults = optimizer_config_from_args(validated())
    assert (defaults.optimizer_cpu_offload, defaults.optimizer_offload_fraction) == (False, 1.0)
