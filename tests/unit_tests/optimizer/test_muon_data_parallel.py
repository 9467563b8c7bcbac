"""`--optimizer muon` under every data-parallel wrapper: the distributed optimizer, Megatron-FSDP (ZeRO-1 and
ZeRO-3) and FSDP2 shard the weight matrices over data parallel, Muon assembles them for Newton-Schulz, and an fp32
GPT trains to the losses of Megatron DDP + Muon (DP 2 and DP 3, and TP 2 x DP 2), its momentum included."""

import functools
import os

import pytest
import torch.distributed as dist

from tests.unit_tests.multiprocess_harness import run_on_ranks

STEPS = 4
WRAPPER_FLAGS = {
    "ddp": "",
    "distopt": "--use-distributed-optimizer",
    "mfsdp_zero1": "--use-megatron-fsdp --data-parallel-sharding-strategy optim",
    "mfsdp_zero3": "--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params",
    "fsdp2": "--use-torch-fsdp2",
}
# fp32 on CPU: the wrappers reduce gradients in other orders (about 1e-7 apart); Newton-Schulz sees the same
# assembled matrices, so the losses stay this close.
TOLERANCE = 1e-6


def _gpt(tensor_parallel_size):
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tensor_parallel_size)
    tensor_parallel.model_parallel_cuda_manual_seed(7)
    # Two query groups: the fused QKV weight is split into Q, K and V for Newton-Schulz.
    config = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                               hidden_dropout=0.0, attention_dropout=0.0, init_seed=7,
                               tensor_model_parallel_size=tensor_parallel_size)
    return GPTModel(config, vocab_size=64, max_sequence_length=16, share_embeddings_and_output_weights=False)


def _muon_losses(wrapper, tensor_parallel_size=1, tp_mode="blockwise", checkpoint=None):
    """The mean loss before each of STEPS steps and after the last one. `checkpoint=(directory, action, step)`:
    "save" the model and optimizer (torch_dist's logical format) before `step`; "load" them, or the model alone
    ("load_weights"), and start at `step` (the losses before it are None)."""
    from megatron.core.distributed import wrap_data_parallel
    from megatron.core.optimizer import MuonWithAdamW, OptimizerConfig, get_megatron_optimizer
    from megatron.training.arguments import parse_args, validate_args
    from megatron.training.model_config import ddp_config_from_args
    from tests.unit_tests.distributed.precision_gpt import gpt_batch, gpt_loss

    flags = ("--num-layers 1 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --micro-batch-size 2 "
             f"--train-iters 10 --lr 1e-3 --mock-data --vocab-size 64 --untie-embeddings-and-output-weights "
             f"--optimizer muon --tensor-model-parallel-size {tensor_parallel_size} " + WRAPPER_FLAGS[wrapper])
    os.environ.update({"WORLD_SIZE": str(dist.get_world_size()), "RANK": str(dist.get_rank())})
    args = validate_args(parse_args(args=flags.split()))
    model = _gpt(tensor_parallel_size)
    chunk = wrap_data_parallel(model.config, ddp_config_from_args(args), model)
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="muon", lr=0.02, weight_decay=0.1, clip_grad=1.0, muon_momentum=0.9,
                        muon_use_nesterov=True, muon_tp_mode=tp_mode,
                        use_distributed_optimizer=args.use_distributed_optimizer), [chunk])
    torch_optimizer = getattr(optimizer.optimizer, "optimizer", optimizer.optimizer)
    assert isinstance(torch_optimizer, MuonWithAdamW)
    losses = []
    for step in range(STEPS + 1):
        if checkpoint is not None and checkpoint[1] != "save" and step < checkpoint[2]:
            losses.append(None)
            continue
        if checkpoint is not None and step == checkpoint[2]:
            _save_or_load(chunk, optimizer, *checkpoint[:2])
        optimizer.zero_grad()
        if hasattr(chunk, "zero_grad_buffer"):
            chunk.zero_grad_buffer()
        loss = gpt_loss(chunk, gpt_batch(step))
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / dist.get_world_size())
        if step == STEPS:
            break
        loss.backward()
        chunk.finish_grad_sync()
        success, _, _ = optimizer.step()
        assert success
    return losses


def _save_or_load(chunk, optimizer, directory, action):
    from megatron.core.dist_checkpointing import serialization, wrappers

    if action == "save":
        state = wrappers.model_state([chunk], for_saving=True)
        state.update(wrappers.optimizer_state_to_save(optimizer, [chunk]))
        assert any(key.endswith(".weight.momentum_buffer") for key in state), sorted(state)
        serialization.save(state, directory)
        return
    metadata = serialization.read_metadata(directory)
    saved_keys = list(metadata.state_dict_metadata)
    model_targets, finish_model = wrappers.model_load_targets([chunk])
    serialization.load(model_targets, directory, metadata=metadata)
    finish_model(set(model_targets))
    optimizer.reload_model_params()
    if action == "load_weights":
        return
    targets, install = wrappers.optimizer_load_targets(optimizer, [chunk], saved_keys)
    targets.update({key: None for key in ("optimizer.step", "optimizer.param_groups") if key in saved_keys})
    serialization.load(targets, directory, metadata=metadata)
    install(targets)


@functools.lru_cache(maxsize=None)
def _ddp_losses(world_size, tensor_parallel_size, tp_mode):
    losses = run_on_ranks(world_size, _muon_losses, "ddp", tensor_parallel_size, tp_mode)[0]
    # The steps moved the model far more than the tolerance.
    assert abs(losses[-1] - losses[0]) > 1e4 * TOLERANCE, losses
    return losses


def _assert_agrees_with_ddp(world_size, wrapper, tensor_parallel_size=1, tp_mode="blockwise"):
    reference = _ddp_losses(world_size, tensor_parallel_size, tp_mode)
    losses = run_on_ranks(world_size, _muon_losses, wrapper, tensor_parallel_size, tp_mode)[0]
    differences = [abs(value - expected) for value, expected in zip(losses, reference, strict=True)]
    assert max(differences) <= TOLERANCE, (wrapper, losses, reference)


@pytest.mark.parametrize("wrapper", ["distopt", "mfsdp_zero1", "mfsdp_zero3", "fsdp2"])
def test_sharded_wrapper_trains_as_ddp_on_two_ranks(wrapper):
    _assert_agrees_with_ddp(2, wrapper)


@pytest.mark.parametrize("wrapper", ["distopt", "mfsdp_zero3", "fsdp2"])
def test_sharded_wrapper_trains_as_ddp_on_three_ranks(wrapper):
    """Three ranks split the matrices unevenly (trailing ranks hold fewer rows or flat elements)."""
    _assert_agrees_with_ddp(3, wrapper)


@pytest.mark.parametrize("wrapper,tp_mode", [("distopt", "blockwise"), ("mfsdp_zero3", "duplicated"),
                                             ("fsdp2", "blockwise")])
def test_sharded_wrapper_trains_as_ddp_with_tensor_parallelism(wrapper, tp_mode):
    _assert_agrees_with_ddp(4, wrapper, tensor_parallel_size=2, tp_mode=tp_mode)


@pytest.mark.parametrize("saved_by,loaded_by", [("distopt", "mfsdp_zero3"), ("mfsdp_zero3", "fsdp2"),
                                                ("fsdp2", "distopt")])
def test_checkpoint_moves_between_wrappers(tmp_path, saved_by, loaded_by):
    """Momentum saved under one wrapper resumes under another exactly as the uninterrupted run continues."""
    directory = str(tmp_path / "checkpoint")
    uninterrupted = run_on_ranks(2, _muon_losses, saved_by, 1, "blockwise", (directory, "save", 2))[0]
    resumed = run_on_ranks(2, _muon_losses, loaded_by, 1, "blockwise", (directory, "load", 2))[0]
    differences = [abs(value - expected) for value, expected in zip(resumed[2:], uninterrupted[2:], strict=True)]
    assert max(differences) <= TOLERANCE, (resumed, uninterrupted)
    # Without the saved momentum (and Adam moments) the resumed run moves elsewhere: the check can tell.
    weights_only = run_on_ranks(2, _muon_losses, loaded_by, 1, "blockwise", (directory, "load_weights", 2))[0]
    assert weights_only[2] == pytest.approx(uninterrupted[2], abs=TOLERANCE)
    assert abs(weights_only[-1] - uninterrupted[-1]) > 1e3 * TOLERANCE, (weights_only, uninterrupted)
