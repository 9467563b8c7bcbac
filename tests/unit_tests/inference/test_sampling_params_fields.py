"""Upstream's `SamplingParams` fields on the static engine: `skip_prompt_log_probs`, `num_tokens_total`,
`return_segments` and `add_BOS`, each against the engine's output without it."""

import pytest
import torch

from megatron.core import parallel_state
from megatron.core.inference.sampling_params import SamplingParams
from megatron.training.tokenizer.null_tokenizer import NullTokenizer
from tests.unit_tests.inference.test_static_engine import PROMPTS, TOKENIZER, _engine
from tests.unit_tests.models.gpt.gpt_test_utils import VOCAB_SIZE, seeded_model, tiny_config
from tests.unit_tests.multiprocess_harness import run_on_ranks


class _TokenizerWithBOS(NullTokenizer):
    bos = 62


def _outputs():
    parallel_state.initialize_model_parallel()
    model = seeded_model(tiny_config(num_query_groups=2), position_embedding_type="rope").eval()
    engine = _engine(model)

    def generate(prompts=PROMPTS, tokenizer=TOKENIZER, **params):
        return _engine(model, tokenizer=tokenizer).generate(prompts=prompts,
                                                            sampling_params=SamplingParams(top_k=1, **params))
    return {
        "plain": generate(num_tokens_to_generate=4, return_log_probs=True),
        "skip": generate(num_tokens_to_generate=4, return_log_probs=True, skip_prompt_log_probs=True),
        "total": [generate(prompts=[prompt], num_tokens_total=len(prompt.split()) + 4)[0] for prompt in PROMPTS],
        "segments": generate(num_tokens_to_generate=4, return_segments=True),
        "bos": generate(tokenizer=_TokenizerWithBOS(VOCAB_SIZE - 1), num_tokens_to_generate=2, add_BOS=True),
        "engine_bos": _engine(model, tokenizer=_TokenizerWithBOS(VOCAB_SIZE - 1)).generate(
            prompts=PROMPTS, add_BOS=True, sampling_params=SamplingParams(top_k=1, num_tokens_to_generate=2)),
        "total_too_short": _error(engine, SamplingParams(top_k=1, num_tokens_total=5)),
    }


def _error(engine, params):
    with pytest.raises(ValueError) as error:
        engine.generate(prompts=PROMPTS, sampling_params=params)
    return str(error.value)


@pytest.fixture(scope="module")
def outputs():
    (result,) = run_on_ranks(1, _outputs)
    return result


def test_skip_prompt_log_probs_drops_exactly_the_prompt_entries(outputs):
    for plain, skip in zip(outputs["plain"], outputs["skip"]):
        assert skip.prompt_log_probs is None and skip.generated_tokens == plain.generated_tokens
        torch.testing.assert_close(torch.tensor(skip.generated_log_probs), torch.tensor(plain.generated_log_probs))


def test_num_tokens_total_counts_the_prompt(outputs):
    assert [r.generated_tokens for r in outputs["total"]] == [r.generated_tokens for r in outputs["plain"]]
    assert outputs["total_too_short"] == ("prompt 0 is 5 tokens long, not shorter than num_tokens_total 5 (prompt "
                                          "plus generated tokens): raise num_tokens_total or shorten the prompt")


def test_segments_concatenate_to_the_generated_text(outputs):
    for request in outputs["segments"]:
        assert len(request.segments) == 4 and "".join(request.segments) == request.generated_text
        assert request.segments[0] == f"{request.generated_tokens[0]} "


def test_add_bos_in_sampling_params_prepends_the_tokenizers_bos(outputs):
    for request, by_engine, prompt in zip(outputs["bos"], outputs["engine_bos"], PROMPTS):
        assert request.prompt_tokens == [62] + [int(token) for token in prompt.split()]
        assert request.generated_tokens == by_engine.generated_tokens


def test_only_one_length_may_be_set():
    assert SamplingParams().num_tokens_to_generate == 30
    assert SamplingParams(num_tokens_total=9).num_tokens_to_generate is None
    with pytest.raises(ValueError, match="num_tokens_to_generate 8 and num_tokens_total 9: set exactly one of them"):
        SamplingParams(num_tokens_to_generate=8, num_tokens_total=9)
    params = SamplingParams()
    params.add_attributes({"num_tokens_to_generate": None, "num_tokens_total": 12})
    params.check()
    assert params.tokens_to_generate(5) == 7
