"""Helpers the GPT and transformer tests share: a tiny config, a fixed batch, building a seeded model and
reassembling full (unpartitioned) gradients from tensor-parallel shards."""

import torch
import torch.distributed as dist

from megatron.core import parallel_state, tensor_parallel
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.transformer.transformer_config import TransformerConfig

VOCAB_SIZE = 64
MAX_SEQUENCE_LENGTH = 16
SEQ_LENGTH = 8
MICRO_BATCH_SIZE = 2
SEED = 1234


def tiny_config(tp=1, pp=1, **overrides):
    fields = dict(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
    )
    fields.update(overrides)
    return TransformerConfig(**fields)


def fixed_batch(seed=7, batch=MICRO_BATCH_SIZE, seq=SEQ_LENGTH, vocab=VOCAB_SIZE):
    """tokens, labels (next tokens), position_ids: `[b, s]` int64, identical on every rank."""
    generator = torch.Generator().manual_seed(seed)
    stream = torch.randint(0, vocab, (batch, seq + 1), generator=generator)
    position_ids = torch.arange(seq).unsqueeze(0).expand(batch, seq).contiguous()
    return stream[:, :-1].contiguous(), stream[:, 1:].contiguous(), position_ids


def seeded_model(config, seed=SEED, **model_kwargs):
    """A GPTModel built right after seeding, so its weights depend only on `seed` (not on the layout). Without
    labels it returns the logits gathered over tensor-parallel ranks (`parallel_output=False`) unless asked
    otherwise, so the tests compare them across layouts."""
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    model_kwargs.setdefault("parallel_output", False)
    model_kwargs.setdefault("vocab_size", VOCAB_SIZE)
    model_kwargs.setdefault("max_sequence_length", MAX_SEQUENCE_LENGTH)
    model_kwargs.setdefault("share_embeddings_and_output_weights", True)
    return GPTModel(config, **model_kwargs)


def loss_and_grads(model, batch):
    """Per-token loss `[b, s]` and {name: grad} after backward of the summed loss."""
    tokens, labels, position_ids = batch
    model.zero_grad(set_to_none=True)
    loss = model(tokens, position_ids, labels=labels)
    loss.sum().backward()
    return loss.detach(), {name: p.grad.detach().clone() for name, p in model.named_parameters()}


def gather_full_tensor(shard, param):
    """The whole tensor from this rank's `shard` of `param` (partition_dim / partition_stride aware)."""
    if not getattr(param, "tensor_model_parallel", False):
        return shard
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    if tp_size == 1:
        return shard
    pieces = [torch.empty_like(shard) for _ in range(tp_size)]
    dist.all_gather(pieces, shard.contiguous(), group=parallel_state.get_tensor_model_parallel_group())
    dim, stride = param.partition_dim, getattr(param, "partition_stride", 1)
    blocks_per_rank = [torch.chunk(piece, stride, dim=dim) for piece in pieces]
    return torch.cat([blocks_per_rank[rank][block] for block in range(stride) for rank in range(tp_size)], dim=dim)


def full_grads(model):
    """{name: full gradient}: TP shards reassembled; sequence-parallel partial gradients summed over TP."""
    grads = {}
    for name, param in model.named_parameters():
        grad = param.grad.detach().clone()
        if getattr(param, "sequence_parallel", False):
            dist.all_reduce(grad, group=parallel_state.get_tensor_model_parallel_group())
        grads[name] = gather_full_tensor(grad, param)
    return grads


def full_params(model):
    return {name: gather_full_tensor(p.detach().clone(), p) for name, p in model.named_parameters()}


def max_abs_diff(reference, other):
    """Max |a - b| over matching names; raises if the name sets or shapes differ."""
    if set(reference) != set(other):
        raise AssertionError(f"parameter names differ: {sorted(set(reference) ^ set(other))}")
    worst = 0.0
    for name, value in reference.items():
        if value.shape != other[name].shape:
            raise AssertionError(f"{name}: shape {tuple(other[name].shape)} != {tuple(value.shape)}")
        worst = max(worst, (value - other[name]).abs().max().item())
    return worst


def reference_then_parallel(tp, sp, config_overrides, model_kwargs, batch_seed=7):
    """Loss/grads of a TP=1 model, then of a TP=`tp` model from the same seed; returns their differences.

    Runs on every rank of the pool (the TP=1 model is computed redundantly on each rank).
    """
    batch = fixed_batch(batch_seed)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    reference = seeded_model(tiny_config(**config_overrides), **model_kwargs)
    reference_params = full_params(reference)
    reference_loss, reference_grads = loss_and_grads(reference, batch)
    with torch.no_grad():
        reference_logits = reference(batch[0], batch[2])
    parallel_state.destroy_model_parallel()

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    parallel = seeded_model(tiny_config(tp=tp, sequence_parallel=sp, **config_overrides), **model_kwargs)
    parallel_params = full_params(parallel)
    parallel_loss, _ = loss_and_grads(parallel, batch)
    parallel_grads = full_grads(parallel)
    with torch.no_grad():
        parallel_logits = parallel(batch[0], batch[2])
    largest_grad = max(g.abs().max().item() for g in reference_grads.values())
    return {
        "param_diff": max_abs_diff(reference_params, parallel_params),
        "loss_diff": (reference_loss - parallel_loss).abs().max().item(),
        "logits_diff": (reference_logits - parallel_logits).abs().max().item(),
        "grad_diff": max_abs_diff(reference_grads, parallel_grads),
        "largest_grad": largest_grad,
        "mean_loss": reference_loss.mean().item(),
    }
