"""tools/run_text_generation_server.py's command line: upstream's server-wide sampling flags are accepted (upstream
launch scripts pass them) and say which request field sets each instead, as upstream's requests never read them;
--chat-prompt-format names a registered chat format (the chat endpoint's)."""

import pytest

from megatron.training.arguments import build_parser
from megatron.training.tokenizer.chat_prompt_formats import PROMPT_FORMATS
from tools.run_text_generation_server import add_text_generation_server_args, chat_format_of, request_field_flag_notes


def _parsed(*argv):
    return build_parser(add_text_generation_server_args).parse_args(list(argv))


def test_upstream_sampling_flags_are_accepted_and_name_the_request_field():
    args = _parsed("--temperature", "0.5", "--top_k", "0", "--top_p", "0.0", "--num-tokens-to-generate", "30",
                   "--out-seq-length", "1024", "--return-log-probs", "--port", "5001")
    assert (args.temperature, args.top_k, args.top_p, args.num_tokens_to_generate, args.out_seq_length,
            args.return_log_probs, args.port) == (0.5, 0, 0.0, 30, 1024, True, 5001)
    tail = " sets no default of this server (nor of upstream's): each PUT /api request gives its own "
    assert request_field_flag_notes(args) == [  # a zero is a value given, and noted
        f'note: --temperature 0.5{tail}"temperature" (default 1.0)',
        f'note: --top_k 0{tail}"top_k" (default 0)',
        f'note: --top_p 0.0{tail}"top_p" (default 0.0)',
        f'note: --num-tokens-to-generate 30{tail}"tokens_to_generate" (default 64)',
        f'note: --out-seq-length 1024{tail}"tokens_to_generate" (default 64)',
        f'note: --return-log-probs{tail}"logprobs" (default false)',
    ]
    assert request_field_flag_notes(_parsed()) == []


def test_a_sampling_flag_value_of_the_wrong_type_is_named(capsys):
    with pytest.raises(SystemExit):
        _parsed("--top_k", "0.5")
    assert "argument --top_k: invalid int value: '0.5'" in capsys.readouterr().err


def test_chat_prompt_format_flag_names_a_registered_format():
    assert chat_format_of(_parsed()) is None  # no chat endpoint
    for name in ("chatml", "llama3", "plain"):
        assert chat_format_of(_parsed("--chat-prompt-format", name)) is PROMPT_FORMATS[name]
    with pytest.raises(ValueError) as error:
        chat_format_of(_parsed("--chat-prompt-format", "mistral"))
    assert str(error.value) == ("--chat-prompt-format 'mistral' is not one of chatml, llama3, plain: give the format "
                                "the model was fine-tuned with (its --sft-tokenizer-prompt-format)")
