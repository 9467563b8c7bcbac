"""The flags of examples/inference/gpt/gpt_static_inference.py: upstream's names and defaults, and the placeholder
dataset flag a generation run gets when it names none."""

from examples.inference.gpt.gpt_static_inference import (
    add_static_inference_args,
    sampling_params_from_args,
    with_placeholder_data_flag,
)
from megatron.training.arguments import build_parser


def _parse(argv):
    return build_parser(add_static_inference_args).parse_args(argv)


def test_upstream_defaults_are_greedy_30_tokens():
    args = _parse(["--prompts", "def ", "Return the"])
    assert args.prompts == ["def ", "Return the"]
    assert (args.num_tokens_to_generate, args.temperature, args.top_k, args.top_p) == (30, 1.0, 1, 0.0)
    assert (args.inference_max_seq_length, args.inference_max_requests) == (2560, 8)
    assert not args.return_log_probs and args.output_path is None
    params = sampling_params_from_args(args)
    assert params.greedy and params.num_tokens_to_generate == 30


def test_sampling_flags_reach_the_sampling_params():
    args = _parse(["--prompts", "x", "--top_k", "0", "--top_p", "0.9", "--temperature", "0.7",
                   "--num-tokens-to-generate", "5", "--return-log-probs"])
    params = sampling_params_from_args(args)
    assert (params.top_k, params.top_p, params.temperature, params.num_tokens_to_generate) == (0, 0.9, 0.7, 5)
    assert params.return_log_probs and not params.greedy


def test_mock_data_is_added_only_when_no_dataset_is_named():
    assert with_placeholder_data_flag(["--load", "ckpt"]) == ["--load", "ckpt", "--mock-data"]
    for named in (["--data-path", "a_text_document"], ["--data-path=a"], ["--mock-data"], ["--train-data-path", "t"]):
        assert with_placeholder_data_flag(named) == named
