"""examples/inference/gpt/gpt_dynamic_inference.py: upstream's `--inference-dynamic-batching-*` flags and defaults,
what it refuses, and the engine it builds, whose greedy tokens are the static generation's."""

import pytest

from examples.inference.gpt.gpt_dynamic_inference import add_dynamic_inference_args, build_engine, check_args
from megatron.core import parallel_state
from megatron.core.inference.sampling_params import SamplingParams
from megatron.core.inference.static_generation import generate_in_batches
from megatron.training.arguments import build_parser
from tests.unit_tests.inference.test_dynamic_engine import _model
from tests.unit_tests.inference.test_static_engine import TOKENIZER
from tests.unit_tests.models.gpt.gpt_test_utils import VOCAB_SIZE
from tests.unit_tests.multiprocess_harness import run_on_ranks


def _parse(argv):
    return build_parser(add_dynamic_inference_args).parse_args(argv)


def test_upstream_dynamic_batching_flags_and_defaults():
    args = _parse(["--prompts", "def "])
    assert args.inference_dynamic_batching_buffer_size_gb == 40.0
    assert args.inference_dynamic_batching_chunk_size == 256
    assert args.inference_dynamic_batching_buffer_guaranteed_fraction == 0.2
    assert args.inference_dynamic_batching_buffer_overflow_factor is None
    assert args.inference_dynamic_batching_max_requests_override is None
    assert args.inference_dynamic_batching_max_tokens_override is None
    assert (args.num_tokens_to_generate, args.top_k, args.inference_max_requests) == (30, 1, 8)  # the static flags


@pytest.mark.parametrize("flags, message", [
    (["--stream"], "--stream is not supported with continuous batching"),
])
def test_what_needs_the_static_example_is_refused_by_flag(flags, message):
    args = _parse(["--prompts", "def ", "--load", "ckpt", *flags])
    with pytest.raises(ValueError, match=message):
        check_args(args)


def _engine_against_static_generation():
    parallel_state.initialize_model_parallel()
    try:
        model = _model()
        args = _parse(["--prompts", "x", "--inference-dynamic-batching-chunk-size", "4",
                       "--inference-dynamic-batching-max-requests-override", "2", "--seed", "3"])
        args.padded_vocab_size = VOCAB_SIZE
        engine = build_engine(args, model, TOKENIZER, max_sequence_length=16)
        prompts = [[3, 14, 15, 9, 2], [6, 5], [35, 8, 9]]
        params = SamplingParams(top_k=1, num_tokens_to_generate=5)
        dynamic = [request.generated_tokens for request in engine.generate(prompts, params)]
        static = [result.generated_tokens for result in generate_in_batches(
            model, prompts, params, eod_id=TOKENIZER.eod, max_sequence_length=16, max_batch_size=2,
            vocab_size=TOKENIZER.vocab_size, seed=3)]
        context = engine.context
        return dynamic, static, (context.num_chunks, context.max_requests, context.chunk_size_tokens)
    finally:
        parallel_state.destroy_model_parallel()


def test_the_engine_built_from_the_flags_decodes_the_static_tokens():
    dynamic, static, sizes = run_on_ranks(1, _engine_against_static_generation)[0]
    assert dynamic == static and len({tuple(tokens) for tokens in dynamic}) == 3
    assert sizes == (8, 2, 4)  # 2 requests x 16 positions in chunks of 4: the 40 GB default is not allocated


def test_the_context_counts_the_layers_that_cache_keys_and_values():
    from examples.inference.gpt.gpt_dynamic_inference import cached_layers
    from megatron.core.models.mamba import MambaModel
    from tests.unit_tests.models.gpt.gpt_test_utils import tiny_config

    hybrid = MambaModel(tiny_config(num_layers=4, mamba_head_dim=8, mamba_num_groups=2, mamba_state_dim=4),
                        vocab_size=VOCAB_SIZE, max_sequence_length=16, hybrid_override_pattern="M*M-")
    assert cached_layers(hybrid) == 1  # one attention layer; the Mamba and MLP layers keep no keys or values
    assert cached_layers(_model()) == _model().config.num_layers


def test_the_context_counts_a_heterogeneous_models_caching_layers_and_their_most_heads():
    from examples.inference.gpt.gpt_dynamic_inference import cached_key_value_heads, cached_layers
    from tests.unit_tests.inference.test_dynamic_engine import _model as heterogeneous_model

    model = heterogeneous_model(hybrid="heterogeneous")  # 2 heads, a linear stand-in, 4 heads
    assert cached_layers(model) == 2 and cached_key_value_heads(model) == 4
    assert cached_key_value_heads(_model()) == _model().config.num_query_groups


def _stored_mamba_bytes():
    """(the bytes one request's Mamba states take in the context after a step, what the script budgets for them)."""
    from examples.inference.gpt.gpt_dynamic_inference import mamba_state_bytes
    from megatron.core.inference.sampling_params import SamplingParams
    from tests.unit_tests.inference.test_dynamic_engine import _context, _engine
    from tests.unit_tests.inference.test_dynamic_engine import _model as engine_model

    parallel_state.initialize_model_parallel()
    try:
        model = engine_model(hybrid=True)  # Mamba, attention, Mamba
        engine = _engine(model, _context(model))
        engine.add_request("r", "1 2 3", sampling_params=SamplingParams(top_k=1, num_tokens_to_generate=4))
        engine.step()
        stored = sum(tensor.numel() * tensor.element_size() for (layer, request), states
                     in engine.context.mamba_memory.items() if request == "r" for tensor in states)
        return stored, mamba_state_bytes(model), mamba_state_bytes(_model())
    finally:
        parallel_state.destroy_model_parallel()


def test_the_context_budgets_the_bytes_a_requests_mamba_states_take():
    stored, budgeted, gpt = run_on_ranks(1, _stored_mamba_bytes)[0]
    assert stored == budgeted > 0 and gpt == 0
