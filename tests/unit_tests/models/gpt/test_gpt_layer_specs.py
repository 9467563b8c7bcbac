"""Upstream's GPTModel(config, transformer_layer_spec, vocab_size, max_sequence_length) call: the layer specs are
checked against the config, and a config whose tensor-parallel size differs from the group's is refused."""

import pytest
import torch

from megatron.core import parallel_state, tensor_parallel
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_decoder_block_spec,
    get_gpt_layer_local_spec,
    get_gpt_layer_with_transformer_engine_spec,
    get_gpt_mtp_block_spec,
)
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.transformer.transformer_block import TransformerBlock, TransformerBlockSubmodules
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import TransformerLayer
from tests.unit_tests.multiprocess_harness import run_on_ranks


def _config(**overrides):
    fields = dict(num_layers=2, hidden_size=12, num_attention_heads=4, hidden_dropout=0.0, attention_dropout=0.0)
    return TransformerConfig(**{**fields, **overrides})


def test_local_spec_builds_the_same_model_as_no_spec():
    config = _config(init_seed=5)
    with_spec = GPTModel(config, get_gpt_layer_local_spec(), 32, 16)
    without = GPTModel(config, vocab_size=32, max_sequence_length=16)
    assert with_spec.state_dict().keys() == without.state_dict().keys()
    assert all(torch.equal(a, b) for a, b in zip(with_spec.state_dict().values(), without.state_dict().values()))


def test_specs_asking_for_other_layers_name_the_config_field():
    with pytest.raises(ValueError, match=r"TransformerConfig\(qk_layernorm=True\)"):
        GPTModel(_config(), get_gpt_layer_local_spec(qk_layernorm=True), 32, 16)
    with pytest.raises(ValueError, match=r"TransformerConfig\(transformer_impl='transformer_engine'\)"):
        GPTModel(_config(), get_gpt_layer_with_transformer_engine_spec(), 32, 16)
    with pytest.raises(ValueError, match=r"TransformerConfig\(normalization='RMSNorm'\)"):
        GPTModel(_config(), get_gpt_layer_local_spec(normalization="RMSNorm"), 32, 16)
    with pytest.raises(ValueError, match=r"asks for fp8='hybrid' but the TransformerConfig has fp8=None: .* set "
                                         r"TransformerConfig\(fp8='hybrid'\)"):
        GPTModel(_config(), get_gpt_layer_local_spec(fp8="hybrid"), 32, 16)
    with pytest.raises(TypeError, match="vocab_size, max_sequence_length"):
        GPTModel(_config(), 32, 16)  # this project's old positional order


def test_deprecated_fp8_argument_agreeing_with_the_config_builds():
    """Older upstream scripts pass args.fp8 to the spec (upstream ignores it with a deprecation warning); here it
    must agree with TransformerConfig(fp8=...), which is what builds the layers."""
    model = GPTModel(_config(fp8="hybrid"), get_gpt_layer_local_spec(None, False, False, False, "hybrid"), 32, 16)
    assert model.config.fp8 == "hybrid"
    spec = get_gpt_layer_with_transformer_engine_spec(fp8="e4m3", use_te_activation_func=True,
                                                      fallback_to_eager_attn=True)
    assert spec.config_fields["fp8"] == "e4m3" and spec.config_fields["transformer_impl"] == "transformer_engine"


def test_decoder_block_spec_has_one_layer_spec_per_layer_as_upstream():
    """Upstream's get_gpt_decoder_block_spec returns TransformerBlockSubmodules: `layer_specs` (dense or MoE per
    --moe-layer-freq, for the layers of the stage) and `layer_norm`, the final norm."""
    config = _config(num_layers=4, num_moe_experts=2, moe_router_topk=2, moe_layer_freq=[0, 1, 1, 0],
                     normalization="RMSNorm")
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm")
    assert isinstance(spec, TransformerBlockSubmodules) and spec.layer_norm is torch.nn.RMSNorm
    assert [layer.config_fields["num_moe_experts"] for layer in spec.layer_specs] == [None, 2, 2, None]
    assert all(layer.module is TransformerLayer for layer in spec.layer_specs)
    # Pipeline rank 1 of 2 holds layers 3 and 4 (named by pp_rank, no pipeline group needed).
    staged = _config(num_layers=4, num_moe_experts=2, moe_router_topk=2, moe_layer_freq=[0, 1, 1, 0],
                     pipeline_model_parallel_size=2)
    later = get_gpt_decoder_block_spec(staged, use_transformer_engine=False, pp_rank=1)
    assert [layer.config_fields["num_moe_experts"] for layer in later.layer_specs] == [2, None]
    assert get_gpt_decoder_block_spec(_config(), use_transformer_engine=False).layer_norm is torch.nn.LayerNorm


def test_block_spec_not_matching_the_stage_is_refused_by_name():
    config = _config(num_moe_experts=2, moe_router_topk=2, moe_layer_freq=[0, 1])
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False)
    with pytest.raises(ValueError, match=r"has 1 layer specs but this pipeline stage holds 2 layers"):
        GPTModel(config, TransformerBlockSubmodules(spec.layer_specs[:1], spec.layer_norm), 32, 16)
    swapped = TransformerBlockSubmodules(spec.layer_specs[::-1], spec.layer_norm)
    with pytest.raises(ValueError, match=r"layer_specs\[0\] \(layer 1\) asks for a MoE layer .* --moe-layer-freq"):
        GPTModel(config, swapped, 32, 16)
    with pytest.raises(ValueError, match=r"layer_specs\[1\] asks for qk_layernorm=True"):
        TransformerBlock(config, TransformerBlockSubmodules(
            [spec.layer_specs[0], get_gpt_layer_local_spec(2, qk_layernorm=True)], spec.layer_norm))


def test_block_spec_without_layer_norm_builds_no_final_norm():
    """As upstream, a block spec's layer_norm=None leaves the last stage without a final norm."""
    config = _config(init_seed=5)
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False)
    assert TransformerBlock(config, spec).final_layernorm is not None
    block = TransformerBlock(config, TransformerBlockSubmodules(spec.layer_specs, layer_norm=None))
    assert block.final_layernorm is None
    hidden = torch.randn(3, 2, 12, generator=torch.Generator().manual_seed(0))
    tensor_parallel.model_parallel_cuda_manual_seed(1)
    with torch.no_grad():
        expected, _ = block.layers[1](block.layers[0](hidden)[0])
        torch.testing.assert_close(block(hidden), expected, rtol=0, atol=0)


def test_mtp_block_spec_takes_a_decoder_block_spec():
    """Upstream's pretrain_gpt.py passes the decoder block spec to get_gpt_mtp_block_spec."""
    config = _config(num_moe_experts=2, moe_router_topk=2, moe_layer_freq=[0, 1], mtp_num_layers=1)
    block_spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False)
    mtp_spec = get_gpt_mtp_block_spec(config, block_spec, use_transformer_engine=False)
    assert mtp_spec.config_fields == {"mtp_num_layers": 1, "transformer_impl": "local"}
    with pytest.raises(ValueError, match=r"TransformerConfig\(qk_layernorm=True\)"):
        get_gpt_mtp_block_spec(config, TransformerBlockSubmodules([get_gpt_layer_local_spec(qk_layernorm=True)]),
                               use_transformer_engine=False)


def test_decoder_block_spec_of_a_moe_config_builds_the_model():
    """Upstream's pretrain_gpt.py builds MoE models with get_gpt_decoder_block_spec(config, use_transformer_engine,
    normalization=..., qk_l2_norm=..., vp_stage=...)."""
    config = _config(num_moe_experts=2, moe_router_topk=2, moe_layer_freq=[0, 1], normalization="RMSNorm",
                     init_seed=5)
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm",
                                      qk_l2_norm=False, vp_stage=None)
    assert len(spec.layer_specs) == 2
    with_spec = GPTModel(config, spec, 32, 16)
    without = GPTModel(config, vocab_size=32, max_sequence_length=16)
    assert any(".mlp.router." in name for name in with_spec.state_dict())
    assert with_spec.state_dict().keys() == without.state_dict().keys()
    assert all(torch.equal(a, b) for a, b in zip(with_spec.state_dict().values(), without.state_dict().values()))
    with pytest.raises(ValueError, match=r"TransformerConfig\(transformer_impl='transformer_engine'\)"):
        GPTModel(config, get_gpt_decoder_block_spec(config, use_transformer_engine=True), 32, 16)


def _model_with_default_tensor_parallel_size():
    parallel_state.initialize_model_parallel(2, 1)
    try:
        GPTModel(_config(), get_gpt_layer_local_spec(), 32, 16)
    except ValueError as error:
        return str(error)
    finally:
        parallel_state.destroy_model_parallel()


def test_config_tensor_parallel_size_must_match_the_group():
    for message in run_on_ranks(2, _model_with_default_tensor_parallel_size):
        assert "TransformerConfig(tensor_model_parallel_size=1) differs" in message
        assert "tensor_model_parallel_size=2" in message


def test_transformer_engine_spec_without_transformer_engine_points_to_the_local_spec():
    from megatron.core import optional_deps

    with pytest.raises(ValueError) as refused:
        GPTModel(_config(), get_gpt_layer_with_transformer_engine_spec(), 32, 16)
    hint = "transformer-engine is not importable here (it needs CUDA), so on this machine use get_gpt_layer_local_spec"
    assert (hint in str(refused.value)) == (not optional_deps.HAVE_TE)
    # Other fields keep the plain message.
    with pytest.raises(ValueError) as refused:
        GPTModel(_config(), get_gpt_layer_local_spec(qk_layernorm=True), 32, 16)
    assert "transformer-engine" not in str(refused.value)


def _stage_built_from_its_block_spec():
    parallel_state.initialize_model_parallel(1, 2)
    try:
        config = _config(num_layers=4, num_moe_experts=2, moe_router_topk=2, moe_layer_freq=[1, 0, 0, 1],
                         pipeline_model_parallel_size=2, init_seed=5)
        rank = parallel_state.get_pipeline_model_parallel_rank()
        spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False)
        model = GPTModel(config, spec, 32, 16, pre_process=rank == 0, post_process=rank == 1)
        other_stage = get_gpt_decoder_block_spec(config, use_transformer_engine=False, pp_rank=1 - rank)
        try:
            GPTModel(config, other_stage, 32, 16, pre_process=rank == 0, post_process=rank == 1)
            refused = ""
        except ValueError as error:
            refused = str(error)
        return ([layer.layer_number for layer in model.decoder.layers],
                [hasattr(layer.mlp, "router") for layer in model.decoder.layers], refused)
    finally:
        parallel_state.destroy_model_parallel()


def test_each_pipeline_stage_builds_from_its_own_block_spec():
    first, last = run_on_ranks(2, _stage_built_from_its_block_spec)
    assert first[:2] == ([1, 2], [True, False]) and last[:2] == ([3, 4], [False, True])
    assert "layer_specs[0] (layer 1) asks for a dense layer but" in first[2]
    assert "layer_specs[0] (layer 3) asks for a MoE layer but" in last[2]
