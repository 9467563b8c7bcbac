"""Tokenizer file flags that name no file the tokenizer can read (swapped --vocab-file / --merge-file, a corrupt or
foreign --tokenizer-model, a directory or an empty file where a file is expected, a missing file): every
--tokenizer-type stops with one message naming the flags, their paths, the reason and what each flag should name,
and training, the inference scripts and tools/preprocess_data.py give that same message."""

import json

import pytest

from megatron.inference import launch
from megatron.training.tokenizer import TokenizerFileError, build_tokenizer
from megatron.training.tokenizer.file_errors import TokenizerFileContentError, TokenizerFilePathError
from megatron.training.training import set_up_tokenizer
from tests.unit_tests.tools.tool_loading import load_tool
from tests.unit_tests.training.argument_checks import validated

GPT2_CHECK = "check that each flag names the right file (--vocab-file vocab.json, --merge-file merges.txt)"
HF_CHECK = ("check that each flag names the right file (--tokenizer-model a Hugging Face tokenizer directory or its "
            "tokenizer.json)")
TIK_CHECK = ("check that each flag names the right file (--tokenizer-model a tiktoken .json vocabulary, a list of "
             "{rank, token_bytes, token_str})")
TIK_FLAGS = {"tiktoken_pattern": "v2", "vocab_size": 300, "tiktoken_num_special_tokens": 10}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Paths by name: a GPT-2 vocab.json / merges.txt of the 256 byte tokens, one merge and <|endoftext|>, and the
    bad files the cases name."""
    directory = tmp_path_factory.mktemp("tokenizer_files")
    byte_tokens = [chr(byte) for byte in range(ord("!"), ord("~") + 1)]
    vocab = {token: index for index, token in enumerate(byte_tokens + ["th", "<|endoftext|>"])}
    paths = {name: directory / name for name in ("vocab.json", "merges.txt", "no_eod.json", "no_merged_token.json",
                                                 "empty", "garbage.json", "latin1.json", "empty_dir", "bad_dir",
                                                 "missing.json")}
    paths["vocab.json"].write_text(json.dumps(vocab))
    paths["merges.txt"].write_text("#version: 0.2\nt h\n")
    paths["no_eod.json"].write_text(json.dumps({token: index for index, token in enumerate(byte_tokens + ["th"])}))
    paths["no_merged_token.json"].write_text(json.dumps({token: index for index, token in enumerate(byte_tokens)}))
    paths["empty"].write_text("")
    paths["garbage.json"].write_text("not json")
    paths["latin1.json"].write_bytes("[\"caf\u00e9\"]".encode("latin-1"))
    paths["empty_dir"].mkdir()
    paths["bad_dir"].mkdir()
    (paths["bad_dir"] / "tokenizer.json").write_text("not json")
    return {name: str(path) for name, path in paths.items()}


def _gpt2(vocab, merges):
    return lambda files: dict(tokenizer_type="GPT2BPETokenizer", vocab_file=files[vocab], merge_file=files[merges])


def _model(tokenizer_type, name, **flags):
    return lambda files: dict(tokenizer_type=tokenizer_type, tokenizer_model=files[name], **flags)


def _with_paths(message, files):
    """`message` with each `{name}` replaced by the path of file `name`."""
    for name, path in files.items():
        message = message.replace("{" + name + "}", path)
    return message


# (flags, error kind, message with {name} for the path of file `name`)
CASES = {
    "gpt2_swapped": (_gpt2("merges.txt", "vocab.json"), TokenizerFileContentError,
                     "cannot build the --tokenizer-type GPT2BPETokenizer tokenizer from --vocab-file {merges.txt} "
                     "--merge-file {vocab.json}: Error while reading BPE files: expected value at line 1 column 1; "
                     + GPT2_CHECK),
    "gpt2_vocab_as_merges": (_gpt2("vocab.json", "vocab.json"), TokenizerFileContentError,
                             "cannot build the --tokenizer-type GPT2BPETokenizer tokenizer from --vocab-file "
                             "{vocab.json} --merge-file {vocab.json}: Error while reading BPE files: Merges text file "
                             "invalid at line 1; " + GPT2_CHECK),
    "gpt2_directory": (_gpt2("empty_dir", "merges.txt"), TokenizerFilePathError,
                       "cannot build the --tokenizer-type GPT2BPETokenizer tokenizer from --vocab-file {empty_dir} "
                       "--merge-file {merges.txt}: {empty_dir} is a directory, not a file; " + GPT2_CHECK),
    "gpt2_empty_merges": (_gpt2("vocab.json", "empty"), TokenizerFileContentError,
                          "cannot build the --tokenizer-type GPT2BPETokenizer tokenizer from --vocab-file {vocab.json} "
                          "--merge-file {empty}: {empty} is empty; " + GPT2_CHECK),
    "gpt2_missing": (_gpt2("missing.json", "merges.txt"), TokenizerFilePathError,
                     "cannot build the --tokenizer-type GPT2BPETokenizer tokenizer from --vocab-file {missing.json} "
                     "--merge-file {merges.txt}: {missing.json}: no such file; " + GPT2_CHECK),
    "gpt2_no_end_of_document": (_gpt2("no_eod.json", "merges.txt"), TokenizerFileContentError,
                                "cannot build the --tokenizer-type GPT2BPETokenizer tokenizer from --vocab-file "
                                "{no_eod.json} --merge-file {merges.txt}: the tokenizer has no end-of-document token; "
                                "looked for <|endoftext|>; " + GPT2_CHECK),
    "gpt2_merge_outside_vocab": (_gpt2("no_merged_token.json", "merges.txt"), TokenizerFileContentError,
                                 "cannot build the --tokenizer-type GPT2BPETokenizer tokenizer from --vocab-file "
                                 "{no_merged_token.json} --merge-file {merges.txt}: the tokenizers package failed "
                                 "reading them (range end index 2 out of range for slice of length 1); " + GPT2_CHECK),
    "hf_merges_file": (_model("HuggingFaceTokenizer", "merges.txt"), TokenizerFileContentError,
                       "cannot build the --tokenizer-type HuggingFaceTokenizer tokenizer from --tokenizer-model "
                       "{merges.txt}: expected value at line 1 column 1; " + HF_CHECK),
    "hf_empty": (_model("HuggingFaceTokenizer", "empty"), TokenizerFileContentError,
                 "cannot build the --tokenizer-type HuggingFaceTokenizer tokenizer from --tokenizer-model {empty}: "
                 "{empty} is empty; " + HF_CHECK),
    "hf_not_utf8": (_model("HuggingFaceTokenizer", "latin1.json"), TokenizerFileContentError,
                    "cannot build the --tokenizer-type HuggingFaceTokenizer tokenizer from --tokenizer-model "
                    "{latin1.json}: stream did not contain valid UTF-8; " + HF_CHECK),
    "hf_directory_with_corrupt_tokenizer_json": (
        _model("HuggingFaceTokenizer", "bad_dir"), TokenizerFileContentError,
        "cannot build the --tokenizer-type HuggingFaceTokenizer tokenizer from --tokenizer-model {bad_dir}: "
        "{bad_dir}/tokenizer.json: expected ident at line 1 column 2; " + HF_CHECK),
    "hf_missing": (_model("HuggingFaceTokenizer", "missing.json"), TokenizerFilePathError,
                   "cannot build the --tokenizer-type HuggingFaceTokenizer tokenizer from --tokenizer-model "
                   "{missing.json}: {missing.json}: no such file; " + HF_CHECK),
    "tik_corrupt": (_model("TikTokenizer", "garbage.json", **TIK_FLAGS), TokenizerFileContentError,
                    "cannot build the --tokenizer-type TikTokenizer tokenizer from --tokenizer-model {garbage.json}: "
                    "Expecting value: line 1 column 1 (char 0); " + TIK_CHECK),
    "tik_not_utf8": (_model("TikTokenizer", "latin1.json", **TIK_FLAGS), TokenizerFileContentError,
                     "cannot build the --tokenizer-type TikTokenizer tokenizer from --tokenizer-model {latin1.json}: "
                     "'utf-8' codec can't decode byte 0xe9 in position 5: invalid continuation byte; " + TIK_CHECK),
    "tik_gpt2_vocabulary": (_model("TikTokenizer", "vocab.json", **TIK_FLAGS), TokenizerFileContentError,
                            "cannot build the --tokenizer-type TikTokenizer tokenizer from --tokenizer-model "
                            "{vocab.json}: expected a JSON list of vocabulary entries; " + TIK_CHECK),
    "tik_directory": (_model("TikTokenizer", "empty_dir", **TIK_FLAGS), TokenizerFileContentError,
                      "cannot build the --tokenizer-type TikTokenizer tokenizer from --tokenizer-model {empty_dir}: "
                      "TikTokenizer reads a .json vocabulary; " + TIK_CHECK),
    "tik_missing": (_model("TikTokenizer", "missing.json", **TIK_FLAGS), TokenizerFilePathError,
                    "cannot build the --tokenizer-type TikTokenizer tokenizer from --tokenizer-model {missing.json}: "
                    "{missing.json}: no such file; " + TIK_CHECK),
}


@pytest.mark.parametrize("case", CASES)
def test_bad_tokenizer_files_name_the_flags_paths_and_what_to_check(files, case):
    flags, kind, message = CASES[case]
    with pytest.raises(kind) as error:
        build_tokenizer(**flags(files))
    assert isinstance(error.value, TokenizerFileError)
    assert str(error.value) == _with_paths(message, files)


def test_the_good_files_build(files):
    tokenizer = build_tokenizer("GPT2BPETokenizer", vocab_file=files["vocab.json"], merge_file=files["merges.txt"])
    assert (tokenizer.vocab_size, tokenizer.eod, tokenizer.tokenize("the")) == (96, 95, [94, ord("e") - ord("!")])


def test_training_inference_and_preprocessing_give_the_same_message(files, tmp_path, monkeypatch):
    swapped = f"--tokenizer-type GPT2BPETokenizer --vocab-file {files['merges.txt']} --merge-file {files['vocab.json']}"
    expected = _with_paths(CASES["gpt2_swapped"][2], files)
    args = validated(swapped)
    for set_up in (set_up_tokenizer, launch.build_tokenizer):  # pretrain_gpt.py's, the inference scripts'
        with pytest.raises(TokenizerFileContentError) as error:
            set_up(args)
        assert str(error.value) == expected
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(json.dumps({"text": "the"}) + "\n")
    preprocess_data = load_tool("preprocess_data", "preprocess_data_tokenizer_file_errors")
    with pytest.raises(SystemExit) as exit_info:
        preprocess_data.main(["--input", str(corpus), "--output-prefix", str(tmp_path / "out"), *swapped.split()])
    assert exit_info.value.code == expected
