"""Between steps, strategy-3 parameters are placeholders whose reads raise a named error (not freed memory), and
`gathered_parameters()` shows the real, current weights."""

import pickle

import pytest
import torch

from tests.unit_tests.distributed.fsdp import fsdp_test_models as models
from tests.unit_tests.multiprocess_harness import run_on_ranks

NUM_STEPS = 2


def _read_error(tensor):
    try:
        tensor.sum()
    except RuntimeError as error:
        return str(error)
    return None


def _resting_behaviour():
    import megatron_fsdp
    from megatron_fsdp.resting_parameters import ReleasedParameter

    results = {}
    unwrapped = models.make_model(0)
    expected_numel = sum(p.numel() for p in unwrapped.parameters())
    model = megatron_fsdp.fully_shard_model(unwrapped, fsdp_unit_modules=[models.Block], zero_dp_strategy=3)
    # Built after wrapping, from the placeholders the module shows now.
    optimizer = megatron_fsdp.fully_shard_optimizer(
        models.make_optimizer([p for p in model.module.parameters() if p.requires_grad]))

    weight = model.module.blocks[1].fc1.weight
    results["placeholder_after_wrap"] = isinstance(weight, ReleasedParameter)
    results["error_after_wrap"] = _read_error(weight)
    results["numel"] = sum(p.numel() for p in model.module.parameters()) == expected_numel
    results["tied_is_one_placeholder"] = model.module.inp.weight is model.module.blocks[0].fc2.weight
    results["repr"] = repr(weight)
    try:
        pickle.dumps(weight)
        results["pickle_error"] = None
    except RuntimeError as error:
        results["pickle_error"] = str(error)

    results["losses"] = models.train_sharded(model, optimizer, NUM_STEPS)
    # train_sharded ends with a no-grad forward: every group is at rest again.
    results["all_placeholders_after_eval"] = all(isinstance(p, ReleasedParameter) for p in model.module.parameters())
    with model.gathered_parameters() as module:
        results["real_inside"] = not any(isinstance(p, ReleasedParameter) for p in module.parameters())
        results["gathered"] = {name: p.detach().clone() for name, p in module.named_parameters(remove_duplicate=False)}
    results["placeholders_after_exit"] = all(isinstance(p, ReleasedParameter) for p in model.module.parameters())
    results["state_dict"] = models.full_params(model)
    return results


def _strategy1_keeps_real_parameters():
    import megatron_fsdp
    from megatron_fsdp.resting_parameters import ReleasedParameter

    module = models.make_model(0)
    optimizer = models.make_optimizer([p for p in module.parameters() if p.requires_grad])
    model, _ = megatron_fsdp.fully_shard(module, optimizer, fsdp_unit_modules=[models.Block], zero_dp_strategy=1)
    return not any(isinstance(p, ReleasedParameter) for p in model.module.parameters())


@pytest.mark.parametrize("world_size", [2])
def test_strategy3_parameters_at_rest_raise_named_errors(world_size):
    reference_losses, reference_params = models.reference_losses(NUM_STEPS)
    for rank_result in run_on_ranks(world_size, _resting_behaviour):
        assert rank_result["placeholder_after_wrap"]
        error = rank_result["error_after_wrap"]
        assert error is not None and "blocks.1.fc1.weight" in error and "state_dict" in error
        assert "gathered_parameters" in error
        assert rank_result["numel"] and rank_result["tied_is_one_placeholder"]
        assert "blocks.1.fc1.weight" in rank_result["repr"]
        assert rank_result["pickle_error"] is not None and "state_dict" in rank_result["pickle_error"]
        assert rank_result["losses"] == pytest.approx(reference_losses, abs=1e-5)
        assert rank_result["all_placeholders_after_eval"] and rank_result["placeholders_after_exit"]
        assert rank_result["real_inside"]
        gathered = rank_result["gathered"]
        assert set(gathered) == set(reference_params)
        for name, value in reference_params.items():
            torch.testing.assert_close(gathered[name], value, rtol=0, atol=1e-5, msg=name)
            torch.testing.assert_close(gathered[name], rank_result["state_dict"][name], rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("world_size", [2])
def test_other_strategies_keep_real_parameters(world_size):
    assert all(run_on_ranks(world_size, _strategy1_keeps_real_parameters))
