"""tools/build_sft_conversations.py: the bundled documentation corpus as chat conversations `--sft` reads."""

import json

from megatron.training.tokenizer.chat_prompt_formats import check_messages
from tools.build_sft_conversations import DEFAULT_INPUT, build, entries, main


def test_headings_become_questions_answered_by_the_first_docstring_paragraph():
    text = ("Module demo\n\nAbout demo.\n\ndef demo.add(a, b)\n\nReturn the sum\nof a and b.\n\nMore detail.\n\n"
            "class demo.Box\n\nA box holding one value.\n")
    assert list(entries(text)) == [("def", "demo.add", "(a, b)", "Return the sum of a and b."),
                                   ("class", "demo.Box", "", "A box holding one value.")]


def test_the_bundled_corpus_gives_deterministic_well_formed_conversations(tmp_path):
    output = tmp_path / "qa.jsonl"
    main(["--output", str(output), "--max-conversations", "200"])
    lines = output.read_text().splitlines()
    assert len(lines) == 200 and lines == [json.dumps(record, sort_keys=True) for record in build(
        DEFAULT_INPUT, 200)]
    conversations = [json.loads(line)["messages"] for line in lines]
    for messages in conversations:
        check_messages(messages)
        answer = next(message["content"] for message in messages if message["role"] == "assistant")
        assert messages[-1]["role"] == "assistant" and 40 <= len(answer) <= 400
    roles = [[message["role"] for message in messages] for messages in conversations]
    assert ["system", "user", "assistant"] in roles and ["user", "assistant"] in roles
    assert ["system", "user", "assistant", "user", "assistant"] in roles
    assert len(build(DEFAULT_INPUT)) > 5000
