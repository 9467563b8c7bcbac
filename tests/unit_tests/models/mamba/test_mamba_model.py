"""MambaModel: the hybrid pattern decides each layer's kind and parameters (upstream's names), the pattern can be
given as upstream's arguments, and what Mamba layers cannot do is refused by name."""

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
    model = _model(hybrid_override_pattern="M*-")
    ids = torch.randint(0, VOCAB, (1, SEQ), generator=torch.Generator().manual_seed(0))
    offsets = torch.tensor([0, 5, SEQ], dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=offsets, cu_seqlens_kv=offsets, max_seqlen_q=7,
                             max_seqlen_kv=7)
    with pytest.raises(NotImplementedError, match=r"packed sequences .* not supported by Mamba layers"):
        model(ids, None, None, labels=ids, packed_seq_params=params)
