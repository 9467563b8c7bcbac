"""QK-Clip (--qk-clip): the row factors against a reference written here (multi-head and grouped-query
attention), the logits after a clipping step, and the same training under Megatron DDP, the distributed optimizer,
Megatron-FSDP ZeRO-3 and FSDP2."""

import os

import pytest
import torch
import torch.distributed as dist

from megatron.core.optimizer.qk_clip import (
    attention_modules,
    clipping_after_step,
    qkv_row_scales,
    reduce_max_attention_logits,
    reset_max_attention_logits,
    scale_rows,
)
from tests.unit_tests.multiprocess_harness import run_on_ranks


def _reference_clip(weight, max_logits, heads, groups, head_dim, threshold, alpha):
    """Kimi's rule head by head on a `[groups * (m + 2) * head_dim, cols]` QKV weight: query head h times
    (tau / S_h)^alpha when S_h > tau; the key of a group times the smallest (tau / S_h)^(1 - alpha) of its heads."""
    per_group = heads // groups
    clipped = weight.clone()
    for group in range(groups):
        base = group * (per_group + 2) * head_dim
        key_factor = 1.0
        for member in range(per_group):
            logit = float(max_logits[group * per_group + member])
            gamma = threshold / logit if logit > threshold else 1.0
            rows = slice(base + member * head_dim, base + (member + 1) * head_dim)
            clipped[rows] = weight[rows] * gamma ** alpha
            key_factor = min(key_factor, gamma ** (1 - alpha))
        key_rows = slice(base + per_group * head_dim, base + (per_group + 1) * head_dim)
        clipped[key_rows] = weight[key_rows] * key_factor
    return clipped


@pytest.mark.parametrize("heads,groups", [(4, 4), (6, 2)])
def test_row_factors_match_the_reference(heads, groups):
    head_dim, threshold, alpha = 3, 5.0, 0.3
    generator = torch.Generator().manual_seed(heads)
    max_logits = torch.tensor([8.0, 2.0, 20.0, 5.0, 6.5, -1.0][:heads])
    weight = torch.randn(groups * (heads // groups + 2) * head_dim, 7, generator=generator)
    scales = qkv_row_scales(max_logits, heads // groups, head_dim, threshold, alpha)
    expected = _reference_clip(weight, max_logits, heads, groups, head_dim, threshold, alpha)
    torch.testing.assert_close(weight * scales[:, None], expected)
    assert not torch.equal(expected, weight)


@pytest.mark.parametrize("heads,groups,tp", [(4, 4, 2), (4, 2, 2), (8, 2, 2), (8, 4, 4)])
def test_tensor_parallel_shards_take_their_rows_of_the_full_factors(heads, groups, tp):
    """A tensor-parallel rank holds whole query groups (a contiguous block of QKV rows) and the maxima of their
    heads only: its factors must be the full weight's factors of those rows."""
    head_dim, threshold, alpha = 2, 1.0, 0.4
    max_logits = torch.linspace(0.2, 3.0, heads)[torch.randperm(heads, generator=torch.Generator().manual_seed(heads))]
    per_group = heads // groups
    full = qkv_row_scales(max_logits, per_group, head_dim, threshold, alpha)
    rows_per_rank, heads_per_rank = len(full) // tp, heads // tp
    for rank in range(tp):
        local = qkv_row_scales(max_logits[rank * heads_per_rank:(rank + 1) * heads_per_rank], per_group, head_dim,
                               threshold, alpha)
        assert torch.equal(local, full[rank * rows_per_rank:(rank + 1) * rows_per_rank])
    assert (max_logits > threshold).any() and (max_logits <= threshold).any()  # clipped and unclipped heads


def _scale_host_shards_of_a_cuda_mesh():
    """What --torch-fsdp2-cpu-offload makes on a GPU machine: a "cuda" mesh whose DTensor main weights keep their
    local tensors in host memory (on CPU-only torch any move to the mesh's device raises). Each rank scales its
    row shard of a 5 x 3 weight (3 and 2 rows) and of a 5-row bias."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    rank, world_size = dist.get_rank(), dist.get_world_size()
    mesh = DeviceMesh.from_group(dist.group.WORLD, "cuda", mesh=torch.arange(world_size))
    row_scales = torch.tensor([0.5, 1.0, 0.25, 1.0, 0.75])
    results = []
    for full in (torch.randn(5, 3, generator=torch.Generator().manual_seed(3)), torch.arange(1.0, 6.0)):
        spec = DTensorSpec(mesh, (Shard(0),), TensorMeta(full.shape, full.stride(), full.dtype))
        main = DTensor(full.chunk(world_size)[rank].clone(), spec, requires_grad=False)
        scale_rows(main, row_scales)
        expected = (full * row_scales.view(-1, *([1] * (full.dim() - 1)))).chunk(world_size)[rank]
        results.append((main.to_local().device.type, torch.equal(main.to_local(), expected)))
    return results


def test_scales_host_shards_of_a_cuda_mesh_where_they_live():
    """Each rank's shard of the factors is cut and applied in host memory, never built on the mesh's device."""
    assert run_on_ranks(2, _scale_host_shards_of_a_cuda_mesh) == [[("cpu", True), ("cpu", True)]] * 2


def _logits_after_a_clipping_step(threshold):
    """(maxima before, maxima recomputed after) a step at learning rate 0 of a one-layer GPT with grouped queries
    and QKV biases: only the clip moves the weights (one layer: the attention's input is unchanged)."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from tests.unit_tests.models.gpt.gpt_test_utils import fixed_batch, seeded_model, tiny_config

    model = seeded_model(tiny_config(num_layers=1, num_query_groups=2, add_qkv_bias=True, qk_clip=True,
                                     qk_clip_threshold=threshold))
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="sgd", lr=0.0, weight_decay=0.0), [model])
    tokens, labels, position_ids = fixed_batch()
    model(tokens, position_ids, labels=labels).sum().backward()
    reduce_max_attention_logits([model], None)
    before = [attention.max_attention_logits.clone() for attention in attention_modules([model])]
    with clipping_after_step(optimizer, [model]):
        assert optimizer.step()[0]
    assert optimizer.after_inner_step is None
    reset_max_attention_logits([model])
    with torch.no_grad():
        model(tokens, position_ids, labels=labels)
    return before, [attention.max_attention_logits for attention in attention_modules([model])]


def test_clipped_heads_end_at_the_threshold():
    threshold = 0.025
    (before,), (after,) = _logits_after_a_clipping_step(threshold)
    clipped = before > threshold
    assert clipped.any() and not clipped.all(), before
    assert (after[clipped] <= threshold * (1 + 1e-5)).all(), (before, after)
    # The largest head of each group takes the group's key factor as its own: it lands on the threshold; the
    # other heads of the group shrink at least by their own gamma (and unclipped heads never grow).
    for group_before, group_after in zip(before.view(2, 2), after.view(2, 2)):
        if group_before.max() > threshold:
            torch.testing.assert_close(group_after[group_before.argmax()], torch.tensor(threshold), rtol=1e-5, atol=0)
    assert (after[~clipped] <= before[~clipped] * (1 + 1e-6)).all()


def _gpt_with_qk_clip(qk_clip, threshold, mla=None):
    """A one-layer GPT with grouped-query attention, or with multi-latent attention of the shape fields `mla`."""
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel()
    tensor_parallel.model_parallel_cuda_manual_seed(7)
    attention = dict(multi_latent_attention=True, **mla) if mla else dict(num_query_groups=2)
    config = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, hidden_dropout=0.0,
                               attention_dropout=0.0, init_seed=7, qk_clip=qk_clip, qk_clip_threshold=threshold,
                               log_max_attention_logit=True, **attention)
    return GPTModel(config, vocab_size=64, max_sequence_length=16, share_embeddings_and_output_weights=False,
                    position_embedding_type="rope" if mla else "learned_absolute")


# fp32 on CPU: the wrappers reduce gradients in other orders (about 1e-7 apart).
TOLERANCE = 1e-6
WRAPPER_FLAGS = {
    "ddp": "",
    "distopt": "--use-distributed-optimizer",
    "mfsdp_zero3": "--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params",
    "fsdp2": "--use-torch-fsdp2",
}


def _muon_run_with_qk_clip(wrapper, qk_clip=True, threshold=0.05, steps=2, mla=None):
    """(mean loss before each step and after the last, each step's reduced per-head maxima) of Muon training
    (with multi-latent attention of the shape fields `mla` if given)."""
    from megatron.core import parallel_state
    from megatron.core.distributed import wrap_data_parallel
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.training.arguments import parse_args, validate_args
    from megatron.training.model_config import ddp_config_from_args
    from tests.unit_tests.distributed.precision_gpt import gpt_batch, gpt_loss

    flags = ("--num-layers 1 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --micro-batch-size 2 "
             "--train-iters 10 --lr 1e-3 --mock-data --vocab-size 64 --untie-embeddings-and-output-weights "
             "--optimizer muon " + WRAPPER_FLAGS[wrapper])
    os.environ.update({"WORLD_SIZE": str(dist.get_world_size()), "RANK": str(dist.get_rank())})
    args = validate_args(parse_args(args=flags.split()))
    model = _gpt_with_qk_clip(qk_clip, threshold, mla)
    chunk = wrap_data_parallel(model.config, ddp_config_from_args(args), model)
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="muon", lr=0.02, weight_decay=0.1, clip_grad=1.0, muon_momentum=0.9,
                        use_distributed_optimizer=args.use_distributed_optimizer), [chunk])
    losses, maxima = [], []
    for step in range(steps + 1):
        optimizer.zero_grad()
        if hasattr(chunk, "zero_grad_buffer"):
            chunk.zero_grad_buffer()
        reset_max_attention_logits([chunk])
        loss = gpt_loss(chunk, gpt_batch(step))
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / dist.get_world_size())
        if step == steps:
            break
        loss.backward()
        chunk.finish_grad_sync()
        reduce_max_attention_logits([chunk], parallel_state.get_data_parallel_group(with_context_parallel=True))
        maxima.append(attention_modules([chunk])[0].max_attention_logits.clone())
        with clipping_after_step(optimizer, [chunk]):
            assert optimizer.step()[0]
    return losses, torch.stack(maxima)


def test_sharded_wrappers_clip_as_ddp_on_two_ranks():
    reference_losses, reference_maxima = run_on_ranks(2, _muon_run_with_qk_clip, "ddp")[0]
    assert (reference_maxima > 0.05).any() and (reference_maxima <= 0.05).any()  # some heads clipped, some not
    unclipped_losses, _ = run_on_ranks(2, _muon_run_with_qk_clip, "ddp", False)[0]
    # The clip moved the training well beyond the wrappers' agreement.
    assert abs(unclipped_losses[-1] - reference_losses[-1]) > 10 * TOLERANCE
    for wrapper in ("distopt", "mfsdp_zero3", "fsdp2"):
        for losses, maxima in run_on_ranks(2, _muon_run_with_qk_clip, wrapper):
            torch.testing.assert_close(torch.tensor(losses), torch.tensor(reference_losses), atol=TOLERANCE, rtol=0)
            torch.testing.assert_close(maxima, reference_maxima, atol=TOLERANCE, rtol=0)
