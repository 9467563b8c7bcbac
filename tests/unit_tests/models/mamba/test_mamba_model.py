"""MambaModel: the hybrid pattern decides each layer's kind and parameters (upstream's names), the pattern can be
given as upstream's arguments, arguments it cannot honour are refused by name, and packed sequences each run as if
alone."""

import pytest
import torch

from megatron.core import tensor_parallel
from megatron.core.models.mamba import MambaModel
from megatron.core.models.mamba.mamba_layer_specs import mamba_stack_spec
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.ssm.mamba_layer import MambaLayer
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import TransformerLayer

VOCAB, SEQ = 64, 12


def _config(**overrides):
    fields = dict(num_layers=3, hidden_size=16, num_attention_heads=4, init_seed=3, hidden_dropout=0.0,
                  attention_dropout=0.0, mamba_head_dim=8, mamba_num_groups=2, mamba_state_dim=4, mamba_chunk_size=4)
    return TransformerConfig(**{**fields, **overrides})


def _model(config=None, **kwargs):
    tensor_parallel.model_parallel_cuda_manual_seed(1)
    return MambaModel(config or _config(), mamba_stack_spec, vocab_size=VOCAB, max_sequence_length=SEQ, **kwargs)


def test_the_pattern_decides_each_layer():
    model = _model(hybrid_override_pattern="M*-")
    assert model.hybrid_layer_pattern == "M*-"
    mamba, attention, mlp = model.decoder.layers
    assert isinstance(mamba, MambaLayer) and isinstance(attention, TransformerLayer)
    assert attention.mlp is None and attention.self_attention is not None
    assert mlp.self_attention is None and mlp.mlp is not None
    names = [name for name, _ in model.named_parameters()]
    assert "decoder.layers.0.mixer.in_proj.weight" in names and "decoder.layers.0.norm.weight" in names
    assert "decoder.layers.1.self_attention.linear_qkv.weight" in names
    assert not any(name.startswith("decoder.layers.1.mlp") for name in names)
    assert "decoder.layers.2.mlp.linear_fc1.weight" in names
    assert not any(name.startswith("decoder.layers.2.self_attention") for name in names)
    assert model.position_embedding_type == "none" and "embedding.position_embeddings.weight" not in names
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(0))
    losses = model(ids, None, None, labels=ids)
    assert losses.shape == (2, SEQ) and torch.isfinite(losses).all()
    # Without a pattern or ratios every layer is a Mamba layer; ratios spread the other kinds.
    assert _model().hybrid_layer_pattern == "MMM"
    assert _model(hybrid_attention_ratio=0.34).hybrid_layer_pattern == "M*M"


def test_e_layers_are_mixture_of_experts_layers_without_attention():
    from megatron.core.transformer.moe.moe_layer import MoELayer

    model = _model(_config(num_moe_experts=4, moe_router_topk=2), hybrid_override_pattern="ME-")
    moe, dense = model.decoder.layers[1], model.decoder.layers[2]
    assert isinstance(moe.mlp, MoELayer) and moe.self_attention is None and not isinstance(dense.mlp, MoELayer)
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(0))
    assert torch.isfinite(model(ids, None, None, labels=ids)).all()


def test_a_layer_does_not_depend_on_the_others():
    """Each layer's weights come from its own seed: layer 1 of 'M*-' equals layer 1 of '**-'."""
    first = _model(hybrid_override_pattern="M*-").decoder.layers[1].state_dict()
    second = _model(hybrid_override_pattern="**-").decoder.layers[1].state_dict()
    assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)


def test_refusals():
    with pytest.raises(ValueError, match=r"hybrid_layer_pattern 'M\*-' and the pattern the MambaModel arguments give "
                                         r"\('MMM'\) differ"):
        _model(_config(hybrid_layer_pattern="M*-"), hybrid_override_pattern="MMM")
    with pytest.raises(TypeError, match=r"mamba_stack_spec=.*pass megatron.core.models.mamba"):
        MambaModel(_config(), "a spec", vocab_size=VOCAB, max_sequence_length=SEQ)


def _packed_params(lengths, starts, total):
    offsets = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    padded = torch.tensor(starts + [total], dtype=torch.int32)
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=offsets, cu_seqlens_kv=offsets, cu_seqlens_q_padded=padded,
                           cu_seqlens_kv_padded=padded, max_seqlen_q=max(lengths), max_seqlen_kv=max(lengths))


@pytest.mark.parametrize("pattern", ["MMMM", "M*M-"])
def test_packed_sequences_each_scan_as_if_alone(pattern):
    """A packed row of three sequences (at padded offsets, padding after each) gives every real token the loss it
    has when its sequence runs alone, and the row's gradient is the sum of the sequences' gradients."""
    model = _model(_config(num_layers=4, init_method_std=0.2), hybrid_override_pattern=pattern)
    generator = torch.Generator().manual_seed(0)
    lengths, starts, total = [5, 7, 3], [0, 8, 16], 20
    streams = [torch.randint(0, VOCAB, (length + 1,), generator=generator) for length in lengths]
    model.zero_grad(set_to_none=True)
    alone = []
    for stream in streams:
        loss = model(stream[None, :-1], None, None, labels=stream[None, 1:])
        loss.sum().backward()
        alone.append(loss.detach()[0])
    expected_grads = {name: param.grad.clone() for name, param in model.named_parameters()}
    tokens, labels, mask = (torch.zeros(1, total, dtype=torch.int64), torch.zeros(1, total, dtype=torch.int64),
                            torch.zeros(1, total))
    for start, stream in zip(starts, streams):
        tokens[0, start:start + len(stream) - 1], labels[0, start:start + len(stream) - 1] = stream[:-1], stream[1:]
        mask[0, start:start + len(stream) - 1] = 1.0
    model.zero_grad(set_to_none=True)
    losses = model(tokens, None, None, labels=labels, packed_seq_params=_packed_params(lengths, starts, total))
    (losses * mask).sum().backward()
    real = [losses[0, start:start + length] for start, length in zip(starts, lengths)]
    torch.testing.assert_close(torch.cat(real).detach(), torch.cat(alone), rtol=0, atol=2e-6)
    for name, param in model.named_parameters():
        scale = expected_grads[name].abs().max().clamp(min=1.0)
        assert ((param.grad - expected_grads[name]).abs().max() / scale) < 5e-6, name
    # Without packed_seq_params the sequences see the ones before them (through the scan state, and attention).
    crossing = model(tokens, None, None, labels=labels)[0, starts[1]:starts[1] + lengths[1]]
    assert (crossing.detach() - alone[1]).abs().max() > 1e-3
