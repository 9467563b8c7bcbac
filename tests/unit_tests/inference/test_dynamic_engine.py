"""Continuous batching (`DynamicInferenceEngine` over a `DynamicInferenceContext`): requests of different lengths
that come and go between steps each decode the greedy tokens of full forwards without a cache, within the
context's limits on requests, step tokens and memory; seeded sampling repeats; tensor parallelism gives the
one-rank tokens; and what is not supported is refused by name."""

import json

import pytest
import torch

from megatron.core import parallel_state
from megatron.core.inference.contexts import DynamicInferenceContext
from megatron.core.inference.engines import DynamicInferenceEngine
from megatron.core.inference.inference_request import Status
from megatron.core.inference.model_inference_wrappers.gpt.gpt_inference_wrapper import GPTInferenceWrapper
from megatron.core.inference.model_inference_wrappers.inference_wrapper_config import InferenceWrapperConfig
from megatron.core.inference.sampling_params import SamplingParams
from megatron.core.inference.text_generation_controllers.text_generation_controller import TextGenerationController
from tests.unit_tests.inference.test_static_engine import PROMPTS, TOKENIZER, _full_forward_greedy
from tests.unit_tests.models.gpt.gpt_test_utils import VOCAB_SIZE, seeded_model, tiny_config
from tests.unit_tests.multiprocess_harness import run_on_ranks

GREEDY = SamplingParams(top_k=1, num_tokens_to_generate=4)


# A hybrid model's layers: Mamba, attention, Mamba (each request keeps its own scan state).
HYBRID = dict(num_layers=3, hybrid_layer_pattern="M*M", mamba_head_dim=8, mamba_num_groups=2, mamba_state_dim=4,
              mamba_chunk_size=4)
# A heterogeneous model's layers: 2 key/value heads, a linear for the attention, 4 key/value heads.
HETEROGENEOUS = dict(num_layers=3, heterogeneous_layers_config_encoded_json=json.dumps({"block_configs": [
    {"attention": {"n_heads_in_group": 2}, "ffn": {"ffn_mult": 2.0}},
    {"attention": {"replace_with_linear": True}, "ffn": {"no_op": True}},
    {"attention": {"n_heads_in_group": 1}, "ffn": {"replace_with_linear": True}}]}))


def _model(tp=1, pp=1, hybrid=False):
    """A tiny GPT (this rank's pipeline stage of it) whose greedy continuations vary (at the default init they
    repeat the last prompt token); `hybrid`: True for a hybrid model of Mamba and attention layers, "heterogeneous"
    for layers of their own shapes."""
    stage = {} if pp == 1 else dict(pre_process=parallel_state.is_pipeline_first_stage(),
                                    post_process=parallel_state.is_pipeline_last_stage())
    shape = HETEROGENEOUS if hybrid == "heterogeneous" else HYBRID if hybrid else {}
    return seeded_model(tiny_config(tp=tp, pp=pp, num_query_groups=2, init_method_std=0.5, **shape),
                        position_embedding_type="none" if hybrid is True else "rope",
                        share_embeddings_and_output_weights=False, **stage).eval()


def _context(model, max_requests=2, chunk_size=4, buffer_chunks=6, max_tokens=None):
    config = model.config
    # Enough for the most key/value heads of any layer (a heterogeneous model's layer 3 has 4).
    heads = 4 if config.is_heterogeneous else config.num_query_groups
    chunk_bytes = 2 * config.num_layers * chunk_size * heads * config.kv_channels * 4
    return DynamicInferenceContext(params_dtype=torch.float32, num_layers=config.num_layers,
                                   kv_channels=config.kv_channels, num_attention_heads=heads,
                                   max_sequence_length=16, buffer_size_gb=buffer_chunks * chunk_bytes / 1024**3,
                                   chunk_size_tokens=chunk_size, max_requests_override=max_requests,
                                   max_tokens_override=max_tokens,
                                   tensor_model_parallel_size=config.tensor_model_parallel_size)


def _engine(model, context, **kwargs):
    wrapper_config = InferenceWrapperConfig(hidden_size=32, inference_batch_times_seqlen_threshold=-1,
                                            padded_vocab_size=VOCAB_SIZE, params_dtype=torch.float32,
                                            inference_max_requests=8, inference_max_seq_length=16)
    controller = TextGenerationController(GPTInferenceWrapper(model, wrapper_config, context), TOKENIZER)
    return DynamicInferenceEngine(controller, context, **kwargs)


def _continuous_batching(tp, pp=1, hybrid=False):
    """Five requests through a context of 2 requests, 6 chunks of 4 positions and 8 tokens a step, one of them added
    after two steps; returns what each produced and what the context held along the way."""
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    try:
        model = _model(tp, pp, hybrid)
        context = _context(model, max_tokens=8)
        engine = _engine(model, context, random_seed=1)
        prompts = PROMPTS + ["7 7 7 1"]
        lengths = [4, 6, 3, 5]
        for request_id, (prompt, length) in enumerate(zip(prompts, lengths)):
            engine.add_request(request_id, prompt, num_tokens_to_generate=length, sampling_params=GREEDY)
        seen, done, steps = [], [], 0
        while engine.has_unfinished_requests():
            active, finished, _ = engine.step()
            steps += 1
            if steps == 2:
                engine.add_request("late", "2 4 6", sampling_params=GREEDY)
            seen.append((len(active) + len(finished), len(context.free_chunks)))
            done += finished
        requests = {request.request_id: (request.prompt_tokens, request.generated_tokens, request.status,
                                         request.stopped_at_eod, request.generated_text) for request in done}
        return requests, seen, [request.request_id for request in done], len(context.free_chunks), \
            context.num_chunks, steps
    finally:
        parallel_state.destroy_model_parallel()


@pytest.fixture(scope="module")
def one_rank():
    return run_on_ranks(1, _continuous_batching, 1)[0]


def test_each_request_decodes_the_greedy_tokens_of_full_forwards(one_rank):
    requests, _, finished_order, _, _, _ = one_rank
    assert sorted(requests, key=str) == sorted([0, 1, 2, 3, "late"], key=str)
    parallel = run_on_ranks(1, _greedy_references, {key: value[0] for key, value in requests.items()},
                            {0: 4, 1: 6, 2: 3, 3: 5, "late": 4})[0]
    for request_id, (prompt_tokens, generated, status, stopped_at_eod, text) in requests.items():
        assert status == Status.COMPLETED and stopped_at_eod is False
        assert generated == parallel[request_id], request_id
        assert text == TOKENIZER.detokenize(generated)
    assert set(finished_order) == set(requests) and len(finished_order) == 5


def _greedy_references(prompt_tokens, lengths, hybrid=False):
    parallel_state.initialize_model_parallel()
    try:
        model = _model(hybrid=hybrid)
        return {request_id: _full_forward_greedy(model, tokens, lengths[request_id])[0]
                for request_id, tokens in prompt_tokens.items()}
    finally:
        parallel_state.destroy_model_parallel()


@pytest.mark.parametrize("layers", [True, "heterogeneous"], ids=["hybrid", "heterogeneous"])
def test_hybrid_and_heterogeneous_models_requests_each_continue_their_own_state(layers):
    """Requests that come and go through 2 slots: each Mamba layer continues every request from the state the
    context kept for it, and a heterogeneous model's layers cache keys and values of their own head counts (its
    linear stand-in none), so each decodes the greedy tokens of full forwards; the states go with the requests."""
    requests, *_ = run_on_ranks(1, _continuous_batching, 1, 1, layers)[0]
    references = run_on_ranks(1, _greedy_references, {key: value[0] for key, value in requests.items()},
                              {0: 4, 1: 6, 2: 3, 3: 5, "late": 4}, layers)[0]
    for request_id, (_, generated, status, stopped_at_eod, _) in requests.items():
        # A request that reaches the end-of-document token stops there; full forwards go on past it.
        expected = references[request_id]
        if stopped_at_eod:
            expected = expected[:expected.index(TOKENIZER.eod) + 1]
        assert status == Status.COMPLETED and generated == expected, request_id
    assert sum(len(value[1]) for value in requests.values()) > 10
    tp2, *_ = run_on_ranks(2, _continuous_batching, 2, 1, layers)[0]
    assert {key: value[1] for key, value in tp2.items()} == {key: value[1] for key, value in requests.items()}


def test_the_context_bounds_the_requests_and_gives_the_memory_back(one_rank):
    _, seen, _, free_at_end, num_chunks, steps = one_rank
    assert num_chunks == 6 and free_at_end == 6
    assert all(count <= 2 for count, _ in seen)  # max_requests_override
    assert any(count == 2 for count, _ in seen) and min(free for _, free in seen) < 6
    assert steps > 6  # two at a time: the requests queued for room


@pytest.mark.parametrize("layout", ["tp2", "pp2"])
def test_tensor_and_pipeline_parallel_ranks_decode_the_one_rank_tokens(layout, one_rank):
    sizes = (2, 1) if layout == "tp2" else (1, 2)
    for requests, *_ in run_on_ranks(2, _continuous_batching, *sizes):
        assert {key: value[1] for key, value in requests.items()} == {key: value[1] for key, value in
                                                                      one_rank[0].items()}


def _steps_against_full_forwards():
    """Two steps through the model and a context directly: (1) the prompts of requests a and b, (2) one more token
    of each and the prompt of c. Returns the largest difference of each request's last-row logits from a full
    forward over its tokens so far, per step."""
    parallel_state.initialize_model_parallel()
    try:
        model = _model()
        context = _context(model, max_requests=3, buffer_chunks=8)
        sequences = {"a": [3, 14, 15, 9, 2], "b": [6, 5], "c": [35, 8, 9]}
        errors = []
        for entries in ([("a", 5), ("b", 2)], [("a", 1), ("b", 1), ("c", 3)]):
            for request_id, count in entries:
                if request_id not in context.request_chunks:
                    context.allocate(request_id, 8)
                elif count == 1:
                    sequences[request_id].append(41 + len(sequences[request_id]))
            tokens = [token for request_id, count in entries for token in sequences[request_id][-count:]]
            context.initialize_step(entries)
            with torch.no_grad():
                logits = model(torch.tensor([tokens]), None, None, inference_context=context,
                               runtime_gather_output=True)
                rows = context.last_token_rows()
                context.finish_step()
                for (request_id, _), row in zip(entries, rows):
                    sequence = torch.tensor([sequences[request_id]])
                    full = model(sequence, torch.arange(sequence.shape[1])[None])[0, -1]
                    errors.append((logits[0, row] - full).abs().max().item())
        return errors, full.abs().max().item()
    finally:
        parallel_state.destroy_model_parallel()


def test_a_step_of_several_requests_gives_each_the_logits_of_its_full_forward():
    errors, scale = run_on_ranks(1, _steps_against_full_forwards)[0]
    assert len(errors) == 5 and max(errors) < 1e-5 * max(scale, 1.0), errors


def _termination_sampling_and_refusals():
    parallel_state.initialize_model_parallel()
    try:
        model = _model()
        results = {}
        # A termination id met at the second token ends the request there, keeping it as its last token.
        (greedy,) = _engine(model, _context(model)).generate(["35 8 9"], SamplingParams(top_k=1,
                                                                                     num_tokens_to_generate=6))
        stop = greedy.generated_tokens[1]
        (stopped,) = _engine(model, _context(model), termination_id=stop).generate(
            ["35 8 9"], SamplingParams(top_k=1, num_tokens_to_generate=6))
        results["termination"] = (greedy.generated_tokens, stopped.generated_tokens, stopped.stopped_at_eod,
                                  stopped.generated_text, TOKENIZER.detokenize(greedy.generated_tokens[:1]))
        sampled = SamplingParams(temperature=1.5, num_tokens_to_generate=5)
        results["seeded"] = [[request.generated_tokens for request in _engine(
            model, _context(model), random_seed=7).generate(PROMPTS, sampled)] for _ in range(2)]
        refusals = {}
        cases = {
            "top-n past the vocabulary": lambda: _engine(model, _context(model)).add_request(
                0, "1 2", sampling_params=SamplingParams(top_k=1, num_tokens_to_generate=2, top_n_logprobs=99)),
            "too long": lambda: _engine(model, _context(model)).add_request(
                0, "1 2 3 4 5 6 7 8 9 10 11 12 13 14", sampling_params=GREEDY),
            "cuda graph": lambda: _engine(model, _context(model), enable_cuda_graph=True),
            "busy generate": lambda: _busy(model),
            "multi-latent attention": lambda: _engine(*(lambda mla: (mla, _context(mla)))(seeded_model(tiny_config(
                multi_latent_attention=True, kv_lora_rank=12, qk_head_dim=6, qk_pos_emb_head_dim=16, v_head_dim=10),
                position_embedding_type="none"))),
        }
        for name, call in cases.items():
            try:
                call()
                refusals[name] = None
            except (ValueError, RuntimeError) as error:
                refusals[name] = str(error)
        results["refusals"] = refusals
        return results
    finally:
        parallel_state.destroy_model_parallel()


def _busy(model):
    engine = _engine(model, _context(model))
    engine.add_request("pending", "1 2", sampling_params=GREEDY)
    engine.generate(["3 4"], GREEDY)


def test_termination_seeded_sampling_and_refusals():
    results = run_on_ranks(1, _termination_sampling_and_refusals)[0]
    greedy, stopped, stopped_at_eod, text, first_text = results["termination"]
    assert greedy[0] != greedy[1]  # the second token is the first to meet the termination id
    assert stopped == greedy[:2] and stopped_at_eod is True and text == first_text
    first, second = results["seeded"]
    assert first == second and len({tuple(tokens) for tokens in first}) == 3
    refusals = results["refusals"]
    assert "--top-n-logprobs 99 exceeds the vocabulary size 64" in refusals["top-n past the vocabulary"]
    assert "exceed the context's max_sequence_length 16" in refusals["too long"]
    assert "CUDA graphs are not supported here" in refusals["cuda graph"]
    assert "generate runs its prompts alone" in refusals["busy generate"]
    assert "multi-latent attention is not supported with continuous batching" in refusals["multi-latent attention"]


def _log_probs_against_full_forwards():
    """Requests with `return_log_probs` (one skipping its prompt's) decoded together, and the log-softmax of full
    forwards over their prompt and generated tokens."""
    parallel_state.initialize_model_parallel()
    try:
        model = _model()
        engine = _engine(model, _context(model, max_requests=3, buffer_chunks=9))
        with_prompt = SamplingParams(top_k=1, num_tokens_to_generate=4, return_log_probs=True, top_n_logprobs=3,
                                     return_prompt_top_n_logprobs=True, return_segments=True)
        without_prompt = SamplingParams(top_k=1, num_tokens_to_generate=3, return_log_probs=True,
                                        skip_prompt_log_probs=True)
        requests = [engine.add_request(0, PROMPTS[0], sampling_params=with_prompt),
                    engine.add_request(1, PROMPTS[1], sampling_params=without_prompt),
                    engine.add_request(2, PROMPTS[2], sampling_params=GREEDY)]
        while engine.has_unfinished_requests():
            engine.step()
        expected = [_full_forward_greedy(model, request.prompt_tokens, len(request.generated_tokens))
                    for request in requests]
        sequence = torch.tensor([requests[0].prompt_tokens + requests[0].generated_tokens])
        with torch.no_grad():
            logits = model(sequence, torch.arange(sequence.shape[1])[None])[0, :-1, :TOKENIZER.vocab_size]
            full = torch.log_softmax(logits, -1)
        top_n = torch.topk(full, 3)
        first = requests[0]
        return [(request.prompt_log_probs, request.generated_log_probs, request.generated_tokens) for request in
                requests], [(tokens, log_probs.tolist()) for tokens, log_probs in expected], (
            first.prompt_top_n_logprobs, first.generated_top_n_logprobs, first.segments, first.generated_text,
            top_n.values.tolist(), top_n.indices.tolist(), requests[2].generated_top_n_logprobs)
    finally:
        parallel_state.destroy_model_parallel()


def test_log_probabilities_are_those_of_full_forwards():
    results, expected, top_n = run_on_ranks(1, _log_probs_against_full_forwards)[0]
    (prompt_0, generated_0, tokens_0), (prompt_1, generated_1, tokens_1), (prompt_2, generated_2, _) = results
    assert tokens_0 == expected[0][0] and tokens_1 == expected[1][0]
    prompt_length = len(expected[0][1]) - len(generated_0)
    torch.testing.assert_close(torch.tensor(prompt_0 + generated_0), torch.tensor(expected[0][1]), rtol=0,
                               atol=1e-5)
    assert len(prompt_0) == prompt_length == 4  # "3 14 15 9 2": every prompt token after the first
    assert prompt_1 is None
    torch.testing.assert_close(torch.tensor(generated_1), torch.tensor(expected[1][1][-3:]), rtol=0, atol=1e-5)
    assert prompt_2 is None and generated_2 is None  # not asked
    # Top-3 of every row after the first (4 prompt rows, then the 4 generated tokens'), keyed by each token's text.
    prompt_top, generated_top, segments, text, values, ids, not_asked = top_n
    assert len(prompt_top) == 4 and len(generated_top) == 4 and not_asked is None
    for row, entry in enumerate(prompt_top + generated_top):
        assert list(entry) == [TOKENIZER.detokenize([token]) for token in ids[row]]
        torch.testing.assert_close(torch.tensor(list(entry.values())), torch.tensor(values[row]), rtol=0, atol=1e-5)
    assert "".join(segments) == text and len(segments) == 4



def _log_probs_under_pipeline_parallelism():
    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=2)
    try:
        model = _model(pp=2)
        with pytest.raises(ValueError, match="computed on the last pipeline stage only") as refused:
            _engine(model, _context(model)).add_request(
                0, "1 2", sampling_params=SamplingParams(top_k=1, num_tokens_to_generate=2, return_log_probs=True))
        return str(refused.value)
    finally:
        parallel_state.destroy_model_parallel()


def test_log_probabilities_under_pipeline_parallelism_are_refused_on_every_rank():
    assert all("StaticInferenceEngine" in message for message in run_on_ranks(2, _log_probs_under_pipeline_parallelism))
