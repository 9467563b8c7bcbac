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
    # Two optimizer instances (dp_outer) of two shard ranks: HSDP replicates over the outer ranks, HFSDP splits the
    # main weights over them too (each matrix in pieces over the shard and the outer group).
    "mfsdp_hsdp": "--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params "
                  "--num-distributed-optimizer-instances 2",
    "mfsdp_hfsdp": "--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params "
                   "--num-distributed-optimizer-instances 2 --outer-dp-sharding-strategy optim",
    "distopt_instances": "--use-distributed-optimizer --num-distributed-optimizer-instances 2",
}
# fp32 on CPU: the wrappers reduce gradients in other orders (about 1e-7 apart); Newton-Schulz sees the same
# assembled matrices, so the losses stay this close.
TOLERANCE = 1e-6


def _gpt(tensor_parallel_size, optimizer_instances=1):
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tensor_parallel_size,
                                             num_distributed_optimizer_instances=optimizer_instances)
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
    from tests.unit_tests.distributed.precision_gpt import gpt_batch, gpt_loss

    chunk, optimizer = _wrapped_gpt_and_muon(wrapper, tensor_parallel_size, tp_mode)
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


def _wrapped_gpt_and_muon(wrapper, tensor_parallel_size, tp_mode):
    from megatron.core.distributed import wrap_data_parallel
    from megatron.core.optimizer import MuonWithAdamW, OptimizerConfig, get_megatron_optimizer
    from megatron.training.arguments import parse_args, validate_args
    from megatron.training.model_config import ddp_config_from_args

    flags = ("--num-layers 1 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --micro-batch-size 2 "
             f"--train-iters 10 --lr 1e-3 --mock-data --vocab-size 64 --untie-embeddings-and-output-weights "
             f"--optimizer muon --tensor-model-parallel-size {tensor_parallel_size} " + WRAPPER_FLAGS[wrapper])
    os.environ.update({"WORLD_SIZE": str(dist.get_world_size()), "RANK": str(dist.get_rank())})
    args = validate_args(parse_args(args=flags.split()))
    model = _gpt(tensor_parallel_size, args.num_distributed_optimizer_instances)
    chunk = wrap_data_parallel(model.config, ddp_config_from_args(args), model)
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="muon", lr=0.02, weight_decay=0.1, clip_grad=1.0, muon_momentum=0.9,
                        muon_use_nesterov=True, muon_tp_mode=tp_mode,
                        use_distributed_optimizer=args.use_distributed_optimizer), [chunk])
    torch_optimizer = getattr(optimizer.optimizer, "optimizer", optimizer.optimizer)
    assert isinstance(torch_optimizer, MuonWithAdamW)
    return chunk, optimizer


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


@pytest.mark.parametrize("wrapper", ["mfsdp_hsdp", "mfsdp_hfsdp", "distopt_instances"])
def test_hybrid_sharded_wrapper_trains_as_ddp_on_four_ranks(wrapper):
    """Megatron-FSDP's HSDP and HFSDP and the distributed optimizer with two instances (Newton-Schulz shared over
    the outer ranks too)."""
    _assert_agrees_with_ddp(4, wrapper)


def _newton_schulz_calls(wrapper):
    """How many matrices this rank orthogonalizes in one Muon step of `wrapper`."""
    from megatron.core.optimizer import muon
    from tests.unit_tests.distributed.precision_gpt import gpt_batch, gpt_loss

    chunk, optimizer = _wrapped_gpt_and_muon(wrapper, 1, "blockwise")
    calls = []
    original = muon.newton_schulz
    muon.newton_schulz = lambda matrix, *args, **kwargs: calls.append(matrix.shape) or original(matrix, *args,
                                                                                                **kwargs)
    try:
        gpt_loss(chunk, gpt_batch(0)).backward()
        chunk.finish_grad_sync()
        assert optimizer.step()[0]
    finally:
        muon.newton_schulz = original
    return len(calls)


@pytest.mark.parametrize("wrapper", ["mfsdp_hsdp", "mfsdp_hfsdp", "distopt_instances"])
def test_hybrid_layouts_orthogonalize_each_matrix_once(wrapper):
    """Over all four ranks, each matrix is orthogonalized once a step, as under DDP: the replicas of HSDP and of
    the distributed optimizer's instances share the work instead of each repeating it."""
    ddp = run_on_ranks(4, _newton_schulz_calls, "ddp")
    hybrid = run_on_ranks(4, _newton_schulz_calls, wrapper)
    assert min(hybrid) > 0 and sum(hybrid) == sum(ddp) > 4, (hybrid, ddp)


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


def _tp_modes_after(wrapper, tp_mode, directory, action):
    """The `tp_mode` of each Muon group of a `wrapper` run built with `tp_mode` after it saves or loads."""
    chunk, optimizer = _wrapped_gpt_and_muon(wrapper, 1, tp_mode)
    _save_or_load(chunk, optimizer, directory, action)
    return [group["tp_mode"] for group in optimizer.param_groups if group.get("use_muon")]


@pytest.mark.parametrize("loaded_by", ["mfsdp_zero3", "distopt"])
def test_resumed_run_keeps_its_muon_tp_mode(tmp_path, loaded_by):
    """A run resumed with another --muon-tp-mode (as when the TP size grows) steps with its own, not the saved."""
    directory = str(tmp_path / "checkpoint")
    assert run_on_ranks(2, _tp_modes_after, "mfsdp_zero3", "blockwise", directory, "save")[0] == ["blockwise"] * 2
    assert run_on_ranks(2, _tp_modes_after, loaded_by, "duplicated", directory, "load")[0] == ["duplicated"] * 2


# --------------------------------------------------------------------------------------------------------------
# Newton-Schulz shared out over data parallel (muon_sharing.py): each rank orthogonalizes a share of the matrices.

SHARED_SHAPES = [(24, 10), (10, 24), (16, 16), (7, 4), (12, 12)]
# Rank 0 holds elements [0, cut) of each flattened matrix and rank 1 the rest: uneven, and empty on either side.
PIECE_CUTS = [100, 240, 0, 13, 77]
# Over a 2 x 2 grid: the four ranges between these cuts, uneven and some empty.
GRID_CUTS = [(30, 30, 200), (0, 100, 240), (0, 0, 0), (5, 28, 28), (144, 144, 144)]
# The ranks each layout runs on: 2-D layouts on a (outer, inner) = 2 x 2 mesh of 4 ranks (world rank = 2 outer +
# inner): "grid pieces" (flat pieces over the inner and the outer group, as HFSDP's), "replicated pieces" (flat
# pieces over the inner group, alike over the outer one, as HSDP's) and "replicated rows" (DTensor rows over the
# inner dimension, replicated over the outer one: FSDP2's HSDP); "columns" (a DTensor sharded by columns) is not
# shared.
LAYOUT_RANKS = {"replicated": 2, "pieces": 2, "rows": 2, "columns": 2, "grid pieces": 4, "replicated pieces": 4,
                "replicated rows": 4}


def _piece_bounds(layout, index, shape, inner, outer):
    """(start, end) of the flat piece of matrix `index` at (inner, outer) for the flat-piece layouts."""
    numel = shape[0] * shape[1]
    if layout == "grid pieces":  # the outer rank varies slowest, unlike the groups' order (inner, outer)
        cuts = (0,) + GRID_CUTS[index] + (numel,)
        return cuts[2 * outer + inner], cuts[2 * outer + inner + 1]
    cut = PIECE_CUTS[index]
    return (0, cut) if inner == 0 else (cut, numel)


def _shared_newton_schulz_steps(layout, distribute):
    """(whole matrices after two Muon steps, newton_schulz calls on this rank, Muon's startup warnings) with the
    matrices of SHARED_SHAPES held on LAYOUT_RANKS[layout] ranks as `layout`: "replicated" (DDP), "pieces" (flat,
    as the distributed optimizer and Megatron-FSDP hold them), "rows" (DTensors sharded by rows, as FSDP2 holds
    them) or one of the others of LAYOUT_RANKS."""
    import logging

    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from megatron.core import parallel_state
    from megatron.core.optimizer import muon

    parallel_state.initialize_model_parallel()
    rank = dist.get_rank()
    grid = LAYOUT_RANKS[layout] == 4
    mesh = init_device_mesh("cpu", (2, 2) if grid else (2,), mesh_dim_names=("outer", "inner") if grid else None)
    inner, outer = (mesh.get_local_rank("inner"), mesh.get_local_rank("outer")) if grid else (rank, 0)
    placements = {"rows": [Shard(0)], "columns": [Shard(1)], "replicated rows": [Replicate(), Shard(0)]}
    piece_groups = {"pieces": [parallel_state.get_data_parallel_group()],
                    "grid pieces": [mesh.get_group("inner"), mesh.get_group("outer")] if grid else None,
                    "replicated pieces": [mesh.get_group("inner")] if grid else None}
    generator = torch.Generator().manual_seed(5)
    weights = [torch.randn(shape, generator=generator) for shape in SHARED_SHAPES]
    grads = [[torch.randn(shape, generator=generator) for shape in SHARED_SHAPES] for _ in range(2)]

    def local(tensor, index):
        if layout in placements:
            return distribute_tensor(tensor, mesh, placements[layout])
        if layout in piece_groups:
            return tensor.reshape(-1)[slice(*_piece_bounds(layout, index, tensor.shape, inner, outer))].clone()
        return tensor.clone()

    params = [torch.nn.Parameter(local(weight, index)) for index, weight in enumerate(weights)]
    if layout in piece_groups:
        replicas = {"replica_groups": [mesh.get_group("outer")]} if layout == "replicated pieces" else {}
        for index, (param, shape) in enumerate(zip(params, SHARED_SHAPES)):
            muon.mark_matrix_piece(param, shape, *_piece_bounds(layout, index, shape, inner, outer),
                                   piece_groups[layout], **replicas)
    warnings = []
    handler = logging.Handler()
    handler.emit = lambda record: warnings.append(record.getMessage())
    logger = logging.getLogger(muon.__name__)
    logger.addHandler(handler)
    try:
        optimizer = muon.MuonWithAdamW([{"params": params, "use_muon": True, "momentum": 0.5, "nesterov": True,
                                         "ns_steps": 5, "scale_mode": "spectral", "extra_scale_factor": 1.0,
                                         "tp_mode": "blockwise", "fp32_matmul_prec": "medium", "qkv_split": None}],
                                       lr=0.05, weight_decay=0.1)
    finally:
        logger.removeHandler(handler)
    optimizer.distribute_newton_schulz = distribute
    calls = []
    original = muon.newton_schulz
    muon.newton_schulz = lambda matrix, *args, **kwargs: calls.append(matrix.shape) or original(matrix, *args,
                                                                                                **kwargs)
    try:
        for step_grads in grads:
            for index, (param, grad) in enumerate(zip(params, step_grads)):
                param.grad = local(grad, index)
            optimizer.step()
    finally:
        muon.newton_schulz = original
    wholes = []
    for param, shape in zip(params, SHARED_SHAPES):
        if layout in placements:
            wholes.append(param.detach().full_tensor())
        elif layout in piece_groups:
            flat = torch.zeros(shape[0] * shape[1])
            start = param.matrix_piece.start
            flat[start:start + param.numel()] = param.detach()
            for group in piece_groups[layout]:
                dist.all_reduce(flat, group=group)
            wholes.append(flat.view(shape))
        else:
            wholes.append(param.detach().clone())
    return wholes, len(calls), warnings


@pytest.mark.parametrize("layout", ["replicated", "pieces", "rows", "grid pieces", "replicated pieces",
                                    "replicated rows"])
def test_newton_schulz_is_shared_over_data_parallel_bit_equal(layout):
    """Each matrix is orthogonalized on one rank only, and every rank ends with the weights that orthogonalizing
    every matrix on every rank gives, bit for bit."""
    import torch

    ranks = LAYOUT_RANKS[layout]
    everywhere = run_on_ranks(ranks, _shared_newton_schulz_steps, layout, False)
    shared = run_on_ranks(ranks, _shared_newton_schulz_steps, layout, True)
    steps, matrices = 2, len(SHARED_SHAPES)
    assert [calls for _, calls, _ in everywhere] == [steps * matrices] * ranks
    assert sum(calls for _, calls, _ in shared) == steps * matrices and min(calls for _, calls, _ in shared) > 0
    assert [warnings for _, _, warnings in shared] == [[]] * ranks
    for (weights, _, _), (expected, _, _) in zip(shared, everywhere):
        for weight, reference in zip(weights, expected, strict=True):
            assert torch.equal(weight, reference)
    # The layouts hold the same matrices: all reach the replicated (DDP) weights.
    replicated = run_on_ranks(2, _shared_newton_schulz_steps, "replicated", False)[0][0]
    for weight, reference in zip(shared[0][0], replicated, strict=True):
        assert torch.equal(weight, reference)
    assert not torch.equal(replicated[0], _initial_weight(0))


def test_unshared_layout_is_logged_and_steps_as_ddp():
    """A DTensor sharded by columns is assembled and orthogonalized on every rank, and one startup line says so."""
    import torch

    results = run_on_ranks(2, _shared_newton_schulz_steps, "columns", True)
    assert [calls for _, calls, _ in results] == [2 * len(SHARED_SHAPES)] * 2
    for _, _, warnings in results:
        assert len(warnings) == 1 and "placements (Shard(dim=1),)" in warnings[0], warnings
        assert "orthogonalized on every rank" in warnings[0]
    replicated = run_on_ranks(2, _shared_newton_schulz_steps, "replicated", False)[0][0]
    for weight, reference in zip(results[0][0], replicated, strict=True):
        assert torch.equal(weight, reference)


def _initial_weight(index):
    import torch

    generator = torch.Generator().manual_seed(5)
    return [torch.randn(shape, generator=generator) for shape in SHARED_SHAPES][index]


def test_owners_balance_the_newton_schulz_cost():
    from megatron.core.optimizer.muon_sharing import assign_owners, newton_schulz_cost

    assert newton_schulz_cost(24, 10) == newton_schulz_cost(10, 24) == 2 * 10 * 10 * 24 + 10 ** 3
    # A fused QKV weight costs its three parts: 2 query groups of (16 q, 8 k, 8 v) rows.
    assert newton_schulz_cost(64, 12, (16, 8, 8)) == newton_schulz_cost(32, 12) + 2 * newton_schulz_cost(16, 12)
    costs = [8, 4, 4, 2, 1, 1]
    owners = assign_owners(costs, 2)
    assert owners == [0, 1, 1, 0, 1, 1]
    assert [sum(cost for cost, owner in zip(costs, owners) if owner == rank) for rank in (0, 1)] == [10, 10]
    assert assign_owners([5, 5, 5], 3) == [0, 1, 2]
    assert assign_owners([1, 7, 1, 1], 2) == [1, 0, 1, 1]
    loads = [5, 0]  # an earlier param group's matrices: the next ones go to the other rank first
    assert assign_owners([4, 2], 2, loads) == [1, 1] and loads == [5, 6]
