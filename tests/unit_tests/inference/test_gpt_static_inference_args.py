"""The flags of examples/inference/gpt/gpt_static_inference.py: upstream's names and defaults, the prompt file, the
placeholder dataset and training flags a generation run gets when it names none, and the training flags of a
launch script passed anyway."""

import pytest

from examples.inference.gpt.gpt_static_inference import (
    TextStream,
    add_static_inference_args,
    check_args,
    read_prompt_file,
    result_record,
    sampling_params_from_args,
    tokenize_prompts,
    training_placeholders,
    with_placeholder_data_flag,
)
from megatron.core.inference.static_generation import GeneratedSequence
from megatron.training.arguments import build_parser, validate_args
from megatron.training.tokenizer.null_tokenizer import NullTokenizer


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


def test_top_n_logprobs_flag_reaches_the_sampling_params_and_the_records():
    args = _parse(["--prompts", "x", "--top-n-logprobs", "2"])
    assert sampling_params_from_args(args).top_n_logprobs == 2 and _parse(["--prompts", "x"]).top_n_logprobs == 0
    with pytest.raises(ValueError, match="--top-n-logprobs must be an integer >= 0"):
        sampling_params_from_args(_parse(["--prompts", "x", "--top-n-logprobs", "-1"]))
    result = GeneratedSequence(prompt_tokens=[1], generated_tokens=[4, 7], stopped_at_eod=True,
                               generated_top_n_logprobs=[{4: -0.1, 2: -2.5}, {7: -0.3, 4: -1.5}])
    record = result_record("1", result, NullTokenizer(7))
    assert record["generated_top_n_logprobs"] == [{"4": -0.1, "2": -2.5}, {"7": -0.3, "4": -1.5}]
    assert "generated_top_n_logprobs" not in result_record("1", GeneratedSequence([1], [4], False), NullTokenizer(7))


def test_mock_data_is_added_only_when_no_dataset_is_named():
    assert with_placeholder_data_flag(["--load", "ckpt"]) == ["--load", "ckpt", "--mock-data"]
    for named in (["--data-path", "a_text_document"], ["--data-path=a"], ["--mock-data"], ["--train-data-path", "t"]):
        assert with_placeholder_data_flag(named) == named


def test_prompt_file_reads_the_text_of_each_json_line_in_order(tmp_path):
    prompt_file = tmp_path / "prompts.jsonl"
    prompt_file.write_text('{"text": "def ", "id": 3}\n\n{"text": "Return the"}\n{"text": "x\\ny"}\n')
    assert read_prompt_file(prompt_file) == ["def ", "Return the", "x\ny"]
    assert read_prompt_file(prompt_file, num_truncate=2) == ["def ", "Return the"]
    args = _parse(["--prompt-file", str(prompt_file), "--prompt-file-num-truncate", "2"])
    assert (args.prompt_file, args.prompt_file_num_truncate, args.prompts) == (str(prompt_file), 2, None)


@pytest.mark.parametrize("content, error", [
    ("def \n", r"line 1 is not JSON"),
    ('{"text": "a"}\n["b"]\n', r'line 2 has no string "text" field'),
    ("\n", "holds no prompts"),
])
def test_bad_prompt_files_name_the_flag_and_the_line(tmp_path, content, error):
    prompt_file = tmp_path / "prompts.jsonl"
    prompt_file.write_text(content)
    with pytest.raises(ValueError, match=f"--prompt-file .*{error}"):
        read_prompt_file(prompt_file)


def _validated(argv):
    model = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
             "--max-position-embeddings", "16"]
    argv = with_placeholder_data_flag(["--load", "ckpt", "--tokenizer-type", "ByteLevelTokenizer", *model, *argv])
    return validate_args(_parse(argv), training_placeholders(argv))


@pytest.mark.parametrize("training_flags", [
    [],
    ["--lr-warmup-iters", "20"],
    ["--train-samples", "3200", "--global-batch-size", "16", "--micro-batch-size", "8"],
    ["--micro-batch-size", "8", "--global-batch-size", "16", "--train-iters", "200", "--lr", "3e-3",
     "--lr-warmup-iters", "20", "--data-path", "/nonexistent/data_text_document", "--split", "98,2,0"],
])
def test_training_flags_of_a_launch_script_validate_and_keep_their_values(training_flags):
    args = _validated(["--prompts", "def ", *training_flags])
    given = _parse(with_placeholder_data_flag(training_flags))
    for name in ("micro_batch_size", "train_iters", "train_samples", "lr", "lr_warmup_iters"):
        if getattr(given, name) is not None:
            assert getattr(args, name) == getattr(given, name)
    if not training_flags:
        assert (args.micro_batch_size, args.train_iters, args.lr) == (1, 1, 0.0)


def test_prompt_sources_and_meta_device_init_are_checked_before_a_model_is_built(tmp_path):
    prompt_file = str(tmp_path / "prompts.jsonl")
    for argv, error in ((["--prompts", "a", "--prompt-file", prompt_file], "--prompts and --prompt-file"),
                        ([], "--prompts: give one or more prompts"),
                        (["--prompts", "a", "--prompt-file-num-truncate", "2"], "needs --prompt-file"),
                        (["--prompt-file", prompt_file, "--prompt-file-num-truncate", "0"], "at least 1")):
        with pytest.raises(ValueError, match=error):
            check_args(_validated(argv))
    args = _validated(["--prompts", "a", "--use-megatron-fsdp", "--init-model-with-meta-device"])
    check_args(args)
    assert not args.init_model_with_meta_device


@pytest.mark.parametrize("saved_seq_length, seq_length", [(None, 48), (32, 32)])
def test_a_checkpoint_without_a_seq_length_launches_with_use_checkpoint_args(monkeypatch, saved_seq_length,
                                                                           seq_length):
    """A Hugging Face import records the model flags but no --seq-length (a training choice); generation takes the
    checkpoint's --max-position-embeddings for it, a training checkpoint's own --seq-length where it has one."""
    import argparse

    from megatron.training import checkpoint_sources

    saved = argparse.Namespace(num_layers=2, hidden_size=32, num_attention_heads=4, max_position_embeddings=48,
                               position_embedding_type="rope", normalization="RMSNorm", swiglu=True)
    if saved_seq_length is not None:
        saved.seq_length = saved_seq_length
    source = checkpoint_sources.CheckpointSource("imported", 1, "torch_dist", False)
    monkeypatch.setattr(checkpoint_sources, "checkpoint_to_load", lambda args: source)
    monkeypatch.setattr(checkpoint_sources, "saved_args", lambda checkpoint: saved)
    argv = with_placeholder_data_flag(["--load", "imported", "--use-checkpoint-args", "--tokenizer-type",
                                       "ByteLevelTokenizer", "--prompts", "def "])
    args = validate_args(_parse(argv), training_placeholders(argv))
    assert (args.seq_length, args.max_position_embeddings, args.num_layers) == (seq_length, 48, 2)


@pytest.mark.parametrize("argv, max_requests", [
    (["--max-batch-size", "3"], 3),
    (["--max-batch-size", "3", "--inference-max-requests", "3"], 3),
    (["--inference-max-requests", "5"], 5),
])
def test_upstream_max_batch_size_is_the_deprecated_name_of_inference_max_requests(argv, max_requests):
    args = _validated(["--prompts", "a", *argv])
    check_args(args)
    assert args.inference_max_requests == max_requests


def test_max_batch_size_that_disagrees_with_inference_max_requests_is_refused():
    args = _validated(["--prompts", "a", "--max-batch-size", "3", "--inference-max-requests", "5"])
    with pytest.raises(ValueError, match="--max-batch-size 3 and --inference-max-requests 5 disagree"):
        check_args(args)


def test_stream_prints_each_prompts_new_text_once_its_characters_are_whole(capsys):
    from megatron.training.tokenizer import build_tokenizer_from_args

    assert _parse(["--stream"]).stream and not _parse([]).stream
    tokenizer = build_tokenizer_from_args(_parse(["--tokenizer-type", "ByteLevelTokenizer"]))
    stream = TextStream(tokenizer)
    e_acute = tokenizer.tokenize("\u00e9")  # two bytes: the first alone is no character yet
    assert len(e_acute) == 2
    stream([0, 1], tokenizer.tokenize("ab"))
    stream([0, 1], [tokenizer.tokenize("c")[0], e_acute[0]])
    stream([1], [e_acute[1]])
    stream([0], [tokenizer.eod])
    assert capsys.readouterr().out.splitlines() == [
        "stream 0: 'a'", "stream 1: 'b'", "stream 0: 'c'", "stream 1: '\u00e9'"]


@pytest.mark.parametrize("world_size, virtual_flag", [("2", "--num-layers-per-virtual-pipeline-stage"),
                                                      ("4", "--num-virtual-stages-per-pipeline-rank")])
def test_a_virtual_pipeline_launch_validates_and_is_accepted(monkeypatch, world_size, virtual_flag):
    monkeypatch.setenv("WORLD_SIZE", world_size)
    args = _validated(["--prompts", "a", "--num-layers", "4", "--pipeline-model-parallel-size", "2",
                       virtual_flag, "1" if "layers" in virtual_flag else "2"])
    check_args(args)  # decoded by megatron.inference.virtual_pipeline, not refused
    assert args.virtual_pipeline_model_parallel_size == 2
    # micro-batch 1 and pipeline-size x world-size samples: a multiple of the pipeline size of microbatches
    assert (args.micro_batch_size, args.global_batch_size) == (1, 2 * int(world_size))


@pytest.mark.parametrize("position_embedding", ["rope", "learned_absolute"])
def test_prompt_plus_generated_tokens_must_fit_max_position_embeddings(position_embedding):
    from megatron.training.tokenizer import build_tokenizer_from_args

    tokenizer = build_tokenizer_from_args(_parse(["--tokenizer-type", "ByteLevelTokenizer"]))
    model = ["--max-position-embeddings", "128", "--seq-length", "128", "--position-embedding-type",
             position_embedding]
    args = _validated(["--prompts", "x" * 130, "--num-tokens-to-generate", "4", *model])
    with pytest.raises(ValueError, match="prompt 0 is 130 tokens long, longer than --max-position-embeddings 128"):
        tokenize_prompts(args, tokenizer)
    args = _validated(["--prompts", "x" * 120, "a", "--num-tokens-to-generate", "9", *model])
    with pytest.raises(ValueError, match=r"prompt 0 \(120 tokens\) plus --num-tokens-to-generate 9 exceeds "
                                         "--max-position-embeddings 128"):
        tokenize_prompts(args, tokenizer)
    # The cache is as long as the positions (not --inference-max-seq-length's 2560) when they are fewer.
    args = _validated(["--prompts", "x" * 120, "a", "--num-tokens-to-generate", "8", *model])
    prompts, prompt_tokens, max_sequence_length = tokenize_prompts(args, tokenizer)
    assert ([len(tokens) for tokens in prompt_tokens], max_sequence_length) == ([120, 1], 128)
    args = _validated(["--prompts", "x" * 60, "--inference-max-seq-length", "64", *model])
    with pytest.raises(ValueError, match="exceeds --inference-max-seq-length 64: raise --inference-max-seq-length"):
        tokenize_prompts(args, tokenizer)


def test_moe_at_tensor_parallel_size_2_launches_for_generation_with_or_without_sequence_parallel(monkeypatch):
    # Training asks for --sequence-parallel with MoE at TP2; a generation program's flags do not, and generation
    # turns it off when given (tests/unit_tests/inference/test_generation_tensor_parallel.py: TP1's tokens).
    monkeypatch.setenv("WORLD_SIZE", "2")
    moe_tp2 = ["--prompts", "a", "--num-experts", "4", "--tensor-model-parallel-size", "2"]
    for extra in ([], ["--sequence-parallel"]):
        args = _validated(moe_tp2 + extra)
        check_args(args)
        assert (args.num_experts, args.tensor_model_parallel_size, args.sequence_parallel) == (4, 2, False)
    check_args(_validated(["--prompts", "a", "--num-experts", "4", "--expert-model-parallel-size", "2"]))
    # The server's flags are a generation program's too; pretrain_gpt.py's alone are not.
    from tools.run_text_generation_server import add_text_generation_server_args

    assert build_parser(add_text_generation_server_args).parse_args([]).generation_program
    assert not hasattr(build_parser().parse_args([]), "generation_program")


def test_chat_prompts_are_user_messages_rendered_up_to_the_assistant_header(tmp_path):
    from megatron.training.tokenizer import build_tokenizer_from_args

    tokenizer = build_tokenizer_from_args(_parse(["--tokenizer-type", "ByteLevelTokenizer"]))
    model = ["--max-position-embeddings", "128", "--seq-length", "128"]
    args = _validated(["--prompts", "Hi", "--chat-prompt-format", "chatml", *model])
    check_args(args)
    prompts, prompt_tokens, _ = tokenize_prompts(args, tokenizer)
    assert prompts == ["Hi"] and bytes(prompt_tokens[0]) == b"<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    # A prompt file may then hold whole conversations, continued by the assistant.
    prompt_file = tmp_path / "chats.jsonl"
    prompt_file.write_text('{"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"}]}\n'
                           '{"text": "T"}\n')
    args = _validated(["--prompt-file", str(prompt_file), "--chat-prompt-format", "plain", *model])
    prompts, prompt_tokens, _ = tokenize_prompts(args, tokenizer)
    assert [bytes(tokens) for tokens in prompt_tokens] == [b"system: S\n\nuser: Q\n\nassistant: ",
                                                           b"user: T\n\nassistant: "]
    with pytest.raises(ValueError, match=r"line 1 has no string \"text\" field"):
        tokenize_prompts(_validated(["--prompt-file", str(prompt_file), *model]), tokenizer)
    prompt_file.write_text('{"messages": [{"role": "user"}]}\n')
    with pytest.raises(ValueError, match=r"--prompt-file .*: line 1, message 0: each message needs a string"):
        read_prompt_file(prompt_file, chat=True)
    with pytest.raises(ValueError, match=r"--chat-prompt-format 'mistral' is not one of chatml, llama3, plain"):
        check_args(_validated(["--prompts", "Hi", "--chat-prompt-format", "mistral"]))


def test_a_chat_reply_ends_at_its_end_of_turn_marker():
    from examples.inference.gpt.gpt_static_inference import reply_of

    assert reply_of("4<|im_end|>\n<|im_start|>user\nmore", "chatml") == "4"
    assert reply_of("4<|im_end|>", "chatml") == "4" and reply_of("no marker", "chatml") == "no marker"
    assert reply_of("4<|im_end|>\n", None) == "4<|im_end|>\n"


def test_a_yaml_cfg_files_training_keys_count_as_given(tmp_path):
    """A --yaml-cfg file read by a generation script: its warm-up needs no placeholder run length."""
    config = tmp_path / "run.yaml"
    config.write_text("language_model:\n  num_layers: 2\n  hidden_size: 32\n  num_attention_heads: 4\n"
                      "seq_length: 16\nmax_position_embeddings: 16\nlr_warmup_iters: 20\nmicro_batch_size: 4\n")
    argv = with_placeholder_data_flag(["--yaml-cfg", str(config), "--load", "ckpt", "--tokenizer-type",
                                       "ByteLevelTokenizer", "--prompts", "def "])
    placeholders = training_placeholders(argv)
    assert placeholders["train_iters"] == 21  # longer than the file's warm-up
    from megatron.training.arguments import parse_args

    args = validate_args(parse_args(add_static_inference_args, args=argv), placeholders)
    assert (args.num_layers, args.micro_batch_size, args.lr_warmup_iters, args.train_iters) == (2, 4, 20, 21)


def test_a_yaml_cfg_files_data_path_takes_the_place_of_the_placeholder_data(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("data_path: [/nonexistent/data_text_document]\n")
    with_file = ["--yaml-cfg", str(config), "--prompts", "def "]
    assert with_placeholder_data_flag(with_file, add_static_inference_args) == with_file
    config.write_text("lr: 0.1\n")
    assert with_placeholder_data_flag(with_file, add_static_inference_args) == [*with_file, "--mock-data"]
