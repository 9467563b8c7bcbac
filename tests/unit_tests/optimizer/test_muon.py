"""`--optimizer muon`: the step against the formulas, which parameters Muon takes, the fused-QKV split, tensor
parallelism (duplicated and distributed equal one rank), checkpoint round trips and refused combinations; the
data-parallel wrappers are in test_muon_data_parallel.py."""

import copy
import math

import pytest
import torch

from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.optimizer import FP32Optimizer, MuonWithAdamW, OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer.muon import join_qkv_rows, split_qkv_rows
from megatron.core.transformer.transformer_config import TransformerConfig
from tests.unit_tests.multiprocess_harness import run_on_ranks
from tests.unit_tests.optimizer.toy_models import build_toy_model, mse_loss, toy_batch

A, B, C = 3.4445, -4.7750, 2.0315


def reference_newton_schulz(matrix, steps):
    """The quintic iteration on the orientation with fewer rows, written as the polynomial a X + b A X + c A A X."""
    wide = matrix.T if matrix.size(0) > matrix.size(1) else matrix
    x = wide / max(wide.norm().item(), 1e-7)
    for _ in range(steps):
        gram = x @ x.T
        x = A * x + B * (gram @ x) + C * (gram @ (gram @ x))
    return x.T if matrix.size(0) > matrix.size(1) else x


def reference_scale(rows, cols, mode):
    return {"spectral": math.sqrt(max(rows, cols)), "unit_rms_norm": math.sqrt(rows / cols),
            "shape_scaling": math.sqrt(max(1.0, rows / cols))}[mode]


def _backward(model, step):
    inputs, targets = toy_batch(step, 8, dtype=next(model.parameters()).dtype)
    mse_loss(model, inputs, targets).backward()


@pytest.mark.parametrize("nesterov,scale_mode,steps",
                         [(False, "spectral", 5), (True, "unit_rms_norm", 3), (True, "shape_scaling", 5)])
def test_step_matches_the_formulas(nesterov, scale_mode, steps):
    lr, wd, momentum, extra = 0.02, 0.1, 0.9, 0.5
    model = build_toy_model()
    reference = copy.deepcopy(model)
    config = OptimizerConfig(optimizer="muon", lr=lr, weight_decay=wd, clip_grad=0.0, adam_beta1=0.8,
                             adam_beta2=0.95, adam_eps=1e-6, muon_momentum=momentum, muon_use_nesterov=nesterov,
                             muon_num_ns_steps=steps, muon_scale_mode=scale_mode, muon_extra_scale_factor=extra)
    optimizer = get_megatron_optimizer(config, [model])
    assert isinstance(optimizer, FP32Optimizer) and isinstance(optimizer.optimizer, MuonWithAdamW)
    matrices = [param for param in reference.parameters() if param.dim() == 2]
    others = [param for param in reference.parameters() if param.dim() != 2]
    adamw = torch.optim.AdamW(others, lr=lr, weight_decay=0.0, betas=(0.8, 0.95), eps=1e-6)
    buffers = [torch.zeros_like(param) for param in matrices]
    for step in range(3):
        optimizer.zero_grad()
        reference.zero_grad()
        _backward(model, step)
        _backward(reference, step)
        assert optimizer.step()[0]
        with torch.no_grad():
            adamw.step()
            for param, buffer in zip(matrices, buffers):
                buffer.mul_(momentum).add_((1 - momentum) * param.grad)
                update = (1 - momentum) * param.grad + momentum * buffer if nesterov else buffer
                orthogonal = reference_newton_schulz(update, steps) * reference_scale(*param.shape, scale_mode)
                param.mul_(1 - lr * wd).sub_(lr * extra * orthogonal)
    for param, expected in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(param, expected, atol=1e-6, rtol=0)


def test_newton_schulz_orthogonalizes():
    """Five quintic steps bring every singular value into the iteration's band around 1 (about 0.7 to 1.2)."""
    from megatron.core.optimizer.muon import newton_schulz

    matrix = torch.randn(24, 40, generator=torch.Generator().manual_seed(0))
    singular_values = torch.linalg.svdvals(newton_schulz(matrix, 5))
    assert singular_values.min() > 0.6 and singular_values.max() < 1.25
    assert torch.linalg.svdvals(matrix).max() / torch.linalg.svdvals(matrix).min() > 3


def _gpt(**kwargs):
    config = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, hidden_dropout=0.0,
                               attention_dropout=0.0, init_seed=1234, **kwargs)
    return GPTModel(config, vocab_size=64, max_sequence_length=16, share_embeddings_and_output_weights=False)


def _names(model, groups, muon):
    name_of = {id(param): name for name, param in model.named_parameters()}
    return {name_of[id(param)] for group in groups if group.get("use_muon", False) == muon
            for param in group["params"]}


def test_muon_takes_hidden_matrices_and_adamw_the_rest():
    model = _gpt(num_query_groups=2, num_moe_experts=2, add_bias_linear=True)
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="muon", lr=1e-3), [model])
    muon, adam = _names(model, optimizer.param_groups, True), _names(model, optimizer.param_groups, False)
    assert muon and adam and not muon & adam
    assert muon | adam == {name for name, _ in model.named_parameters()}
    assert {name for name in muon if "linear_qkv" in name or "linear_proj" in name} == {
        "decoder.layers.0.self_attention.linear_qkv.weight", "decoder.layers.0.self_attention.linear_proj.weight"}
    assert {name for name in muon if "experts" in name} == {
        f"decoder.layers.0.mlp.experts.local_experts.{j}.{fc}.weight" for j in range(2) for fc in ("linear_fc1",
                                                                                                   "linear_fc2")}
    for name in ("embedding.word_embeddings.weight", "embedding.position_embeddings.weight",
                 "output_layer.weight", "decoder.final_layernorm.weight",
                 "decoder.layers.0.self_attention.linear_qkv.bias"):
        assert name in adam
    # The fused QKV weight is alone in a group that splits it: 2 query groups of (2 q heads, k, v) x head_dim 8.
    (qkv_group,) = [group for group in optimizer.param_groups if group.get("qkv_split") is not None]
    assert qkv_group["qkv_split"] == (16, 8, 8)
    assert qkv_group["params"] == [model.decoder.layers[0].self_attention.linear_qkv.weight]
    no_split = get_megatron_optimizer(OptimizerConfig(optimizer="muon", lr=1e-3, muon_split_qkv=False), [model])
    assert all(group.get("qkv_split") is None for group in no_split.param_groups)


def test_split_qkv_orthogonalizes_queries_keys_and_values_apart():
    weight = torch.nn.Parameter(torch.randn(2 * (16 + 8 + 8), 12, generator=torch.Generator().manual_seed(1)))
    grad = torch.randn(weight.shape, generator=torch.Generator().manual_seed(2))
    expected_parts = [reference_newton_schulz(part, 5) * reference_scale(*part.shape, "spectral")
                      for part in split_qkv_rows(grad, (16, 8, 8))]
    rows = grad.view(2, 32, 12)
    assert torch.equal(split_qkv_rows(grad, (16, 8, 8))[1], rows[:, 16:24].reshape(16, 12))
    expected = weight.detach() - 0.1 * join_qkv_rows(expected_parts, (16, 8, 8))
    optimizer = MuonWithAdamW([{"params": [weight], "use_muon": True, "momentum": 0.0, "nesterov": False,
                                "ns_steps": 5, "scale_mode": "spectral", "extra_scale_factor": 1.0,
                                "tp_mode": "blockwise", "fp32_matmul_prec": "medium", "qkv_split": (16, 8, 8)}],
                              lr=0.1, weight_decay=0.0)
    weight.grad = grad
    optimizer.step()
    torch.testing.assert_close(weight.detach(), expected, atol=1e-6, rtol=0)
    whole = weight.detach() - 0.1 * reference_newton_schulz(grad, 5) * reference_scale(64, 12, "spectral")
    assert (whole - expected).abs().max() > 1e-2  # the split is not the whole-matrix update


def test_checkpoint_round_trip_resumes_to_identical_steps(tmp_path):
    config = OptimizerConfig(optimizer="muon", lr=0.01, weight_decay=0.1, muon_use_nesterov=True, bf16=True)
    model = build_toy_model(dtype=torch.bfloat16)
    optimizer = get_megatron_optimizer(config, [model])
    for step in range(2):
        optimizer.zero_grad()
        _backward(model, step)
        optimizer.step()
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, tmp_path / "ckpt.pt")
    momentum = [state["momentum_buffer"] for state in optimizer.state.values() if "momentum_buffer" in state]
    assert len(momentum) == 3 and all(buffer.abs().sum() > 0 for buffer in momentum)

    resumed_model = build_toy_model(seed=5, dtype=torch.bfloat16)
    resumed = get_megatron_optimizer(config, [resumed_model])
    saved = torch.load(tmp_path / "ckpt.pt", weights_only=False)
    resumed_model.load_state_dict(saved["model"])
    resumed.load_state_dict(saved["optimizer"])
    for run_model, run_optimizer in ((model, optimizer), (resumed_model, resumed)):
        for step in (2, 3):
            run_optimizer.zero_grad()
            _backward(run_model, step)
            run_optimizer.step()
    for param, expected in zip(resumed_model.parameters(), model.parameters(), strict=True):
        assert torch.equal(param, expected)
    fresh_model = build_toy_model(seed=5, dtype=torch.bfloat16)
    fresh_model.load_state_dict(saved["model"])
    fresh = get_megatron_optimizer(config, [fresh_model])  # weights alone: no momentum, different steps
    for step in (2, 3):
        fresh.zero_grad()
        _backward(fresh_model, step)
        fresh.step()
    assert not torch.equal(fresh_model[3].weight, model[3].weight)


def test_torch_dist_checkpoint_round_trip_resumes_to_identical_steps(tmp_path):
    """The logical (torch_dist) format: momentum buffers saved by parameter name, loaded into a fresh optimizer."""
    from megatron.core.dist_checkpointing import serialization, wrappers

    config = OptimizerConfig(optimizer="muon", lr=0.01, weight_decay=0.1)
    model = build_toy_model()
    optimizer = get_megatron_optimizer(config, [model])
    for step in range(2):
        optimizer.zero_grad()
        _backward(model, step)
        optimizer.step()
    state = wrappers.optimizer_state_to_save(optimizer, [model])
    assert {key for key in state if key.endswith("momentum_buffer")} == {
        f"optimizer.state.{index}.weight.momentum_buffer" for index in (0, 3, 5)}
    serialization.save(state, str(tmp_path / "ckpt"))
    resumed_model = copy.deepcopy(model)
    resumed = get_megatron_optimizer(config, [resumed_model])
    metadata = serialization.read_metadata(str(tmp_path / "ckpt"))
    targets, install = wrappers.optimizer_load_targets(resumed, [resumed_model], list(metadata.state_dict_metadata))
    targets.update({"optimizer.step": None, "optimizer.param_groups": None})
    serialization.load(targets, str(tmp_path / "ckpt"), metadata=metadata)
    install(targets)
    for run_model, run_optimizer in ((model, optimizer), (resumed_model, resumed)):
        run_optimizer.zero_grad()
        _backward(run_model, 2)
        run_optimizer.step()
    for param, expected in zip(resumed_model.parameters(), model.parameters(), strict=True):
        assert torch.equal(param, expected)


@pytest.mark.parametrize("checkpoint_format", ["torch", "torch_dist"])
def test_resume_keeps_the_muon_settings_of_this_run(checkpoint_format):
    """A run resumed with other --muon-* flags (here --muon-tp-mode, as when TP grows) steps as its flags say;
    the other hyperparameters still come from the checkpoint."""
    from megatron.core.dist_checkpointing import optimizer_state

    saved_config = OptimizerConfig(optimizer="muon", lr=0.01, adam_beta1=0.8)
    resumed_config = OptimizerConfig(optimizer="muon", lr=0.01, muon_momentum=0.9, muon_num_ns_steps=3,
                                     muon_tp_mode="duplicated")
    saved = get_megatron_optimizer(saved_config, [build_toy_model()])
    resumed = get_megatron_optimizer(resumed_config, [build_toy_model()])
    if checkpoint_format == "torch":
        resumed.load_state_dict(saved.state_dict())
    else:
        groups = [{key: value for key, value in group.items() if key != "params"} for group in saved.param_groups]
        optimizer_state.install_optimizer_state(resumed, [], None, groups, None)
    muon_groups = [group for group in resumed.param_groups if group.get("use_muon")]
    assert len(muon_groups) == 1 and len(resumed.param_groups) == 2
    assert (muon_groups[0]["momentum"], muon_groups[0]["ns_steps"], muon_groups[0]["tp_mode"]) == (0.9, 3,
                                                                                                  "duplicated")
    assert all(group["betas"] == (0.8, 0.999) for group in resumed.param_groups)


def test_torch_format_resume_with_regrouped_parameters_says_what_to_do():
    """--muon-no-split-qkv puts the fused QKV weight back with the other matrices: the state, matched by
    position, would land on other parameters."""
    model = _gpt()
    saved = get_megatron_optimizer(OptimizerConfig(optimizer="muon", lr=1e-3), [model])
    resumed = get_megatron_optimizer(OptimizerConfig(optimizer="muon", lr=1e-3, muon_split_qkv=False), [model])
    with pytest.raises(ValueError, match=r"--muon-no-split-qkv.*torch_dist.*--no-load-optim"):
        resumed.load_state_dict(saved.state_dict())
    assert all(group.get("qkv_split") is None for group in resumed.param_groups)


@pytest.mark.parametrize("kwargs,message", [
    (dict(muon_momentum=1.0), "--muon-momentum"),
    (dict(muon_num_ns_steps=0), "--muon-num-ns-steps"),
    (dict(muon_scale_mode="rms"), "--muon-scale-mode"),
    (dict(muon_tp_mode="sharded"), "--muon-tp-mode"),
    (dict(muon_fp32_matmul_prec="highest"), "--muon-fp32-matmul-prec"),
    (dict(muon_extra_scale_factor=0.0), "--muon-extra-scale-factor"),
])
def test_bad_settings_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        OptimizerConfig(optimizer="muon", lr=1e-3, **kwargs)


def test_distributed_optimizer_config_is_accepted():
    config = OptimizerConfig(optimizer="muon", lr=1e-3, use_distributed_optimizer=True)
    assert config.optimizer == "muon" and config.use_distributed_optimizer


def test_muon_groups_refuse_vectors():
    with pytest.raises(ValueError, match="2-D weights only"):
        MuonWithAdamW([{"params": [torch.nn.Parameter(torch.ones(4))], "use_muon": True}], lr=0.1)


# --------------------------------------------------------------------------------------------------------------
# Tensor parallelism on 2 ranks: every rank holds a shard of the same full matrices.


def _muon_group(params, tp_mode, qkv_split=None):
    return {"params": params, "use_muon": True, "momentum": 0.5, "nesterov": True, "ns_steps": 5,
            "scale_mode": "spectral", "extra_scale_factor": 1.0, "tp_mode": tp_mode, "fp32_matmul_prec": "medium",
            "qkv_split": qkv_split}


def _tensor_parallel_steps(tp_mode):
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    rank = parallel_state.get_tensor_model_parallel_rank()
    generator = torch.Generator().manual_seed(3)
    shapes = {"column": ((24, 10), 0, None), "row": ((10, 24), 1, None), "qkv": ((2 * 2 * 16, 12), 0, (8, 4, 4))}
    full = {name: torch.randn(shape, generator=generator) for name, (shape, _, _) in shapes.items()}
    grads = [{name: torch.randn(shape, generator=generator) for name, (shape, _, _) in shapes.items()}
             for _ in range(2)]
    results = {}
    # "full": one rank's whole matrices; "shards": tensor-parallel shards in `tp_mode`; "local": the same shards
    # as matrices of their own.
    for run in ("full", "shards", "local"):
        params, groups = {}, []
        for name, (_, dim, qkv_split) in shapes.items():
            value = full[name] if run == "full" else full[name].chunk(2, dim=dim)[rank]
            params[name] = torch.nn.Parameter(value.clone())
            params[name].tensor_model_parallel, params[name].partition_dim = run == "shards", dim
            groups.append(_muon_group([params[name]], tp_mode, qkv_split))
        optimizer = MuonWithAdamW(groups, lr=0.05, weight_decay=0.1)
        for grad in grads:
            for name, (_, dim, _) in shapes.items():
                params[name].grad = grad[name].clone() if run == "full" else grad[name].chunk(2, dim=dim)[rank].clone()
            optimizer.step()
        results[run] = params
    from_full, from_local = {}, {}
    for name, (_, dim, _) in shapes.items():
        sharded = results["shards"][name].detach()
        from_full[name] = (sharded - results["full"][name].detach().chunk(2, dim=dim)[rank]).abs().max().item()
        from_local[name] = (sharded - results["local"][name].detach()).abs().max().item()
    return from_full, from_local


@pytest.mark.parametrize("tp_mode", ["duplicated", "distributed"])
def test_tensor_parallel_modes_equal_one_rank(tp_mode):
    for from_full, from_local in run_on_ranks(2, _tensor_parallel_steps, tp_mode):
        assert max(from_full.values()) < 1e-6, from_full
        assert min(from_local.values()) > 1e-3, from_local


def test_blockwise_orthogonalizes_each_shard_alone():
    for from_full, from_local in run_on_ranks(2, _tensor_parallel_steps, "blockwise"):
        assert max(from_local.values()) == 0.0, from_local
        assert min(from_full.values()) > 1e-3, from_full


def _host_shards_of_a_cuda_mesh_steps():
    """What --torch-fsdp2-cpu-offload makes on a GPU machine: a "cuda" mesh whose DTensor parameters, gradients
    and momenta keep their local tensors in host memory (on CPU-only torch any move to the mesh's device raises).
    Each rank's row shard of a 5 x 3 weight (3 and 2 rows) takes two steps, Newton-Schulz shared over the ranks
    and not, next to the whole weight stepped as a plain tensor."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    rank, world_size = torch.distributed.get_rank(), torch.distributed.get_world_size()
    generator = torch.Generator().manual_seed(7)
    weight = torch.randn(5, 3, generator=generator)
    grads = [torch.randn(5, 3, generator=generator) for _ in range(2)]

    def steps(param, grad_of, distribute=True):
        optimizer = MuonWithAdamW([_muon_group([param], "blockwise")], lr=0.1, weight_decay=0.1)
        optimizer.distribute_newton_schulz = distribute
        for grad in grads:
            param.grad = grad_of(grad)
            optimizer.step()
        return param.detach()

    whole = steps(torch.nn.Parameter(weight.clone()), lambda grad: grad)
    mesh = DeviceMesh.from_group(torch.distributed.group.WORLD, "cuda", mesh=torch.arange(world_size))
    spec = DTensorSpec(mesh, (Shard(0),), TensorMeta(weight.shape, weight.stride(), weight.dtype))

    def host_shard(full):
        return DTensor(full.chunk(world_size)[rank].clone(), spec, requires_grad=False)

    expected = whole.chunk(world_size)[rank]
    results = {}
    for distribute in (True, False):
        local = steps(torch.nn.Parameter(host_shard(weight)), host_shard, distribute).to_local()
        results[distribute] = (local.device.type, torch.equal(local, expected))
    return results, torch.equal(expected, weight.chunk(world_size)[rank])


def test_steps_host_shards_of_a_cuda_mesh_where_they_live():
    """Muon writes each rank's piece of the update straight into its host shard (bit-equal to stepping the whole
    weight), never building the update on the mesh's device."""
    for results, unchanged in run_on_ranks(2, _host_shards_of_a_cuda_mesh_steps):
        assert results == {True: ("cpu", True), False: ("cpu", True)}
        assert not unchanged


@pytest.mark.gpu
@pytest.mark.parametrize("precision, tolerance", [("high", 1e-5), ("medium", 2e-2), ("low", 5e-2)])
def test_cuda_step_follows_fp32_matmul_precision_and_restores_it(precision, tolerance):
    """On an accelerator `--muon-fp32-matmul-prec` sets Newton-Schulz's fp32 matmul precision (high: full fp32,
    equal to the CPU step; medium: TF32; low: bf16 passes, each within its mantissa's rounding of the update)
    and puts the process's setting back after the step."""
    def one_step(device):
        model = build_toy_model().to(device)
        config = OptimizerConfig(optimizer="muon", lr=0.02, weight_decay=0.0, clip_grad=0.0,
                                 muon_fp32_matmul_prec=precision)
        optimizer = get_megatron_optimizer(config, [model])
        before = {name: param.detach().clone() for name, param in model.named_parameters()}
        inputs, targets = toy_batch(0, 8)
        mse_loss(model, inputs.to(device), targets.to(device)).backward()
        optimizer.step()
        return {name: (param.detach() - before[name]).cpu() for name, param in model.named_parameters()}

    previous = torch.get_float32_matmul_precision()
    expected, updates = one_step(torch.device("cpu")), one_step(torch.device("cuda"))
    assert torch.get_float32_matmul_precision() == previous
    for name, update in updates.items():
        scale = expected[name].abs().max().item()
        torch.testing.assert_close(update, expected[name], atol=tolerance * scale, rtol=0, msg=name)
