"""Megatron-FSDP over a model parallelised with torch's own tensor parallelism (torchtitan style): a transformer
whose attention and MLP linears are `ColwiseParallel` / `RowwiseParallel`, norms `SequenceParallel`, on the "tp"
dim of a 2x2 `init_device_mesh(("dp", "tp"))`, sharded with `fully_shard(device_mesh=mesh, dp_shard_dim="dp",
tp_dim="tp")`. Its losses and final weights equal one rank's unsharded training and torch FSDP2's
`fully_shard(mesh["dp"])` over the same TP model; the TP-aware `clip_grad_norm_` gives the unsharded norm.
Wrapping such a model over a 1-D mesh (no tp dim) is refused, naming the arguments to pass."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.unit_tests.multiprocess_harness import run_on_ranks

DIM, HEADS, VOCAB, SEQ, BATCH, STEPS, LR = 16, 4, 32, 8, 4, 3, 1e-2
NO_CLIP = 1e9  # clip_grad_norm_ only to read the 2-norm: TP partitions summed over tp, replicated ones once


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(DIM, DIM, bias=False) for _ in range(4))

    def forward(self, x):
        batch, seq, _ = x.shape
        # -1 heads: each TP rank holds HEADS / tp of them
        q, k, v = (w(x).view(batch, seq, -1, DIM // HEADS).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1, self.w2 = nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM)

    def forward(self, x):
        return self.w2(F.gelu(self.w1(x)))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn_norm, self.attn, self.mlp_norm, self.mlp = nn.LayerNorm(DIM), Attention(), nn.LayerNorm(DIM), MLP()

    def forward(self, x):
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class Transformer(nn.Module):
    def __init__(self):
        super().__init__()
        self.embedding = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.norm, self.output = nn.LayerNorm(DIM), nn.Linear(DIM, VOCAB)

    def forward(self, tokens):
        x = self.embedding(tokens)
        for block in self.blocks:
            x = block(x)
        return self.output(self.norm(x))


def _build():
    torch.manual_seed(0)
    return Transformer()


def _apply_tensor_parallel(model, tp_mesh):
    """torchtitan's plan: sequence-parallel norms, vocab-parallel embedding, column/row-parallel linears."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)

    parallelize_module(model, tp_mesh, {
        "embedding": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate(), use_local_output=True)})
    to_replicated = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    for block in model.blocks:
        parallelize_module(block, tp_mesh, {
            "attn_norm": SequenceParallel(), "mlp_norm": SequenceParallel(), "attn": to_replicated,
            "mlp": to_replicated, "attn.wq": ColwiseParallel(), "attn.wk": ColwiseParallel(),
            "attn.wv": ColwiseParallel(), "attn.wo": RowwiseParallel(output_layouts=Shard(1)),
            "mlp.w1": ColwiseParallel(), "mlp.w2": RowwiseParallel(output_layouts=Shard(1))})
    return model


def _batches():
    generator = torch.Generator().manual_seed(1)
    return [(torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator),
             torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)) for _ in range(STEPS)]


def _train(model, optimizer, dp_rank, dp_size, clip=None):
    """Losses (mean over the data-parallel ranks) of each step and the gradient norm of the first step."""
    import torch.distributed as dist

    losses, first_norm = [], None
    for tokens, target in _batches():
        tokens, target = tokens.chunk(dp_size)[dp_rank], target.chunk(dp_size)[dp_rank]
        optimizer.zero_grad()
        loss = F.cross_entropy(model(tokens).flatten(0, 1), target.flatten())
        loss.backward()
        if clip is not None and first_norm is None:
            first_norm = float(clip())
        optimizer.step()
        if dist.is_initialized():
            loss = loss.detach().clone()
            dist.all_reduce(loss)
            loss /= dist.get_world_size()  # every TP rank of a dp rank has the same loss
        losses.append(loss.item())
    return losses, first_norm


def _full(value):
    value = value.detach()
    return value.full_tensor() if hasattr(value, "full_tensor") else value


def _two_dimensional_parity():
    import megatron_fsdp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp_rank = mesh["dp"].get_local_rank()
    results = {}

    reference = _build()
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=LR)
    results["reference"], results["reference_norm"] = _train(
        reference, reference_optimizer, 0, 1,
        clip=lambda: torch.nn.utils.clip_grad_norm_(reference.parameters(), NO_CLIP))
    reference_weights = {name: p.detach() for name, p in reference.named_parameters()}

    fsdp2 = _apply_tensor_parallel(_build(), mesh["tp"])
    for block in fsdp2.blocks:
        fsdp2_fully_shard(block, mesh=mesh["dp"])
    fsdp2_fully_shard(fsdp2, mesh=mesh["dp"])
    results["fsdp2"], _ = _train(fsdp2, torch.optim.AdamW(fsdp2.parameters(), lr=LR), dp_rank, 2)
    fsdp2_weights = {name: _full(p) for name, p in fsdp2.named_parameters()}

    module = _apply_tensor_parallel(_build(), mesh["tp"])
    model, optimizer = megatron_fsdp.fully_shard(
        module, torch.optim.AdamW(module.parameters(), lr=LR), fsdp_unit_modules=[Block], device_mesh=mesh,
        dp_shard_dim="dp", tp_dim="tp", zero_dp_strategy="optim_grads_params")
    results["megatron_fsdp"], results["megatron_fsdp_norm"] = _train(
        model, optimizer, dp_rank, 2, clip=lambda: megatron_fsdp.clip_grad_norm_(optimizer, NO_CLIP))
    state = model.state_dict()
    results["keys"] = sorted(state) == sorted(reference_weights)
    results["vs_reference"] = max((_full(state[n]) - w).abs().max().item() for n, w in reference_weights.items())
    results["vs_fsdp2"] = max((_full(state[n]) - w).abs().max().item() for n, w in fsdp2_weights.items())

    module = _apply_tensor_parallel(_build(), mesh["tp"])
    try:
        megatron_fsdp.fully_shard_model(module, fsdp_unit_modules=[Block], device_mesh=mesh["dp"])
        results["one_dim_mesh_error"] = None
    except ValueError as error:
        results["one_dim_mesh_error"] = str(error)
    return results


@pytest.mark.parametrize("world_size", [4])
def test_torch_tensor_parallel_model_matches_one_rank_and_fsdp2(world_size):
    for result in run_on_ranks(world_size, _two_dimensional_parity):
        assert result["keys"]
        for name in ("fsdp2", "megatron_fsdp"):
            assert result[name] == pytest.approx(result["reference"], abs=1e-5), name
        assert result["vs_reference"] < 1e-5 and result["vs_fsdp2"] < 1e-5
        assert result["megatron_fsdp_norm"] == pytest.approx(result["reference_norm"], rel=1e-5)
        message = result["one_dim_mesh_error"]
        assert "embedding.weight" in message and "tp_dim='tp'" in message and "device_mesh" in message
