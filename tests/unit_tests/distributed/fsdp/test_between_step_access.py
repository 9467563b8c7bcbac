"""Reads and writes of the parameters between optimizer steps, as training scripts make them (weight averaging,
EMA, re-initialisation, loading a state dict), equal the same access on an unwrapped one-process model; access
that cannot work raises an error saying what to use instead, never touches released memory.

* zero_dp_strategy 3: `p.add_`, `p.data.copy_`, `p.mul_`, `p.lerp_` (an EMA towards zeros) and
  `model.load_state_dict(...)` between two steps: the next forward and the weights after the next step match.
* zero_dp_strategy 3: after a forward with grad enabled and no backward (an evaluation without `torch.no_grad()`)
  the module shows each released unit's resting Shard(0) DTensors, not full-shape parameters over the released
  buffer (reading those read freed memory, writing them could crash the process); the steps that follow match.
* zero_dp_strategy 3: a parameter object taken before wrapping raises an error naming the parameter, instead of
  reading or writing the released buffer. Run in a subprocess: on a regression it may crash the process.
"""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from tests.unit_tests.distributed.fsdp import fsdp_test_models as models
from tests.unit_tests.multiprocess_harness import run_on_ranks

LR = 0.05
TOLERANCE = 1e-6


def _write(kind, model):
    """The between-step access `kind` on `model` (a wrapped model, or the unwrapped reference)."""
    with torch.no_grad():
        if kind == "load_state_dict":
            model.load_state_dict({name: value * 0.5 for name, value in model.state_dict().items()})
            return
        for param in model.parameters():
            if kind == "add":
                param.add_(0.01)
            elif kind == "add_large":
                param.add_(0.1)
            elif kind == "data_copy":
                param.data.copy_(param.data * 0.5 + 0.125)
            elif kind == "mul":
                param.mul_(0.5)
            elif kind == "ema":
                param.lerp_(torch.zeros_like(param), 0.25)


WRITES = ("add", "data_copy", "mul", "ema", "load_state_dict")


def _run(model, optimizer, kind, local):
    """One step, the access, a no-grad forward on the full batch, a second step; the output and full weights."""
    batches = models.make_batches(2)
    for step, (inputs, target) in enumerate(batches):
        optimizer.zero_grad()
        models.loss_fn(model(local(inputs)), local(target)).backward()
        optimizer.step()
        if step == 0:
            _write(kind, model)
            with torch.no_grad():
                output = model(batches[1][0]).clone()
    return output


def _reference(kind):
    model = models.make_model(0)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)
    output = _run(model, optimizer, kind, lambda tensor: tensor)
    return output, {name: p.detach().clone() for name, p in model.named_parameters(remove_duplicate=False)}


def _sharded(strategy, eval_forward_with_grad=False):
    import torch.distributed as dist

    import megatron_fsdp
    from torch.distributed.tensor import DTensor

    rank, world = dist.get_rank(), dist.get_world_size()
    results = {}
    for kind in WRITES:
        module = models.make_model(0)
        optimizer = torch.optim.SGD([p for p in module.parameters() if p.requires_grad], lr=LR)
        model, optimizer = megatron_fsdp.fully_shard(module, optimizer, fsdp_unit_modules=[models.Block],
                                                     zero_dp_strategy=strategy)
        if eval_forward_with_grad:  # an evaluation forward under grad, never followed by a backward
            model(models.make_batches(1)[0][0])
            # Each parameter the module shows is a resting DTensor or holds its weights (the root groups stay
            # gathered for a backward): none views a released buffer. Only metadata is read here.
            results.setdefault("no_released_storage", []).append(all(
                isinstance(p, DTensor) or p.untyped_storage().nbytes() >= (p.storage_offset() + p.numel())
                * p.element_size() for p in model.parameters()))
            if not results["no_released_storage"][-1]:
                return results  # touching those parameters could crash this rank
        output = _run(model, optimizer, kind, lambda tensor: models.local_slice(tensor, rank, world))
        results[kind] = (output, models.full_params(model))
    return results


def _assert_match_reference(results_per_rank):
    for rank, results in enumerate(results_per_rank):
        assert all(results.pop("no_released_storage", [True])), rank
        assert set(results) == set(WRITES), rank
        for kind, (output, params) in results.items():
            expected_output, expected_params = _reference(kind)
            torch.testing.assert_close(output, expected_output, rtol=0, atol=TOLERANCE, msg=f"{kind} output")
            assert set(params) == set(expected_params), kind
            for name, value in expected_params.items():
                torch.testing.assert_close(params[name], value, rtol=0, atol=TOLERANCE, msg=f"{kind} {name}")


@pytest.mark.parametrize("world_size", [2])
def test_writes_between_steps_match_an_unwrapped_model(world_size):
    _assert_match_reference(run_on_ranks(world_size, _sharded, 3))


@pytest.mark.parametrize("world_size", [2])
def test_forward_without_backward_shows_no_released_parameters(world_size):
    _assert_match_reference(run_on_ranks(world_size, _sharded, 3, True))


_STALE_REFERENCE_SCRIPT = textwrap.dedent("""
    import sys, tempfile
    import torch, torch.distributed as dist
    dist.init_process_group("gloo", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)
    import megatron_fsdp
    from tests.unit_tests.distributed.fsdp import fsdp_test_models as models

    module = models.make_model(0)
    before_wrapping = dict(module.named_parameters())
    model = megatron_fsdp.fully_shard_model(module, fsdp_unit_modules=[models.Block], zero_dp_strategy=3)
    stale = before_wrapping["blocks.1.fc1.weight"]
    print("shape", tuple(stale.shape), "requires_grad", stale.requires_grad, flush=True)
    for access in (lambda: stale.add_(1), lambda: stale.data.copy_(torch.ones(stale.shape)),
                   lambda: torch.nn.init.normal_(stale), lambda: float(stale.sum()),
                   lambda: torch.nn.utils.parameters_to_vector([stale])):
        try:
            with torch.no_grad():
                access()
            print("no error", flush=True)
        except RuntimeError as error:
            message = str(error)
            print("error", message.startswith("parameter 'blocks.1.fc1.weight' of a Megatron-FSDP model"),
                  "model.parameters()" in message and "gathered_parameters()" in message, flush=True)
    with model.gathered_parameters():
        print("gathered sum", float(stale.sum()), flush=True)
    dist.destroy_process_group()
""")


def test_parameters_taken_before_wrapping_raise_instead_of_touching_released_memory(tmp_path):
    repo_root = str(Path(__file__).resolve().parents[4])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([repo_root, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", _STALE_REFERENCE_SCRIPT], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    weight = models.make_model(0).blocks[1].fc1.weight
    assert lines[0] == f"shape {tuple(weight.shape)} requires_grad True", lines
    assert lines[1:6] == ["error True True"] * 5, lines
    expected = weight.sum().item()
    assert lines[6].startswith("gathered sum ") and float(lines[6].split()[-1]) == pytest.approx(expected, abs=1e-5)


# bf16 compute weights over fp32 main weights: a write to the parameters between steps must reach the main
# weights, which the next step would otherwise install over it (the write lost without an error).
BF16_WRITES = ("add_large", "data_copy", "ema")
# bf16 compute against the fp32 reference: off by up to 0.007 (bf16 rounding of the weights and activations); a
# lost write is off by 0.1 to 0.4.
BF16_ATOL, BF16_RTOL = 1e-2, 2e-2


def _steps_around_write(model, optimizer, kind, local):
    for step, (inputs, target) in enumerate(models.make_batches(2)):
        optimizer.zero_grad()
        models.loss_fn(model(local(inputs)), local(target)).backward()
        optimizer.step()
        if step == 0:
            _write(kind, model)


def _bf16_reference(kind):
    model = models.make_model(0)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)
    _steps_around_write(model, optimizer, kind, lambda tensor: tensor)
    return {name: value.detach().clone() for name, value in model.state_dict().items()}


def _bf16_sharded(strategies, overlap_param_gather):
    """{(strategy, kind): full weights after step, write, step} or the error the write raised."""
    import torch.distributed as dist

    import megatron_fsdp

    rank, world = dist.get_rank(), dist.get_world_size()
    local = lambda tensor: models.local_slice(tensor, rank, world).to(torch.bfloat16)  # noqa: E731
    results = {}
    for strategy in strategies:
        for kind in BF16_WRITES:
            module = models.make_model(0, dtype=torch.bfloat16)
            optimizer = torch.optim.SGD([p for p in module.parameters() if p.requires_grad], lr=LR)
            model, optimizer = megatron_fsdp.fully_shard(module, optimizer, fsdp_unit_modules=[models.Block],
                                                         zero_dp_strategy=strategy,
                                                         overlap_param_gather=overlap_param_gather)
            try:
                _steps_around_write(model, optimizer, kind, local)
                results[(strategy, kind)] = models.full_params(model)
            except RuntimeError as error:
                results[(strategy, kind)] = str(error)
    return results


@pytest.mark.parametrize("world_size", [2])
def test_bf16_writes_between_steps_reach_the_fp32_main_weights(world_size):
    """zero_dp_strategy 3, and 1 without overlapped parameter gathers: the weights after the next step are the
    unwrapped model's, within bf16 rounding."""
    references = {kind: _bf16_reference(kind) for kind in BF16_WRITES}
    for rank, results in enumerate(run_on_ranks(world_size, _bf16_sharded, (1, 3), False)):
        assert set(results) == {(strategy, kind) for strategy in (1, 3) for kind in BF16_WRITES}, rank
        for (strategy, kind), params in results.items():
            assert not isinstance(params, str), (rank, strategy, kind, params)
            expected = references[kind]
            for name, value in params.items():
                torch.testing.assert_close(value, expected[name], rtol=BF16_RTOL, atol=BF16_ATOL,
                                           msg=f"rank {rank} strategy {strategy} {kind} {name}")


@pytest.mark.parametrize("world_size", [2])
def test_writes_racing_the_post_step_gather_raise(world_size):
    """zero_dp_strategy 1/2 with overlap_param_gather: the all-gather in flight after a step would overwrite a
    write to the parameters, through them (`p.add_`, `p.lerp_`) or through `p.data`; the next forward or step
    raises, naming what to use instead."""
    for results in run_on_ranks(world_size, _bf16_sharded, (2,), True):
        assert set(results) == {(2, kind) for kind in BF16_WRITES}
        for key, error in results.items():
            assert isinstance(error, str) and "post-step all-gather" in error and "model.apply(fn)" in error, key
