"""`torch.compile` with Megatron-FSDP, in the orders a torch training loop applies it, on 2 gloo ranks in fp32.

* Compiled FSDP units: each block compiled with `fullgraph=True` before wrapping (`torch.compile(block)`
  assigned back into the model, as torchtitan does, with or without `checkpoint_wrapper` inside), or in place
  after wrapping (`block.compile()`), under every `zero_dp_strategy`, with `torch.utils.checkpoint` around the
  blocks too: losses and gradients equal the eager run's bit for bit. The gather / release / reduce hooks run
  outside the compiled graphs (before, dynamo traced into them and `fullgraph=True` failed). A unit inside a
  reentrant `checkpoint_wrapper` (not compiled) has its hooks on the wrapper too, and trains as without it.
* The whole wrapped model compiled (`torch.compile(model)`): the hooks are graph breaks, the losses and
  gradients are the eager ones, and no frame of the package itself is compiled (before, dynamo traced the
  gather code and recompiled it for each group). With `fullgraph=True` the error says to compile the units.

The `aot_eager` backend runs the traced graphs op by op with the eager kernels, so fp32 results are bitwise equal
to eager (inductor's fused kernels may round differently, about 1e-7 relative).
"""

import pytest
import torch

from tests.unit_tests.distributed.fsdp import fsdp_test_models as models
from tests.unit_tests.multiprocess_harness import run_on_ranks

STEPS = 2
BACKEND = "aot_eager"


def _wrap(module, strategy):
    import megatron_fsdp

    optimizer = models.make_optimizer([p for p in module.parameters() if p.requires_grad])
    return megatron_fsdp.fully_shard(module, optimizer, fsdp_unit_modules=[models.Block], zero_dp_strategy=strategy)


def _build(strategy, how, checkpoint_blocks):
    """(the model to call, the MegatronFSDP wrapper, its optimizer), compiled as `how` says."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper

    module = models.make_model(0, checkpoint_blocks=checkpoint_blocks)
    if how == "blocks_before_wrap":
        for index, block in enumerate(module.blocks):
            module.blocks[index] = torch.compile(block, backend=BACKEND, fullgraph=True)
    elif how == "checkpointed_blocks_before_wrap":
        for index, block in enumerate(module.blocks):
            module.blocks[index] = torch.compile(checkpoint_wrapper(block), backend=BACKEND, fullgraph=True)
    elif how == "reentrant_checkpoint_wrapper":  # not compiled: the unit's hooks move to the wrapper all the same
        for index, block in enumerate(module.blocks):
            module.blocks[index] = checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.REENTRANT)
    model, optimizer = _wrap(module, strategy)
    if how == "blocks_after_wrap":
        for block in model.module.blocks:
            block.compile(backend=BACKEND, fullgraph=True)
    if how == "wrapped_model":
        return torch.compile(model, backend=BACKEND), model, optimizer
    return model, model, optimizer


def _train(strategy, how, checkpoint_blocks=False):
    """Global mean losses and the full gradients (by parameter name) of each step."""
    import torch.distributed as dist

    called, model, optimizer = _build(strategy, how, checkpoint_blocks)
    rank, world = dist.get_rank(), dist.get_world_size()
    losses, grads = [], []
    for inputs, target in models.make_batches(STEPS):
        optimizer.zero_grad()
        loss = models.loss_fn(called(models.local_slice(inputs, rank, world)), models.local_slice(target, rank, world))
        loss.backward()
        model.finish_grad_sync()
        losses.append(models.global_mean(loss.item()))
        grads.append({name.replace("_orig_mod.", "").replace("_checkpoint_wrapped_module.", ""): p.grad.full_tensor()
                      for name, p in model.module.named_parameters() if p.grad is not None})
        optimizer.step()
    return losses, grads


def _compiled_matches_eager(how, checkpoint_blocks):
    """Per strategy: (eager losses, compiled losses, names of gradients that differ, compiled gradient names)."""
    results = {}
    for strategy in (0, 1, 2, 3):
        eager_losses, eager_grads = _train(strategy, "eager", checkpoint_blocks)
        losses, grads = _train(strategy, how, checkpoint_blocks)
        differing = [name for step in range(STEPS) for name in eager_grads[step]
                     if not torch.equal(grads[step].get(name, torch.empty(0)), eager_grads[step][name])]
        results[strategy] = (eager_losses, losses, differing, sorted(grads[0]), sorted(eager_grads[0]))
    return results


@pytest.mark.parametrize("world_size", [2])
@pytest.mark.parametrize("how,checkpoint_blocks", [("blocks_before_wrap", False), ("blocks_after_wrap", True),
                                                   ("checkpointed_blocks_before_wrap", False),
                                                   ("reentrant_checkpoint_wrapper", False)])
def test_units_train_bitwise_like_eager(world_size, how, checkpoint_blocks):
    for rank_result in run_on_ranks(world_size, _compiled_matches_eager, how, checkpoint_blocks):
        for strategy, (eager_losses, losses, differing, names, eager_names) in rank_result.items():
            assert losses == eager_losses, (strategy, losses, eager_losses)
            assert names == eager_names and len(names) > 0, (strategy, names, eager_names)
            assert differing == [], (strategy, differing)


def _whole_model_compile():
    """Strategy 3, the wrapped model compiled: (eager and compiled losses, differing gradients, the package's
    code that dynamo compiled, the error of fullgraph=True)."""
    import torch._dynamo

    eager_losses, eager_grads = _train(3, "eager")
    compiled_files = set()

    def record(code, new_code):
        # the wrapper's forward is the entry point, compiled in pieces around the root hooks; nothing else of
        # the package may be (its hooks and collectives run eagerly)
        name = f"{code.co_filename.rpartition('/')[2]}:{code.co_name}"
        if "megatron_fsdp" in code.co_filename and not name.startswith("megatron_fsdp.py:"):
            compiled_files.add(name)
        elif name == "megatron_fsdp.py:forward":
            compiled_files.add("the wrapper's forward")

    torch._dynamo.reset()
    with torch._dynamo.config.patch(recompile_limit=64):
        handle = torch._dynamo.convert_frame.register_bytecode_hook(record)
        try:
            losses, grads = _train(3, "wrapped_model")
        finally:
            handle.remove()
    differing = [name for step in range(STEPS) for name in eager_grads[step]
                 if not torch.equal(grads[step][name], eager_grads[step][name])]
    model, _ = _wrap(models.make_model(0), 3)
    error = None
    torch._dynamo.reset()  # otherwise the frames compiled above, with graph breaks, are reused
    try:
        torch.compile(model, backend=BACKEND, fullgraph=True)(torch.zeros(6, models.IN_FEATURES))
    except Exception as exc:  # dynamo's Unsupported
        error = str(exc)
    torch._dynamo.reset()
    return eager_losses, losses, differing, sorted(compiled_files), error


@pytest.mark.parametrize("world_size", [2])
def test_whole_wrapped_model_compiles_around_the_hooks(world_size):
    for eager_losses, losses, differing, compiled_files, error in run_on_ranks(world_size, _whole_model_compile):
        assert losses == eager_losses and differing == [], (losses, eager_losses, differing)
        assert compiled_files == ["the wrapper's forward"], compiled_files
        assert error is not None and "compile each FSDP unit" in error, error
