"""Chat prompt formats: the rendered text of a conversation, and which of its ids the SFT loss trains on."""

import numpy as np
import pytest

from megatron.training.tokenizer.byte_level_tokenizer import ByteLevelTokenizer
from megatron.training.tokenizer.chat_prompt_formats import (
    IGNORE_INDEX,
    PROMPT_FORMATS,
    chat_prompt_format_for_flag,
    prompt_format,
    tokenize_conversation,
)

EOD = 256
CONVERSATION = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
                {"role": "assistant", "content": "4"}, {"role": "user", "content": "And 3+3?"},
                {"role": "assistant", "content": "6"}]


def _text(ids):
    return bytes(ids).decode()


def _trained_spans(tokens, target):
    """The trained ids as maximal runs of text (the end-of-document id written as <eod>)."""
    spans, run = [], []
    for token, label in zip(tokens, target):
        if label == IGNORE_INDEX:
            if run:
                spans.append(run)
            run = []
        else:
            assert label == token
            run.append(token)
    if run:
        spans.append(run)
    return [_text([t for t in span if t != EOD]) + ("<eod>" if span[-1] == EOD else "") for span in spans]


def test_chatml_renders_every_turn_and_trains_on_the_replies_with_their_end_markers():
    tokens, target = tokenize_conversation(ByteLevelTokenizer(), CONVERSATION, "chatml")
    assert tokens[-1] == EOD and len(target) == len(tokens)
    assert _text(tokens[:-1]) == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n"
                                  "<|im_start|>assistant\n4<|im_end|>\n<|im_start|>user\nAnd 3+3?<|im_end|>\n"
                                  "<|im_start|>assistant\n6<|im_end|>\n")
    assert _trained_spans(tokens, target) == ["4<|im_end|>\n", "6<|im_end|>\n<eod>"]


@pytest.mark.parametrize("name, text, spans", [
    ("llama3", "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>"
               "<|start_header_id|>assistant<|end_header_id|>\n\nhello<|eot_id|>", ["hello<|eot_id|><eod>"]),
    ("plain", "user: hi\n\nassistant: hello\n\n", ["hello\n\n<eod>"]),
])
def test_other_formats(name, text, spans):
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    tokens, target = tokenize_conversation(ByteLevelTokenizer(), messages, PROMPT_FORMATS[name])
    assert _text(tokens[:-1]) == text and _trained_spans(tokens, target) == spans


def test_a_conversation_ending_with_the_user_trains_no_end_of_document_and_a_generation_prompt_adds_none():
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"},
                {"role": "user", "content": "bye"}]
    tokens, target = tokenize_conversation(ByteLevelTokenizer(), messages, "plain")
    assert tokens[-1] == EOD and target[-1] == IGNORE_INDEX and _trained_spans(tokens, target) == ["yo\n\n"]
    prompt, prompt_target = tokenize_conversation(ByteLevelTokenizer(), messages, "plain", add_generation_prompt=True)
    assert _text(prompt) == "user: hi\n\nassistant: yo\n\nuser: bye\n\nassistant: "
    assert _trained_spans(prompt, prompt_target) == ["yo\n\n"]


class WordTokenizer:
    """Whitespace words -> ids 10, 11, ...; id 1 starts a sequence when special tokens are added."""

    eod = 0

    def __init__(self):
        self.words = {}

    def tokenize(self, text, add_special_tokens=True):
        ids = [self.words.setdefault(word, 10 + len(self.words)) for word in text.split()]
        return ([1] if add_special_tokens else []) + ids


def test_only_the_first_piece_gets_the_special_tokens():
    messages = [{"role": "user", "content": "hi there"}, {"role": "assistant", "content": "hello"}]
    tokens, target = tokenize_conversation(WordTokenizer(), messages, "plain")
    # "user:" "hi" "there" | "assistant:" | "hello": one beginning-of-sequence id, then the words, then eod.
    assert tokens == [1, 10, 11, 12, 13, 14, 0]
    assert target == [IGNORE_INDEX] * 5 + [14, 0]


@pytest.mark.parametrize("messages, message", [
    ([], r"'messages' must be a non-empty list"),
    ([{"role": "user"}], r"message 0: each message needs a string 'content'"),
    ([{"role": "user", "content": "a"}, {"role": "bot", "content": "b"}], r"message 1: role 'bot' is not one of"),
])
def test_malformed_conversations_are_refused(messages, message):
    with pytest.raises(ValueError, match=message):
        tokenize_conversation(ByteLevelTokenizer(), messages, "chatml")


def test_an_unknown_format_names_the_flag_and_the_choices():
    with pytest.raises(ValueError, match=r"--sft-tokenizer-prompt-format 'nemotron-h-aligned' is not one of chatml, "
                                         r"llama3, plain"):
        prompt_format("nemotron-h-aligned")


def test_a_generation_flag_names_a_format_and_a_reply_may_end_with_its_stripped_marker():
    assert chat_prompt_format_for_flag("llama3") is PROMPT_FORMATS["llama3"]
    with pytest.raises(ValueError, match=r"^--chat-prompt-format 'mistral' is not one of chatml, llama3, plain: give "
                                         r"the format the model was fine-tuned with \(its --sft-tokenizer-prompt"):
        chat_prompt_format_for_flag("mistral")
    assert {name: chat_format.reply_ends for name, chat_format in PROMPT_FORMATS.items()} == {
        "chatml": ("<|im_end|>\n", "<|im_end|>"), "llama3": ("<|eot_id|>",), "plain": ("\n\n",)}


def test_upstream_sft_tokenizer_is_the_hugging_face_tokenizer_with_tokenize_conversation(tmp_path):
    from megatron.training.tokenizer import build_tokenizer
    from megatron.training.tokenizer.bpe_training import save_bpe_tokenizer, train_bpe_tokenizer

    texts = ["user: hello there\n\nassistant: general kenobi\n\n"] * 20
    path = save_bpe_tokenizer(train_bpe_tokenizer(texts, vocab_size=300), str(tmp_path / "bpe"))
    tokenizer = build_tokenizer("SFTTokenizer", tokenizer_model=path, sft_tokenizer_prompt_format="plain")
    messages = [{"role": "user", "content": "hello there"}, {"role": "assistant", "content": "general kenobi"}]
    tokens, target = tokenizer.tokenize_conversation(messages, return_target=True, add_generation_prompt=False)
    assert tokens.dtype == target.dtype == np.int64
    assert tokenizer.detokenize(tokens[:-1]) == "user: hello there\n\nassistant: general kenobi\n\n"
    trained = tokens[target != IGNORE_INDEX]
    assert tokenizer.detokenize(trained[:-1]) == "general kenobi\n\n" and trained[-1] == tokenizer.eod
    prompt = tokenizer.tokenize_conversation(messages[:1], return_target=False, add_generation_prompt=True)
    assert tokenizer.detokenize(prompt) == "user: hello there\n\nassistant: "
    assert tokenizer.unique_identifiers["prompt_format"] == "plain"


class SpecialTokensTokenizer(WordTokenizer):
    """Adds a beginning-of-sequence id (1) and an end-of-sequence id (2) to a whole text, as a Hugging Face
    post-processor `<s> $A </s>` does; `<|begin_of_text|>` is its beginning-of-sequence token."""

    def tokenize(self, text, add_special_tokens=True):
        ids = [1 if word == "<|begin_of_text|>" else self.words.setdefault(word, 10 + len(self.words))
               for word in text.replace("<|begin_of_text|>", " <|begin_of_text|> ").split()]
        return [1, *ids, 2] if add_special_tokens else ids


class BosFlagTokenizer(WordTokenizer):
    """Llama 2's interface: tokenize(text, bos=True, eos=False)."""

    def tokenize(self, text, bos=True, eos=False):
        return ([1] if bos else []) + super().tokenize(text, add_special_tokens=False) + ([2] if eos else [])


@pytest.mark.parametrize("tokenizer", [SpecialTokensTokenizer(), BosFlagTokenizer()])
@pytest.mark.parametrize("name", ["plain", "llama3"])
def test_the_tokenizers_special_tokens_open_the_conversation_once(tokenizer, name):
    messages = [{"role": "user", "content": "hi there"}, {"role": "assistant", "content": "hello"}]
    tokens, target = tokenize_conversation(tokenizer, messages, name)
    assert tokens[0] == 1 and tokens.count(1) == 1 and 2 not in tokens  # one BOS, no EOS inside
    assert tokens[-1] == 0 and target[-1] == 0  # the end-of-document id closes it, trained
    prompt, _ = tokenize_conversation(tokenizer, messages[:1], name, add_generation_prompt=True)
    assert prompt.count(1) == 1 and 2 not in prompt
