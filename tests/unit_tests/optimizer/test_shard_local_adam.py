"""ShardLocalAdamW against torch's AdamW: the same parameters and state, bit for bit, for DTensor parameters
(stepped through their local shards), for DTensors it must not step locally and for plain tensors."""

import pytest
import torch

from megatron.core.optimizer.shard_local_adam import ShardLocalAdamW, steps_on_local_shard
from tests.unit_tests.multiprocess_harness import run_on_ranks

SHAPES = [(7, 3), (5,), (4, 6)]  # uneven over 2 and 3 ranks; the (5,) one leaves a rank with an empty shard at 3
OPTIONS = [dict(weight_decay=0.1), dict(weight_decay=0.0, amsgrad=True), dict(weight_decay=0.05, maximize=True)]


def _values(seed, shape):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _run(optimizer_class, make_param, make_grad, options, steps=3):
    params = [make_param(_values(index, shape)) for index, shape in enumerate(SHAPES)]
    optimizer = optimizer_class(params, lr=0.01, betas=(0.9, 0.95), eps=1e-8, foreach=True, **options)
    for step in range(steps):
        for index, param in enumerate(params):
            param.grad = make_grad(_values(100 * (step + 1) + index, param.shape), param)
        optimizer.step()
    return params, optimizer


def _full(tensor):
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def _compare_dtensor_runs(options, grad_placement):
    """Both optimizers on Shard(0) DTensor parameters; gradients with `grad_placement`."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    placements = {"shard": [Shard(0)], "replicate": [Replicate()]}

    def make_param(values):
        return torch.nn.Parameter(distribute_tensor(values, mesh, [Shard(0)]))

    def make_grad(values, param):
        return distribute_tensor(values, mesh, placements[grad_placement])

    results = []
    for optimizer_class in (torch.optim.AdamW, ShardLocalAdamW):
        params, optimizer = _run(optimizer_class, make_param, make_grad, options)
        local = [steps_on_local_shard(param) for param in params]
        state = [{key: (_full(value), type(value).__name__, getattr(value, "placements", None))
                  for key, value in optimizer.state[param].items()} for param in params]
        results.append(([_full(param.detach()) for param in params], state, local,
                        sorted(optimizer.state_dict()["state"][0])))
    return results


def _assert_same(reference, candidate):
    reference_params, reference_state, _, reference_keys = reference
    params, state, _, keys = candidate
    assert keys == reference_keys
    for expected, actual in zip(reference_params, params):
        assert torch.equal(expected, actual)
    for expected, actual in zip(reference_state, state):
        assert expected.keys() == actual.keys()
        for key in expected:
            assert torch.equal(expected[key][0], actual[key][0]), key
            assert expected[key][1:] == actual[key][1:], key  # same tensor type and placements


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("options", OPTIONS, ids=["weight_decay", "amsgrad", "maximize"])
def test_sharded_dtensor_parameters_step_locally_and_match_torch_adamw(world_size, options):
    for reference, candidate in run_on_ranks(world_size, _compare_dtensor_runs, options, "shard"):
        _assert_same(reference, candidate)
        assert candidate[2] == [True] * len(SHAPES)  # every parameter went through its local shard
        assert candidate[1][0]["exp_avg"][1] == "DTensor"  # state is still a DTensor of the parameter


def test_gradients_of_other_placements_step_as_dtensors_and_match_torch_adamw():
    for reference, candidate in run_on_ranks(2, _compare_dtensor_runs, OPTIONS[0], "replicate"):
        _assert_same(reference, candidate)
        assert candidate[2] == [False] * len(SHAPES)


def _partial_gradient_steps_locally():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    param = torch.nn.Parameter(DTensor.from_local(torch.ones(3), mesh, [Replicate()]))
    param.grad = DTensor.from_local(torch.ones(3), mesh, [Partial()])
    return steps_on_local_shard(param)


def test_partial_gradients_are_not_stepped_locally():
    assert run_on_ranks(2, _partial_gradient_steps_locally) == [False, False]


@pytest.mark.parametrize("options", OPTIONS, ids=["weight_decay", "amsgrad", "maximize"])
def test_plain_tensors_match_torch_adamw(options):
    reference, expected_optimizer = _run(torch.optim.AdamW, torch.nn.Parameter, lambda values, _: values, options)
    params, optimizer = _run(ShardLocalAdamW, torch.nn.Parameter, lambda values, _: values, options)
    for expected, actual in zip(reference, params):
        assert torch.equal(expected, actual)
        assert not steps_on_local_shard(actual)
    for expected, actual in zip(expected_optimizer.state.values(), optimizer.state.values()):
        assert expected.keys() == actual.keys()
        assert all(torch.equal(expected[key], actual[key]) for key in expected)


def test_closure_loss_is_returned_and_state_dict_round_trips():
    param = torch.nn.Parameter(torch.ones(4))
    optimizer = ShardLocalAdamW([param], lr=0.1)

    def closure():
        optimizer.zero_grad()
        loss = (param * torch.arange(4.0)).sum()
        loss.backward()
        return loss

    assert optimizer.step(closure).item() == 6.0  # 0 + 1 + 2 + 3
    reloaded = ShardLocalAdamW([torch.nn.Parameter(param.detach().clone())], lr=0.1)
    reloaded.load_state_dict(optimizer.state_dict())
    assert torch.equal(reloaded.state[reloaded.param_groups[0]["params"][0]]["exp_avg"],
                       optimizer.state[param]["exp_avg"])


def test_differentiable_steps_are_refused_with_what_to_use():
    with pytest.raises(ValueError, match="use torch.optim.AdamW for differentiable=True"):
        ShardLocalAdamW([torch.nn.Parameter(torch.ones(2))], differentiable=True)


def test_sparse_gradients_are_refused_with_the_parameter_shape():
    param = torch.nn.Parameter(torch.ones(2, 2))
    param.grad = torch.ones(2, 2).to_sparse()
    with pytest.raises(RuntimeError, match=r"sparse gradients.*\(2, 2\)"):
        ShardLocalAdamW([param]).step()


@pytest.mark.gpu
@pytest.mark.parametrize("implementation", [dict(fused=True), dict(foreach=True)], ids=["fused", "foreach"])
def test_cuda_parameters_match_torch_adamw(implementation):
    def run(optimizer_class):
        params = [torch.nn.Parameter(_values(index, shape).cuda()) for index, shape in enumerate(SHAPES)]
        optimizer = optimizer_class(params, lr=0.01, weight_decay=0.1, **implementation)
        for step in range(3):
            for index, param in enumerate(params):
                param.grad = _values(100 * (step + 1) + index, param.shape).cuda()
            optimizer.step()
        return params, optimizer

    (reference, expected_optimizer), (params, optimizer) = run(torch.optim.AdamW), run(ShardLocalAdamW)
    for expected, actual in zip(reference, params):
        assert torch.equal(expected, actual)
    for expected, actual in zip(expected_optimizer.state.values(), optimizer.state.values()):
        assert all(torch.equal(expected[key], actual[key]) for key in expected)
        assert expected["step"].device == actual["step"].device
