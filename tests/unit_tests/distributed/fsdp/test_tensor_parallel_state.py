"""Megatron-FSDP composed with Megatron-Core tensor parallelism on a (dp_shard, tp) mesh.

Training a toy GPT built from ColumnParallelLinear / RowParallelLinear / VocabParallelEmbedding with FSDP over
dp_shard equals TP-only training (plain AdamW, data-parallel gradients averaged by hand); so does HFSDP on a
(dp_outer=2, dp_shard=1, tp=2) mesh, where the optimizer's side is sharded over dp_outer only. At world 8 the
(dp_outer=2, dp_shard=2, tp=2) mesh has the sharded, outer and TP dims all of size 2: HFSDP and HSDP there equal
TP-only training over DP=4 too, clipped or not. State dicts hold one DTensor of the full (TP-unpartitioned) shape
per parameter; DCP saves them at (dp_shard=2, tp=2) or (dp_outer=2, dp_shard=1, tp=2) and loads them at
(dp_shard=1, tp=2), and saves them under HFSDP at (dp_outer=2, dp_shard=2, tp=2) and loads them into plain
ZeRO-3 over (dp_shard=4, tp=2).
"""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.unit_tests.multiprocess_harness import run_on_ranks

TP = 2
VOCAB, HIDDEN, FFN, SEQ = 16, 8, 10, 6  # FFN / TP = 5 rows per TP rank: split 3 + 2 over dp_shard=2
GLOBAL_BATCH = 4  # sequences per step, divisible by dp_shard = 1 and 2
TRAIN_STEPS = 3  # steps of the training-parity runs
# Checkpoint runs: the losses after loading are those of the loaded weights, then of one and two steps taken with
# the loaded optimizer state.
STEPS_BEFORE_SAVE, STEPS_AFTER_LOAD = 2, 2
LR = 1e-2
MAX_GRAD_NORM = 0.5  # below the toy model's gradient norms (about 1.5), so every step clips


def _normal(tensor):
    return nn.init.normal_(tensor, mean=0.0, std=0.2)


class ToyBlock(nn.Module):
    """Pre-norm MLP block: column-parallel up projection, row-parallel down projection."""

    def __init__(self, config):
        super().__init__()
        from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

        self.norm = nn.LayerNorm(HIDDEN)
        self.up = ColumnParallelLinear(HIDDEN, FFN, config=config, init_method=_normal, gather_output=False)
        self.down = RowParallelLinear(FFN, HIDDEN, config=config, init_method=_normal, input_is_parallel=True)

    def forward(self, x):
        hidden, _ = self.up(self.norm(x))
        out, _ = self.down(F.gelu(hidden))
        return x + out


class ToyGPT(nn.Module):
    def __init__(self, config, num_blocks=2):
        super().__init__()
        from megatron.core.tensor_parallel import ColumnParallelLinear, VocabParallelEmbedding

        self.embedding = VocabParallelEmbedding(VOCAB, HIDDEN, init_method=_normal, config=config)
        self.blocks = nn.ModuleList([ToyBlock(config) for _ in range(num_blocks)])
        self.final_norm = nn.LayerNorm(HIDDEN)
        self.head = ColumnParallelLinear(HIDDEN, VOCAB, config=config, init_method=_normal, bias=False,
                                         gather_output=True)

    def forward(self, tokens):
        hidden = self.embedding(tokens)
        for block in self.blocks:
            hidden = block(hidden)
        logits, _ = self.head(self.final_norm(hidden))
        return logits


def _init_tensor_parallel():
    from megatron.core import parallel_state as ps
    from megatron.core.model_parallel_config import ModelParallelConfig

    ps.initialize_model_parallel(tensor_model_parallel_size=TP)
    return ModelParallelConfig(tensor_model_parallel_size=TP)


def _build(config, seed):
    torch.manual_seed(seed)  # TP layers initialise every partition from one full master weight
    return ToyGPT(config)


def _batches(num_steps):
    """Sequences from random starts that follow next = (5 * token + 3) mod VOCAB: a pattern the model learns."""
    generator = torch.Generator().manual_seed(7)
    batches = []
    for _ in range(num_steps):
        tokens = [torch.randint(0, VOCAB, (GLOBAL_BATCH,), generator=generator)]
        for _ in range(SEQ):
            tokens.append((5 * tokens[-1] + 3) % VOCAB)
        batches.append(torch.stack(tokens, dim=1))
    return batches


def _dp_coordinates():
    from megatron.core import parallel_state as ps

    return ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()


def _loss(model, tokens):
    dp_rank, dp_size = _dp_coordinates()
    per_rank = tokens.shape[0] // dp_size
    local = tokens[dp_rank * per_rank:(dp_rank + 1) * per_rank]
    logits = model(local[:, :-1])
    return F.cross_entropy(logits.reshape(-1, VOCAB), local[:, 1:].reshape(-1))


def _dp_mean(value):
    """Mean over the data-parallel ranks (every rank of a TP group computes the same loss)."""
    import torch.distributed as dist

    total = torch.tensor(float(value), dtype=torch.float64)
    dist.all_reduce(total)
    return total.item() / dist.get_world_size()


def _train(model, optimizer, batches, first_step, num_steps, average_dp_grads=False, clip=None):
    """Loss before each of `num_steps` steps and after the last one (and the grad norms `clip` returned)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    losses, norms = [], []
    for step in range(first_step, first_step + num_steps + 1):
        optimizer.zero_grad()
        loss = _loss(model, batches[step])
        losses.append(_dp_mean(loss.item()))
        if step == first_step + num_steps:
            break
        loss.backward()
        if average_dp_grads:
            for param in model.parameters():
                dist.all_reduce(param.grad, group=ps.get_data_parallel_group())
                param.grad /= ps.get_data_parallel_world_size()
        if clip is not None:
            norms.append(float(clip(model, optimizer)))
        optimizer.step()
    return (losses, norms) if clip is not None else losses


def _clip_tp_only(model, optimizer):
    """Global-norm clipping of TP-only training: partitioned grads summed over TP, replicated ones counted once."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    squares = {True: torch.zeros(()), False: torch.zeros(())}
    for param in model.parameters():
        squares[bool(getattr(param, "tensor_model_parallel", False))] += param.grad.norm() ** 2
    dist.all_reduce(squares[True], group=ps.get_tensor_model_parallel_group())
    total = (squares[True] + squares[False]).sqrt()
    coefficient = MAX_GRAD_NORM / (float(total) + 1e-6)
    if coefficient < 1.0:
        for param in model.parameters():
            param.grad.mul_(coefficient)
    return total


def _clip_fsdp(model, optimizer):
    import megatron_fsdp

    return megatron_fsdp.clip_grad_norm_(optimizer, MAX_GRAD_NORM)


_meshes = {}  # name -> (default process group, mesh): every wrap in one world shares the mesh's process groups


def _mesh_of_this_world(name, build):
    """`build()`'s mesh, built once per default process group (a new world, e.g. under torchrun, builds anew)."""
    import torch.distributed as dist

    world = dist.group.WORLD
    if name not in _meshes or _meshes[name][0] is not world:
        _meshes[name] = (world, build())
    return _meshes[name][1]


def _fsdp_mesh():
    return _mesh_of_this_world("fsdp", _new_fsdp_mesh)


def _new_fsdp_mesh():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    # Ranks laid out [dp_outer][dp_shard][cp][tp]: tp varies fastest, as in parallel_state's groups. Named the way
    # scripts written for the upstream package name it: the sharding dim is dp_shard and cp flattened together.
    mesh = init_device_mesh("cpu", (1, dist.get_world_size() // TP, 1, TP),
                            mesh_dim_names=("dp_outer", "dp_shard", "cp", "tp"))
    mesh[("dp_shard", "cp")]._flatten("dp_shard_cp")
    return mesh


def _hybrid_mesh():
    """(dp_outer=2, dp_shard, tp), ranks laid out tp fastest: dp_shard=1 at world 4, dp_shard=2 at world 8."""
    return _mesh_of_this_world("hybrid", _new_hybrid_mesh)


def _new_hybrid_mesh():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dp_outer = 2
    assert dist.get_world_size() % (dp_outer * TP) == 0, dist.get_world_size()
    dp_shard = dist.get_world_size() // (dp_outer * TP)
    return init_device_mesh("cpu", (dp_outer, dp_shard, TP), mesh_dim_names=("dp_outer", "dp_shard", "tp"))


def _wrap(config, seed, strategy, outer=None):
    """FSDP over all data-parallel ranks (`outer` None), or on `_hybrid_mesh()` with the data-parallel ranks split
    into dp_outer x dp_shard: replicated over dp_outer (`outer="no_shard"`, HSDP) or sharding the optimizer there
    too (`"optim"`, HFSDP)."""
    import megatron_fsdp

    module = _build(config, seed)
    optimizer = torch.optim.AdamW(module.parameters(), lr=LR, weight_decay=0.1)
    if outer is None:
        return megatron_fsdp.fully_shard(module, optimizer, device_mesh=_fsdp_mesh(), dp_shard_dim="dp_shard_cp",
                                         tp_dim="tp", fsdp_unit_modules=[ToyBlock], zero_dp_strategy=strategy)
    mesh = _hybrid_mesh()
    model, optimizer = megatron_fsdp.fully_shard(
        module, optimizer, device_mesh=mesh, dp_shard_dim="dp_shard", dp_outer_dim="dp_outer", tp_dim="tp",
        hybrid_fsdp_group=mesh["dp_outer", "dp_shard"]._flatten().get_group(), fsdp_unit_modules=[ToyBlock],
        zero_dp_strategy=strategy, outer_dp_sharding_strategy=outer)
    assert all(group.outer_sharded == (outer == "optim") for group in model.groups if group.trainable)
    return model, optimizer


def _gather_tp(tensor, partition_dim):
    """The full tensor from every TP rank's partition."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    parts = [torch.empty_like(tensor) for _ in range(TP)]
    dist.all_gather(parts, tensor.contiguous(), group=ps.get_tensor_model_parallel_group())
    return torch.cat(parts, dim=partition_dim)


def _full_reference(param):
    if getattr(param, "tensor_model_parallel", False):
        return _gather_tp(param.detach(), param.partition_dim)
    return param.detach().clone()


# ---- training parity ------------------------------------------------------------------------------------------------
def _meshes_agree_with_parallel_state():
    """The mesh dims Megatron-FSDP is given hold the same ranks as parallel_state's groups (tp fastest)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    tp_ranks = dist.get_process_group_ranks(ps.get_tensor_model_parallel_group())
    dp_ranks = dist.get_process_group_ranks(ps.get_data_parallel_group())
    flat, hybrid = _fsdp_mesh(), _hybrid_mesh()
    if hybrid["dp_shard"].size() == 1:  # world 4: dp_outer alone holds the data-parallel ranks
        for mesh, dp_dim in ((flat, "dp_shard_cp"), (hybrid, "dp_outer")):
            assert mesh.get_local_rank(dp_dim) == ps.get_data_parallel_rank()
            assert mesh.get_local_rank("tp") == ps.get_tensor_model_parallel_rank()
            assert dist.get_process_group_ranks(mesh.get_group("tp")) == tp_ranks
            assert dist.get_process_group_ranks(mesh.get_group(dp_dim)) == dp_ranks
        return
    # Larger worlds: the flattened (dp_outer, dp_shard) group, the one passed as hybrid_fsdp_group, is theirs.
    assert hybrid["dp_shard"].size() == dist.get_world_size() // (2 * TP) > 1
    hybrid_dp = hybrid["dp_outer", "dp_shard"]._flatten()
    assert hybrid_dp.get_local_rank() == flat.get_local_rank("dp_shard_cp") == ps.get_data_parallel_rank()
    assert dist.get_process_group_ranks(hybrid_dp.get_group()) == dp_ranks
    assert dist.get_process_group_ranks(flat.get_group("dp_shard_cp")) == dp_ranks
    for mesh in (flat, hybrid):
        assert mesh.get_local_rank("tp") == ps.get_tensor_model_parallel_rank()
        assert dist.get_process_group_ranks(mesh.get_group("tp")) == tp_ranks


def _fsdp_versus_tp_only(variants, clipped_outers=(None, "optim")):
    """`variants`: (zero_dp_strategy, outer) pairs for `_wrap`; `clipped_outers`: the `outer`s trained with
    ZeRO-3 and `megatron_fsdp.clip_grad_norm_`."""
    config = _init_tensor_parallel()
    _meshes_agree_with_parallel_state()
    batches = _batches(TRAIN_STEPS + 1)

    reference = _build(config, seed=0)
    initial_params = {name: _full_reference(p) for name, p in reference.named_parameters()}
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=LR, weight_decay=0.1)
    expected = _train(reference, reference_optimizer, batches, 0, TRAIN_STEPS, average_dp_grads=True)
    expected_params = {name: _full_reference(p) for name, p in reference.named_parameters()}
    results = {}
    for variant in variants:
        model, optimizer = _wrap(config, 0, *variant)
        # full_tensor() of the full-shape DTensors is exactly the concatenation of the TP partitions
        initial_equal = {name: torch.equal(value.full_tensor(), initial_params[name])
                         for name, value in model.state_dict().items()}
        losses = _train(model, optimizer, batches, 0, TRAIN_STEPS)
        full = {name: value.full_tensor() for name, value in model.state_dict().items()}
        layout = (model.topology.outer_size, model.topology.dp_size, model.topology.tp_size)
        results[variant] = (losses, initial_equal,
                            max((full[n] - expected_params[n]).abs().max().item() for n in expected_params), layout)

    reference = _build(config, seed=0)
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=LR, weight_decay=0.1)
    clipped = _train(reference, reference_optimizer, batches, 0, TRAIN_STEPS, average_dp_grads=True,
                     clip=_clip_tp_only)
    clipped_runs = {}
    for outer in clipped_outers:  # HFSDP: the norm also sums the sub-shards over dp_outer
        model, optimizer = _wrap(config, 0, 3, outer)
        clipped_runs[outer] = _train(model, optimizer, batches, 0, TRAIN_STEPS, clip=_clip_fsdp)
    return expected, results, (clipped, clipped_runs)


@pytest.mark.parametrize("world_size", [4])
def test_fsdp_with_tp_dim_matches_tp_only_training(world_size):
    """ZeRO-1 and ZeRO-3 over (dp_shard=2, tp=2), and HFSDP over (dp_outer=2, dp_shard=1, tp=2)."""
    layouts = {(1, None): (1, 2, 2), (3, None): (1, 2, 2), (3, "optim"): (2, 1, 2)}  # (dp_outer, dp_shard, tp)
    _assert_matches_tp_only(run_on_ranks(world_size, _fsdp_versus_tp_only, tuple(layouts)), layouts)


@pytest.mark.parametrize("world_size", [8])
def test_hfsdp_and_hsdp_with_tp_dim_at_dp_outer2_dp_shard2_tp2(world_size):
    """HFSDP and HSDP over (dp_outer=2, dp_shard=2, tp=2), where sharded, outer and TP dims are all > 1; HFSDP
    clipped too."""
    layouts = {(3, "optim"): (2, 2, 2), (3, "no_shard"): (2, 2, 2)}  # (dp_outer, dp_shard, tp)
    per_rank = run_on_ranks(world_size, _fsdp_versus_tp_only, tuple(layouts), ("optim",))
    _assert_matches_tp_only(per_rank, layouts)
    assert set(per_rank[0][2][1]) == {"optim"}


def _assert_matches_tp_only(per_rank, layouts):
    """Every rank's `_fsdp_versus_tp_only` results: losses, parameters and clipped norms equal TP-only training;
    `layouts`: the (dp_outer, dp_shard, tp) sizes each variant must have run on."""
    for expected, results, clipped in per_rank:
        assert expected[-1] < 0.9 * expected[0]  # it trains
        (expected_losses, expected_norms), clipped_runs = clipped
        assert min(expected_norms) > MAX_GRAD_NORM
        for outer, (losses, norms) in clipped_runs.items():
            assert norms == pytest.approx(expected_norms, rel=1e-5), outer
            assert losses == pytest.approx(expected_losses, abs=1e-5), outer
        assert set(results) == set(layouts)
        for variant, (losses, initial_equal, max_param_error, layout) in results.items():
            assert layout == layouts[variant], (variant, layout)
            assert len(initial_equal) == 16 and all(initial_equal.values()), (variant, initial_equal)
            assert losses == pytest.approx(expected, abs=1e-5), variant
            assert max_param_error < 1e-5, (variant, max_param_error)


# ---- DCP round trip at another data-parallel size --------------------------------------------------------------------
# Chunks DCP records for the full tensors at (dp_shard=2, tp=2): {offsets: sizes}. TP partitions come first, then
# rows of each partition (5 rows of up.weight per TP rank split 3 + 2); down.bias is replicated over TP.
EXPECTED_CHUNKS = {
    "embedding.weight": {(0, 0): (4, HIDDEN), (4, 0): (4, HIDDEN), (8, 0): (4, HIDDEN), (12, 0): (4, HIDDEN)},
    "blocks.0.up.weight": {(0, 0): (3, HIDDEN), (3, 0): (2, HIDDEN), (5, 0): (3, HIDDEN), (8, 0): (2, HIDDEN)},
    "blocks.0.up.bias": {(0,): (3,), (3,): (2,), (5,): (3,), (8,): (2,)},
    "blocks.0.down.weight": {(0, 0): (4, 5), (4, 0): (4, 5), (0, 5): (4, 5), (4, 5): (4, 5)},
    "blocks.0.down.bias": {(0,): (4,), (4,): (4,)},
}


def _save(config, directory, strategy, outer):
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    batches = _batches(STEPS_BEFORE_SAVE + STEPS_AFTER_LOAD + 1)
    model, optimizer = _wrap(config, 0, strategy, outer)
    _train(model, optimizer, batches, 0, STEPS_BEFORE_SAVE)
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    dcp.save(state, checkpoint_id=directory)
    chunks = None
    if dist.get_rank() == 0:
        metadata = dcp.FileSystemReader(directory).read_metadata().state_dict_metadata
        chunks = {key: {tuple(c.offsets): tuple(c.sizes) for c in metadata[f"model.{key}"].chunks}
                  for key in EXPECTED_CHUNKS}
        chunks["moment"] = {tuple(c.offsets): tuple(c.sizes)
                            for c in metadata["optimizer.state.blocks.0.up.weight.exp_avg"].chunks}
    return _train(model, optimizer, batches, STEPS_BEFORE_SAVE, STEPS_AFTER_LOAD), chunks


def _load(config, directory, strategy):
    import torch.distributed.checkpoint as dcp

    batches = _batches(STEPS_BEFORE_SAVE + STEPS_AFTER_LOAD + 1)
    model, optimizer = _wrap(config, 123, strategy)  # another init: everything must come from the checkpoint
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    dcp.load(state, checkpoint_id=directory)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    # The same state as full (TP-unpartitioned, unsharded) plain tensors loads too.
    full_model = {name: value.full_tensor() for name, value in state["model"].items()}
    full_optimizer = {"param_groups": state["optimizer"]["param_groups"], "state": {
        name: {key: value.full_tensor() if hasattr(value, "full_tensor") else value for key, value in entry.items()}
        for name, entry in state["optimizer"]["state"].items()}}
    from_full, from_full_optimizer = _wrap(config, 321, strategy)
    partition_only = dict(full_model, **{"blocks.0.up.weight": full_model["blocks.0.up.weight"][:FFN // TP]})
    with pytest.raises(ValueError, match=r"does not match the parameter's full \(tensor-parallel unpartitioned\)"):
        from_full.load_state_dict(partition_only)
    from_full.load_state_dict(full_model)
    from_full_optimizer.load_state_dict(full_optimizer)
    return (_train(model, optimizer, batches, STEPS_BEFORE_SAVE, STEPS_AFTER_LOAD),
            _train(from_full, from_full_optimizer, batches, STEPS_BEFORE_SAVE, STEPS_AFTER_LOAD))


def _save_all(directory, cases):
    config = _init_tensor_parallel()
    return {case: _save(config, f"{directory}_{case[0]}_{case[1]}", *case) for case in cases}


def _load_all(directory, cases):
    config = _init_tensor_parallel()
    return {case: _load(config, f"{directory}_{case[0]}_{case[1]}", case[0]) for case in cases}


@pytest.mark.parametrize("world_size", [4])
def test_dcp_save_at_dp2_tp2_loads_at_dp1_tp2(world_size, tmp_path):
    """(strategy, outer) cases saved at world 4 (dp_shard=2, or dp_outer=2 with dp_shard=1 under HSDP or HFSDP;
    tp=2) load at world 2 (dp_shard=1, tp=2)."""
    cases = ((1, None), (3, None), (3, "no_shard"), (3, "optim"))
    directory = str(tmp_path / "ckpt")
    saved = run_on_ranks(world_size, _save_all, directory, cases)
    loaded = run_on_ranks(2, _load_all, directory, cases)
    for case in cases:
        uninterrupted, chunks = saved[0][case]
        if case[1]:  # rows over a dp_shard of size 1: whole TP partitions, replicated over dp_outer
            assert chunks["blocks.0.up.weight"] == {(0, 0): (5, HIDDEN), (5, 0): (5, HIDDEN)}
            # HFSDP's moments live in sub-shards over dp_outer, but are saved in the same chunks as the weights
            assert chunks["moment"] == chunks["blocks.0.up.weight"], case
        else:
            for key, expected in EXPECTED_CHUNKS.items():
                assert chunks[key] == expected, (case, key, chunks[key])
            assert chunks["moment"] == EXPECTED_CHUNKS["blocks.0.up.weight"]
        for rank_losses in loaded:
            from_dcp, from_full_tensors = rank_losses[case]
            assert from_dcp == pytest.approx(uninterrupted, abs=1e-6), case
            assert from_full_tensors == pytest.approx(uninterrupted, abs=1e-6), case


@pytest.mark.parametrize("world_size", [8])
def test_dcp_save_under_hfsdp_at_outer2_shard2_tp2_loads_into_zero3_at_dp4_tp2(world_size, tmp_path):
    """HFSDP at (dp_outer=2, dp_shard=2, tp=2) saves; plain ZeRO-3 over (dp_shard_cp=4, tp=2) on the same 8 ranks
    loads, from DCP and from full tensors, and goes on exactly as the uninterrupted HFSDP run."""
    cases = ((3, "optim"),)
    directory = str(tmp_path / "ckpt")
    saved = run_on_ranks(world_size, _save_all, directory, cases)
    loaded = run_on_ranks(world_size, _load_all, directory, cases)
    uninterrupted, chunks = saved[0][cases[0]]
    # Shards over dp_shard=2 inside each TP partition, replicated over dp_outer: the chunks of (dp_shard=2, tp=2);
    # the moments, held in sub-shards over dp_outer, are saved in those chunks too
    for key, expected in EXPECTED_CHUNKS.items():
        assert chunks[key] == expected, (key, chunks[key])
    assert chunks["moment"] == EXPECTED_CHUNKS["blocks.0.up.weight"]
    assert len(loaded) == 8
    for rank_losses in loaded:
        from_dcp, from_full_tensors = rank_losses[cases[0]]
        assert from_dcp == pytest.approx(uninterrupted, abs=1e-6)
        assert from_full_tensors == pytest.approx(uninterrupted, abs=1e-6)
