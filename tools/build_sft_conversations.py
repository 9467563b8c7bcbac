"""Build chat conversations for supervised fine-tuning from the bundled documentation corpus.

Each function or class heading of `data/corpus/stdlib_docs.jsonl` (`def json.dump(obj, fp, ...)`, `class
string.Template`, each followed by its docstring) becomes one conversation in the JSON-lines layout `--sft` reads:
the user asks what the object does, the assistant answers with the docstring's first paragraph. Some conversations
begin with a system message and some add a second turn asking for the call signature, so every role appears.
The output is deterministic: documents and headings in corpus order, JSON written with sorted keys.

    python tools/build_sft_conversations.py --output /tmp/stdlib_qa.jsonl
"""

import argparse
import json
import os
import re
import sys

DEFAULT_INPUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "data", "corpus", "stdlib_docs.jsonl")
HEADING = re.compile(r"^(def|class) ([A-Za-z_][\w.]*)(\(.*\))?$", re.MULTILINE)
SYSTEM_PROMPT = "You answer questions about the Python standard library in one paragraph."
MIN_ANSWER_CHARS = 40
MAX_ANSWER_CHARS = 400
MAX_SIGNATURE_CHARS = 120


def first_paragraph(text):
    """The text up to the first blank line, its lines joined with spaces."""
    paragraph = text.strip().split("\n\n", 1)[0]
    return " ".join(line.strip() for line in paragraph.splitlines())


def entries(document_text):
    """(kind, dotted name, signature or "", first docstring paragraph) of each heading in a document."""
    headings = list(HEADING.finditer(document_text))
    for heading, following in zip(headings, headings[1:] + [None]):
        body = document_text[heading.end():following.start() if following else len(document_text)]
        yield heading.group(1), heading.group(2), heading.group(3) or "", first_paragraph(body)


def conversation(index, kind, name, signature, answer):
    """The messages of the `index`-th conversation: every third has a system message, every fourth a second turn."""
    noun = "class" if kind == "class" else "function"
    messages = [{"role": "user", "content": f"What does the {noun} {name} do?"},
                {"role": "assistant", "content": answer}]
    if index % 3 == 0:
        messages.insert(0, {"role": "system", "content": SYSTEM_PROMPT})
    if index % 4 == 0 and signature and len(signature) <= MAX_SIGNATURE_CHARS:
        messages += [{"role": "user", "content": "How is it called?"},
                     {"role": "assistant", "content": f"{name}{signature}"}]
    return {"messages": messages}


def build(input_path, max_conversations=None):
    conversations = []
    with open(input_path, encoding="utf-8") as stream:
        for line in stream:
            for kind, name, signature, answer in entries(json.loads(line)["text"]):
                if not MIN_ANSWER_CHARS <= len(answer) <= MAX_ANSWER_CHARS:
                    continue
                conversations.append(conversation(len(conversations), kind, name, signature, answer))
                if max_conversations is not None and len(conversations) == max_conversations:
                    return conversations
    return conversations


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--input", default=DEFAULT_INPUT, help="The documentation corpus (JSON lines with 'text').")
    parser.add_argument("--output", required=True, help="Where to write the conversations (JSON lines).")
    parser.add_argument("--max-conversations", type=int, default=None, help="Stop after this many.")
    args = parser.parse_args(argv)
    conversations = build(args.input, args.max_conversations)
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    with open(args.output, "w", encoding="utf-8") as stream:
        for record in conversations:
            stream.write(json.dumps(record, sort_keys=True) + "\n")
    print(f"wrote {len(conversations)} conversations to {args.output}", file=sys.stderr)


if __name__ == "__main__":
    main()
