"""Single-process optimizer behaviour: param groups, AdamW/SGD equivalence, bf16 main params, fp16 scaling."""

import copy
import math

import pytest
import torch

from megatron.core.optimizer import (
    DynamicGradScaler,
    Float16Optimizer,
    FP32Optimizer,
    OptimizerConfig,
    get_megatron_optimizer,
)
from tests.unit_tests.optimizer.toy_models import build_toy_model, mse_loss, reference_param_groups, toy_batch


def _backward(model, step):
    inputs, targets = toy_batch(step, 8, dtype=next(model.parameters()).dtype)
    mse_loss(model, inputs, targets).backward()


def test_param_groups_exclude_biases_and_norms_from_weight_decay():
    model = build_toy_model()
    optimizer = get_megatron_optimizer(OptimizerConfig(lr=1e-3, weight_decay=0.1), [model])
    decayed, not_decayed = optimizer.param_groups
    assert decayed["weight_decay"] == 0.1 and not_decayed["weight_decay"] == 0.0
    assert {id(p) for p in decayed["params"]} == {id(model[0].weight), id(model[3].weight), id(model[5].weight)}
    assert len(not_decayed["params"]) == 5  # three biases, norm weight and bias
    assert isinstance(optimizer, FP32Optimizer)


@pytest.mark.parametrize("optimizer_name", ["adam", "sgd"])
def test_fp32_optimizer_matches_torch_optimizer(optimizer_name):
    model = build_toy_model()
    reference = copy.deepcopy(model)
    config = OptimizerConfig(optimizer=optimizer_name, lr=0.01, weight_decay=0.1, clip_grad=0.0,
                             adam_beta1=0.8, adam_beta2=0.95, adam_eps=1e-6, sgd_momentum=0.5)
    optimizer = get_megatron_optimizer(config, [model])
    groups = reference_param_groups(reference, 0.1, 0.01)
    if optimizer_name == "adam":
        reference_optimizer = torch.optim.AdamW(groups, betas=(0.8, 0.95), eps=1e-6)
    else:
        reference_optimizer = torch.optim.SGD(groups, momentum=0.5)
    for step in range(3):
        optimizer.zero_grad()
        reference_optimizer.zero_grad()
        _backward(model, step)
        _backward(reference, step)
        update_successful, grad_norm, num_zeros = optimizer.step()
        reference_optimizer.step()
        assert update_successful and num_zeros is None
        assert math.isfinite(grad_norm) and grad_norm > 0
    for param, expected in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(param, expected, atol=1e-6, rtol=1e-5)


def test_clipping_uses_global_norm_and_count_zeros():
    model = build_toy_model()
    reference = copy.deepcopy(model)
    config = OptimizerConfig(lr=0.01, clip_grad=0.05, log_num_zeros_in_grad=True)
    optimizer = get_megatron_optimizer(config, [model])
    reference_optimizer = torch.optim.AdamW(reference_param_groups(reference, 0.01, 0.01))
    _backward(model, 0)
    _backward(reference, 0)
    model[3].bias.grad[:4] = 0.0  # known zeros
    reference[3].bias.grad[:4] = 0.0
    expected_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.05).item()
    reference_optimizer.step()
    _, grad_norm, num_zeros = optimizer.step()
    assert grad_norm == pytest.approx(expected_norm, rel=1e-6)
    assert expected_norm > 0.05  # clipping really happened
    assert num_zeros == 4
    for param, expected in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(param, expected, atol=1e-6, rtol=1e-5)


def test_bf16_model_keeps_fp32_main_params():
    model = build_toy_model(dtype=torch.bfloat16)
    optimizer = get_megatron_optimizer(OptimizerConfig(lr=0.01, bf16=True, clip_grad=0.0), [model])
    assert isinstance(optimizer, Float16Optimizer) and optimizer.grad_scaler is None
    main_params = optimizer.main_params()
    assert all(param.dtype == torch.float32 for param in main_params)
    # Reference: fp32 master weights stepped with the bf16 gradients, then rounded back to bf16.
    masters = [param.detach().float().clone().requires_grad_(True) for param in model.parameters()]
    groups = [{"params": [m for m in masters if m.dim() >= 2], "weight_decay": 0.01},
              {"params": [m for m in masters if m.dim() < 2], "weight_decay": 0.0}]
    reference_optimizer = torch.optim.AdamW(groups, lr=0.01)
    for step in range(2):
        optimizer.zero_grad()
        _backward(model, step)
        for master, param in zip(masters, model.parameters(), strict=True):
            master.grad = param.grad.float()
        optimizer.step()
        reference_optimizer.step()
    for master, param in zip(masters, model.parameters(), strict=True):
        assert param.dtype == torch.bfloat16
        torch.testing.assert_close(param, master.detach().to(torch.bfloat16), atol=0, rtol=0)
    # The fp32 main params are the masters themselves (up to foreach vs single-tensor rounding).
    masters_in_group_order = groups[0]["params"] + groups[1]["params"]
    for main, master in zip(main_params, masters_in_group_order, strict=True):
        torch.testing.assert_close(main.detach(), master.detach(), atol=1e-6, rtol=1e-6)


def test_fp16_overflow_skips_step_and_backs_off_then_grows():
    model = build_toy_model(dtype=torch.float16)
    config = OptimizerConfig(lr=0.01, fp16=True, initial_loss_scale=1024.0, hysteresis=1, loss_scale_window=2,
                             clip_grad=0.0)
    optimizer = get_megatron_optimizer(config, [model])
    before = [param.detach().clone() for param in model.parameters()]

    inputs, targets = toy_batch(0, 8, dtype=torch.float16)
    optimizer.scale_loss(mse_loss(model, inputs, targets)).backward()
    model[3].weight.grad[0, 0] = float("inf")
    update_successful, grad_norm, _ = optimizer.step()
    assert not update_successful and grad_norm is None
    assert optimizer.get_loss_scale().item() == 512.0
    for param, old in zip(model.parameters(), before, strict=True):
        assert torch.equal(param, old)

    for step in range(2):  # two clean steps at window 2: the scale doubles back
        optimizer.zero_grad()
        optimizer.scale_loss(mse_loss(model, inputs, targets)).backward()
        update_successful, grad_norm, _ = optimizer.step()
        assert update_successful and math.isfinite(grad_norm)
    assert optimizer.get_loss_scale().item() == 1024.0
    assert not torch.equal(model[0].weight, before[0])


def test_fp16_unscaled_update_matches_unscaled_fp32_reference():
    model = build_toy_model(dtype=torch.float16)
    masters = [param.detach().float().clone() for param in model.parameters()]
    config = OptimizerConfig(optimizer="sgd", lr=0.1, weight_decay=0.0, sgd_momentum=0.0, fp16=True,
                             loss_scale=256.0, clip_grad=0.0)
    optimizer = get_megatron_optimizer(config, [model])
    inputs, targets = toy_batch(0, 8, dtype=torch.float16)
    optimizer.scale_loss(mse_loss(model, inputs, targets)).backward()
    expected = [master - 0.1 * param.grad.float() / 256.0 for master, param in zip(masters, model.parameters())]
    optimizer.step()
    decay_first = [index for index, p in enumerate(model.parameters()) if p.dim() >= 2]
    decay_first += [index for index, p in enumerate(model.parameters()) if p.dim() < 2]
    params = list(model.parameters())
    for main, index in zip(optimizer.main_params(), decay_first, strict=True):
        param, value = params[index], expected[index]
        torch.testing.assert_close(main.detach(), value, atol=1e-6, rtol=1e-6)
        assert torch.equal(param, value.half())


def test_dynamic_scaler_hysteresis():
    scaler = DynamicGradScaler(initial_scale=64.0, min_scale=16.0, growth_interval=3, hysteresis=2)
    scaler.update(True)
    assert scaler.scale.item() == 64.0  # first overflow tolerated
    scaler.update(True)
    assert scaler.scale.item() == 32.0
    scaler.update(True)
    assert scaler.scale.item() == 16.0
    scaler.update(True)
    assert scaler.scale.item() == 16.0  # floor
    for _ in range(3):
        scaler.update(False)
    assert scaler.scale.item() == 32.0
    state = scaler.state_dict()
    restored = DynamicGradScaler(initial_scale=1.0, growth_interval=3, hysteresis=2)
    restored.load_state_dict(state)
    assert restored.state_dict() == state


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_state_dict_round_trip_continues_identically(dtype):
    config = OptimizerConfig(lr=0.01, bf16=dtype == torch.bfloat16)
    model = build_toy_model(dtype=dtype)
    optimizer = get_megatron_optimizer(config, [model])
    for step in range(2):
        optimizer.zero_grad()
        _backward(model, step)
        optimizer.step()
    saved_model = copy.deepcopy(model.state_dict())
    saved_optimizer = copy.deepcopy(optimizer.state_dict())

    restored_model = build_toy_model(seed=5, dtype=dtype)
    restored_model.load_state_dict(saved_model)
    restored_optimizer = get_megatron_optimizer(config, [restored_model])
    restored_optimizer.load_state_dict(saved_optimizer)
    for run_model, run_optimizer in ((model, optimizer), (restored_model, restored_optimizer)):
        run_optimizer.zero_grad()
        _backward(run_model, 2)
        run_optimizer.step()
    for param, expected in zip(restored_model.parameters(), model.parameters(), strict=True):
        assert torch.equal(param, expected)


def test_config_validation_names_the_flag():
    with pytest.raises(ValueError, match="lr"):
        OptimizerConfig()
    with pytest.raises(ValueError, match="fp16 and bf16"):
        OptimizerConfig(lr=1.0, fp16=True, bf16=True)
    with pytest.raises(ValueError, match="optimizer"):
        OptimizerConfig(lr=1.0, optimizer="lamb")
    with pytest.raises(ValueError, match="min_lr"):
        OptimizerConfig(lr=1.0, min_lr=2.0)


def test_upstreams_config_fields_are_accepted_at_their_defaults():
    """Configs written for upstream's OptimizerConfig construct: its memory fields at their defaults (the values
    stay the same without remainders), and the one feature not implemented is refused by its flag."""
    config = OptimizerConfig(lr=1e-3, bf16=True, use_distributed_optimizer=True, use_precision_aware_optimizer=True,
                             store_param_remainders=True, pin_cpu_grads=True, pin_cpu_params=True,
                             overlap_param_gather_with_optimizer_step=False)
    assert config.store_param_remainders and config.pin_cpu_grads and config.pin_cpu_params
    with pytest.raises(ValueError, match=r"--overlap-param-gather-with-optimizer-step\) is not implemented"):
        OptimizerConfig(lr=1e-3, use_distributed_optimizer=True, overlap_param_gather_with_optimizer_step=True)


def test_reload_model_params_refreshes_fp32_main_copies():
    model = build_toy_model(dtype=torch.bfloat16)
    optimizer = get_megatron_optimizer(OptimizerConfig(lr=0.0, bf16=True), [model])
    model.load_state_dict(build_toy_model(seed=3, dtype=torch.bfloat16).state_dict())
    optimizer.reload_model_params()
    optimizer.zero_grad()
    _backward(model, 0)
    optimizer.step()  # lr 0: the weights written back must be the freshly loaded ones
    for param, expected in zip(model.parameters(), build_toy_model(seed=3, dtype=torch.bfloat16).parameters()):
        assert torch.equal(param, expected)


def test_arguments_in_upstreams_order_and_names():
    """Upstream's signature: (config, model_chunks, no_weight_decay_cond, scale_lr_cond, lr_mult,
    use_gloo_process_groups, default_skip_embedding_weight_decay), also positionally."""
    model = build_toy_model()
    model[0].weight.is_embedding_parameter = True

    def decayed(optimizer):
        return {id(param) for group in optimizer.param_groups if group["wd_mult"] == 1.0 for param in group["params"]}

    config = OptimizerConfig(lr=0.01)
    assert id(model[0].weight) in decayed(get_megatron_optimizer(config, [model], None, None, 1.0, True))
    assert id(model[0].weight) not in decayed(get_megatron_optimizer(config, [model], None, None, 1.0, False, True))
    optimizer = get_megatron_optimizer(config=config, model_chunks=[model], no_weight_decay_cond=None,
                                       scale_lr_cond=lambda name, param: name.startswith("3."), lr_mult=2.0,
                                       use_gloo_process_groups=False)
    assert {id(model[3].weight), id(model[3].bias)} == {
        id(param) for group in optimizer.param_groups if group["lr_mult"] == 2.0 for param in group["params"]}


def test_static_loss_scale_under_bf16_scales_and_unscales_like_upstream():
    """Upstream's constant scaler also serves --bf16 with --loss-scale: the loss is multiplied by it and the main
    gradients divided by it, and a non-finite gradient skips the step."""
    model = build_toy_model(dtype=torch.bfloat16)
    reference = copy.deepcopy(model)
    config = OptimizerConfig(optimizer="sgd", lr=0.1, weight_decay=0.0, sgd_momentum=0.0, bf16=True,
                             loss_scale=64.0, clip_grad=0.0)
    optimizer = get_megatron_optimizer(config, [model])
    assert optimizer.get_loss_scale().item() == 64.0
    inputs, targets = toy_batch(0, 8, dtype=torch.bfloat16)
    loss = mse_loss(model, inputs, targets)
    assert optimizer.scale_loss(loss).item() == loss.item() * 64.0
    optimizer.scale_loss(loss).backward()
    mse_loss(reference, inputs, targets).backward()
    expected = [param.detach().float() - 0.1 * ref.grad.float() for param, ref in
                zip(model.parameters(), reference.parameters(), strict=True)]
    assert optimizer.step()[0]
    for param, value in zip(model.parameters(), expected, strict=True):
        # The scaled bf16 gradient rounds like the unscaled one (64 is a power of two).
        assert torch.equal(param, value.to(torch.bfloat16))

    optimizer.zero_grad()
    optimizer.scale_loss(mse_loss(model, inputs, targets)).backward()
    model[3].weight.grad[0, 0] = float("nan")
    before = [param.detach().clone() for param in model.parameters()]
    update_successful, grad_norm, _ = optimizer.step()
    assert not update_successful and grad_norm is None
    assert all(torch.equal(param, old) for param, old in zip(model.parameters(), before, strict=True))
    assert optimizer.get_loss_scale().item() == 64.0
