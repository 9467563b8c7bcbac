"""`StopSequencesModel` through `run_job` (a job's `stop_sequences`): each row of a batch stops right after its
generated tokens first end with a stop sequence (the end-of-document token then forced), a stop sequence in the
prompt stops nothing, and PP2 stops where one rank does."""

import pytest

from megatron.core import parallel_state
from megatron.core.inference.sampling_params import SamplingParams
from megatron.inference.text_generation import GenerationJob, GenerationLimits, run_job
from tests.unit_tests.models.gpt.gpt_test_utils import seeded_model, tiny_config
from tests.unit_tests.multiprocess_harness import run_on_ranks

PROMPTS = [[3, 14, 15, 9, 2], [6, 5]]
EOD = 60
LIMITS = GenerationLimits(eod_id=EOD, vocab_size=EOD + 1, max_sequence_length=24, max_batch_size=2)
NUM_TOKENS = 10


def _model(pp=1):
    stage = {}
    if pp > 1:
        stage = dict(pre_process=parallel_state.is_pipeline_first_stage(),
                     post_process=parallel_state.is_pipeline_last_stage())
    return seeded_model(tiny_config(pp=pp, num_query_groups=2), position_embedding_type="rope", **stage)


def _generated(model, stop_sequences=(), temperature=None):
    params = SamplingParams(top_k=1, num_tokens_to_generate=NUM_TOKENS) if temperature is None else \
        SamplingParams(temperature=temperature, num_tokens_to_generate=NUM_TOKENS)
    job = GenerationJob(prompt_tokens=PROMPTS, sampling_params=params, seed=4, logprobs=False,
                        stop_sequences=stop_sequences)
    return [result.generated_tokens for result in run_job(model, job, LIMITS)]


def _stopped(generated, stop_sequences):
    """`generated` cut right after it first ends with a stop sequence, then the end-of-document token."""
    for end in range(1, len(generated) + 1):
        if any(tuple(generated[max(0, end - len(stop)):end]) == stop for stop in stop_sequences):
            return generated[:end] + [EOD]
    return generated


def _stops_from(greedy):
    """Stop sequences the greedy rows generate: the first row's tokens 3 and 4, and the second row's token 6."""
    return (tuple(greedy[0][3:5]), (greedy[1][6],))


def _generations(pp):
    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=pp)
    model = _model(pp)
    greedy = _generated(model)
    outputs = {"greedy": greedy, "stopped": _generated(model, _stops_from(greedy)),
               "sampled": _generated(model, temperature=2.0)}
    outputs["sampled_stopped"] = _generated(model, _stops_from(outputs["sampled"]), temperature=2.0)
    parallel_state.destroy_model_parallel()
    return outputs


def test_each_row_stops_after_its_first_stop_sequence():
    model = _model()
    greedy = _generated(model)
    assert all(EOD not in row and len(row) == NUM_TOKENS for row in greedy)
    stops = _stops_from(greedy)
    stopped = _generated(model, stops)
    assert stopped == [_stopped(row, stops) for row in greedy]
    assert all(row[-1] == EOD and len(row) <= 8 for row in stopped) and stopped[0][-3:] == [*stops[0], EOD]
    # The prompts' own last tokens stop nothing: only generated tokens are matched.
    assert _generated(model, (tuple(PROMPTS[0][-2:]), (PROMPTS[1][-1],))) == \
        [_stopped(row, (tuple(PROMPTS[0][-2:]), (PROMPTS[1][-1],))) for row in greedy]


def _one_rank_then_pp2():
    return _generations(1), _generations(2)


@pytest.mark.parametrize("world_size", [2])
def test_pp2_stops_where_one_rank_does(world_size):
    (one_rank, pp2), _ = run_on_ranks(world_size, _one_rank_then_pp2)
    assert pp2 == one_rank
    assert one_rank["stopped"] == [_stopped(row, _stops_from(one_rank["greedy"])) for row in one_rank["greedy"]]
    assert one_rank["sampled"] != one_rank["greedy"]
