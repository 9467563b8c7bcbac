"""Upstream Megatron-Core's GPTModel keywords: `parallel_output` (TP-split or gathered logits, also while
decoding, overridden per call by `runtime_gather_output`), `fp16_lm_cross_entropy`, `vp_stage`, `mtp_block_spec`
and `scatter_embedding_sequence_parallel`, with clear refusals of the values that cannot work; and the upstream
positional order of `forward`'s parameters."""

import inspect

import pytest
import torch

from megatron.core import parallel_state
from megatron.core.inference.contexts import StaticInferenceContext
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec, get_gpt_mtp_block_spec
from megatron.core.models.gpt.gpt_model import GPTModel
from tests.unit_tests.models.gpt.gpt_test_utils import VOCAB_SIZE, fixed_batch, seeded_model, tiny_config
from tests.unit_tests.multiprocess_harness import run_on_ranks


def _logits_by_parallel_output():
    tokens, labels, positions = fixed_batch()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    with torch.no_grad():
        reference = seeded_model(tiny_config(), parallel_output=True)(tokens, positions)
    parallel_state.destroy_model_parallel()

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    results = {"reference": reference}
    with torch.no_grad():
        for parallel_output in (True, False):
            model = seeded_model(tiny_config(tp=2), parallel_output=parallel_output).eval()
            results[parallel_output] = {
                "logits": model(tokens, positions),
                "gathered": model(tokens, positions, runtime_gather_output=True),
                "local": model(tokens, positions, runtime_gather_output=False),
                "loss": model(tokens, positions, labels=labels),
            }
            context = StaticInferenceContext(max_batch_size=tokens.shape[0], max_sequence_length=tokens.shape[1])
            results[parallel_output]["decoded"] = model(tokens, None, inference_context=context)
    results["tp_rank"] = parallel_state.get_tensor_model_parallel_rank()
    parallel_state.destroy_model_parallel()
    return results


@pytest.mark.parametrize("world_size", [2])
def test_tp2_logits_are_split_with_parallel_output_and_full_without(world_size):
    for results in run_on_ranks(world_size, _logits_by_parallel_output):
        full = results["reference"]
        assert full.shape[-1] == VOCAB_SIZE
        half = VOCAB_SIZE // 2
        own_slice = full[..., results["tp_rank"] * half:(results["tp_rank"] + 1) * half]
        split, gathered = results[True], results[False]
        # parallel_output=True (upstream's default): this rank's half of the vocabulary, forward and decoding.
        assert split["logits"].shape == own_slice.shape
        torch.testing.assert_close(split["logits"], own_slice, atol=1e-5, rtol=0)
        torch.testing.assert_close(split["decoded"], own_slice, atol=1e-5, rtol=0)
        torch.testing.assert_close(split["gathered"], full, atol=1e-5, rtol=0)
        # parallel_output=False: every rank holds all the logits.
        torch.testing.assert_close(gathered["logits"], full, atol=1e-5, rtol=0)
        torch.testing.assert_close(gathered["decoded"], full, atol=1e-5, rtol=0)
        torch.testing.assert_close(gathered["local"], own_slice, atol=1e-5, rtol=0)
        # The per-token loss does not depend on it.
        torch.testing.assert_close(split["loss"], gathered["loss"], atol=0, rtol=0)


def test_fp16_lm_cross_entropy_keeps_the_fp32_loss():
    tokens, labels, positions = fixed_batch()
    losses = [seeded_model(tiny_config(), fp16_lm_cross_entropy=flag)(tokens, positions, labels=labels)
              for flag in (False, True)]
    assert losses[1].dtype == torch.float32
    torch.testing.assert_close(losses[0], losses[1], atol=0, rtol=0)


def test_mtp_block_spec_maps_to_the_config():
    config = tiny_config(mtp_num_layers=1)
    spec = get_gpt_mtp_block_spec(config, get_gpt_layer_local_spec(), use_transformer_engine=False)
    model = seeded_model(config, position_embedding_type="rope", mtp_block_spec=spec,
                         transformer_layer_spec=get_gpt_layer_local_spec())
    assert len(model.mtp.layers) == 1
    assert get_gpt_mtp_block_spec(tiny_config(), get_gpt_layer_local_spec(), use_transformer_engine=False) is None
    with pytest.raises(ValueError, match=r"mtp_block_spec is given but TransformerConfig\(mtp_num_layers\) is unset"):
        seeded_model(tiny_config(), mtp_block_spec=spec)
    with pytest.raises(ValueError, match="mtp_block_spec asks for transformer_impl='transformer_engine'"):
        seeded_model(config, position_embedding_type="rope",
                     mtp_block_spec=get_gpt_mtp_block_spec(config, None, use_transformer_engine=True))


def test_vp_stage_names_a_virtual_stage_of_the_config():
    with pytest.raises(ValueError, match=r"GPTModel\(vp_stage=1\) names a model chunk, but the config has 1 "):
        seeded_model(tiny_config(), vp_stage=1)
    # Without an interleaved pipeline, chunk 0 is the whole stage.
    assert seeded_model(tiny_config(), vp_stage=0).vp_stage == 0


def _vp_stage_layers():
    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2)
    config = tiny_config(pp=2, num_layers=4, virtual_pipeline_model_parallel_size=2)
    rank = parallel_state.get_pipeline_model_parallel_rank()
    offsets = []
    for chunk in (0, 1):
        model = seeded_model(config, vp_stage=chunk,
                             pre_process=parallel_state.is_pipeline_first_stage(vp_stage=chunk),
                             post_process=parallel_state.is_pipeline_last_stage(vp_stage=chunk))
        offsets.append((model.decoder.layer_offset, len(model.decoder.layers)))
    parallel_state.set_virtual_pipeline_model_parallel_rank(0)
    try:
        seeded_model(config, vp_stage=1, pre_process=False, post_process=rank == 1)
    except ValueError as error:
        mismatch = str(error)
    finally:
        parallel_state.set_virtual_pipeline_model_parallel_rank(None)
    parallel_state.destroy_model_parallel()
    return offsets, mismatch


@pytest.mark.parametrize("world_size", [2])
def test_vp_stage_builds_that_virtual_stage(world_size):
    # Chunk c of pipeline rank r is virtual stage c * 2 + r, one layer each.
    results = run_on_ranks(world_size, _vp_stage_layers)
    assert [offsets for offsets, _ in results] == [[(0, 1), (2, 1)], [(1, 1), (3, 1)]]
    assert all("GPTModel(vp_stage=1) while model chunk 0 is being built" in mismatch for _, mismatch in results)


def _scatter_embedding_refusal():
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    config = tiny_config(tp=2, sequence_parallel=True, mtp_num_layers=1)
    try:
        seeded_model(config, scatter_embedding_sequence_parallel=False, position_embedding_type="rope")
    except ValueError as error:
        message = str(error)
    # A stage without the embedding has nothing to scatter.
    middle = seeded_model(config, scatter_embedding_sequence_parallel=False, pre_process=False, post_process=False,
                          position_embedding_type="rope")
    parallel_state.destroy_model_parallel()
    return message, isinstance(middle, GPTModel)


@pytest.mark.parametrize("world_size", [2])
def test_unscattered_embedding_is_refused_with_sequence_parallel_mtp(world_size):
    """The unscattered embedding itself works (see test_gpt_decoder_input_parallel.py); the MTP depths, which
    embed shifted tokens with it, cannot take it."""
    for message, middle_built in run_on_ranks(world_size, _scatter_embedding_refusal):
        assert "which the multi-token-prediction depths (--mtp-num-layers) cannot take: with --sequence-parallel " \
               "keep scatter_embedding_sequence_parallel=True" in message
        assert middle_built
    # Without sequence parallelism the embedding is never scattered: False changes nothing.
    tokens, labels, positions = fixed_batch()
    losses = [seeded_model(tiny_config(), scatter_embedding_sequence_parallel=flag)(tokens, positions, labels=labels)
              for flag in (True, False)]
    torch.testing.assert_close(losses[0], losses[1], atol=0, rtol=0)


def test_loss_mask_keyword_masks_the_mtp_depths_not_the_main_loss():
    tokens, labels, positions = fixed_batch()
    loss_mask = torch.ones_like(labels, dtype=torch.float32)
    loss_mask[0, 2] = loss_mask[1, 5] = 0.0
    model = seeded_model(tiny_config(num_layers=1, mtp_num_layers=2), position_embedding_type="rope")
    with torch.no_grad():
        loss, depth_losses = model(tokens, positions, labels=labels)
        masked_loss, masked_depth_losses = model(tokens, positions, labels=labels, loss_mask=loss_mask)
        plain_model = seeded_model(tiny_config(num_layers=1))
        plain_loss = plain_model(tokens, positions, labels=labels)
        plain_masked = plain_model(tokens, positions, labels=labels, loss_mask=loss_mask)
    # As upstream: the main per-token loss stays unmasked, the loss function applies the mask.
    torch.testing.assert_close(masked_loss, loss, atol=0, rtol=0)
    torch.testing.assert_close(plain_masked, plain_loss, atol=0, rtol=0)
    # Depth k's losses are multiplied by the mask shifted left by k: token (0, 2) is depth 1's (0, 1).
    for depth in (1, 2):
        shifted = torch.cat([loss_mask[:, depth:], torch.zeros(labels.shape[0], depth)], dim=1)
        torch.testing.assert_close(masked_depth_losses[depth - 1], depth_losses[depth - 1] * shifted, atol=0, rtol=0)
    assert masked_depth_losses[0, 0, 1] == 0 and depth_losses[0, 0, 1] > 0
    with pytest.raises(ValueError, match=r"loss_mask has shape \(2, 7\) but labels have \(2, 8\)"):
        model(tokens, positions, labels=labels, loss_mask=loss_mask[:, 1:])


def test_upstream_forward_keywords_left_at_none_and_refused_otherwise():
    tokens, labels, positions = fixed_batch()
    model = seeded_model(tiny_config(num_layers=1))
    with torch.no_grad():
        loss = model(tokens, positions, None, labels=labels)
        same = model(tokens, positions, None, labels=labels, decoder_input=None, packed_seq_params=None,
                     extra_block_kwargs=None)
    torch.testing.assert_close(same, loss, atol=0, rtol=0)
    with pytest.raises(ValueError, match=r"forward\(extra_block_kwargs=\['foo'\]\) is not supported"):
        model(tokens, positions, labels=labels, extra_block_kwargs={"foo": 1})


UPSTREAM_POSITIONAL_PARAMETERS = ["input_ids", "position_ids", "attention_mask", "decoder_input", "labels",
                                  "inference_context", "packed_seq_params", "extra_block_kwargs",
                                  "runtime_gather_output"]


def test_forward_takes_upstreams_positional_order():
    parameters = list(inspect.signature(GPTModel.forward).parameters.values())[1:]
    positional = [p.name for p in parameters if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]
    assert positional == UPSTREAM_POSITIONAL_PARAMETERS
    assert [p.name for p in parameters if p.kind is inspect.Parameter.KEYWORD_ONLY] == ["inference_params",
                                                                                         "loss_mask"]
    assert all(p.default is None for p in parameters[3:])

    tokens, labels, positions = fixed_batch()
    seq = tokens.shape[1]
    mask = torch.ones(seq, seq, dtype=torch.bool).triu(1)  # causal, True where masked
    mask[3:, 2] = True  # and key 2 hidden from the later queries, so the mask shows in the loss
    model = seeded_model(tiny_config(num_layers=1)).eval()
    with torch.no_grad():
        by_keyword = model(tokens, positions, mask, labels=labels)
        upstream_positional = model(tokens, positions, mask, None, labels)
        unmasked = model(tokens, positions, None, None, labels)
        contexts = [StaticInferenceContext(max_batch_size=tokens.shape[0], max_sequence_length=seq)
                    for _ in range(2)]
        decoded_by_keyword = model(tokens, None, inference_context=contexts[0], runtime_gather_output=True)
        decoded_positional = model(tokens, None, None, None, None, contexts[1], None, None, True)
    assert by_keyword.shape == labels.shape
    torch.testing.assert_close(upstream_positional, by_keyword, atol=0, rtol=0)
    assert not torch.allclose(unmasked, by_keyword)
    torch.testing.assert_close(decoded_positional, decoded_by_keyword, atol=0, rtol=0)
    # The old order (labels fourth) now lands on decoder_input, refused with the way out.
    with pytest.raises(ValueError, match=r"decoder_input has shape \(2, 8\), not \[s, b, 32\]: .* it is forward's "
                                         r"fourth positional argument; pass labels by keyword"):
        model(tokens, positions, mask, labels)


@pytest.mark.parametrize("position_embedding_type", ["learned_absolute", "rope"])
def test_decoder_input_replaces_the_embedding(position_embedding_type):
    tokens, labels, positions = fixed_batch()
    model = seeded_model(tiny_config(num_layers=1), position_embedding_type=position_embedding_type).eval()
    with torch.no_grad():
        embedded = model.embedding(tokens, positions)
        loss = model(tokens, positions, labels=labels)
        from_embedding = model(None, None, None, embedded, labels)
        from_other_input = model(None, None, None, embedded.flip(0), labels)
        other_input_with_tokens = model(tokens, positions, decoder_input=embedded.flip(0), labels=labels)
    torch.testing.assert_close(from_embedding, loss, atol=0, rtol=0)
    assert not torch.allclose(from_other_input, loss)
    torch.testing.assert_close(other_input_with_tokens, from_other_input, atol=0, rtol=0)


def test_decoder_input_refusals():
    tokens, labels, positions = fixed_batch()
    model = seeded_model(tiny_config(num_layers=1))
    embedded = model.embedding(tokens, positions)
    with pytest.raises(ValueError, match=r"decoder_input has shape \(7, 2, 32\) but input_ids \(2, 8\) embed to "
                                         r"\[8, 2, 32\]"):
        model(tokens, positions, None, embedded[1:], labels)
    context = StaticInferenceContext(max_batch_size=tokens.shape[0], max_sequence_length=tokens.shape[1])
    with pytest.raises(ValueError, match=r"decoding \(inference_context\) embeds the input_ids; pass them instead "
                                         "of decoder_input"):
        model(tokens, None, decoder_input=embedded, inference_context=context)
    later_stage = seeded_model(tiny_config(num_layers=1), pre_process=False)
    later_stage.set_input_tensor(embedded)
    with pytest.raises(ValueError, match=r"this pipeline stage is not the first; decoder_input replaces the "
                                         r"embedding output \[s, b, h\] on the first pipeline stage"):
        later_stage(tokens, positions, None, embedded, labels)
