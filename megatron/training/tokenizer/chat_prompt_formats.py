"""Chat prompt formats for supervised fine-tuning: a conversation (upstream's `messages`, a list of
`{"role": ..., "content": ...}`) rendered as text and tokenized, with the positions the loss trains on.

A format wraps each message in a header naming its role and an end-of-turn marker. Training covers what the model
must learn to produce: each assistant message's content and its end-of-turn marker (so it learns to stop), and
the end-of-document id that closes a conversation ending with an assistant message. System and user messages and
every header are context only. Upstream's SFT tokenizer returns the same pair: the token ids and a target holding
each trained id and `IGNORE_INDEX` elsewhere.

The pieces are tokenized one at a time, without the special tokens a tokenizer adds to a whole text, and
concatenated, so a trained span never shares a token with the text around it (a byte-level tokenizer gives exactly
the ids of the whole text; a BPE may split differently at piece boundaries, as chat tokenizers that encode their
markers as special tokens do). The tokenizer's own beginning-of-sequence id, if it adds one, opens the conversation
once (not twice where the format writes it, as Llama 3's `<|begin_of_text|>`); an end-of-sequence id it appends to
texts is left out (the end-of-document id closes the conversation).
"""

import dataclasses
import inspect

IGNORE_INDEX = -100  # upstream's target value for positions out of the loss
ROLES = ("system", "user", "assistant")


@dataclasses.dataclass(frozen=True)
class ChatPromptFormat:
    """How messages become text: `conversation_start`, then per message `header.format(role=role)`, the content and
    `turn_end`; `add_generation_prompt` ends with the assistant's header."""

    name: str
    header: str
    turn_end: str
    conversation_start: str = ""

    def __post_init__(self):
        if "{role}" not in self.header:
            raise ValueError(f"chat prompt format {self.name!r}: its header must contain {{role}}, got "
                             f"{self.header!r}")

    @property
    def reply_ends(self):
        """The end-of-turn marker as a generated reply may end with it, longest first: `turn_end` and, when they
        differ, its stripped form (a reply may stop before the marker's trailing newline)."""
        stripped = self.turn_end.strip()
        return (self.turn_end, stripped) if stripped and stripped != self.turn_end else (self.turn_end,)


PROMPT_FORMATS = {
    # ChatML, as Qwen's and many open chat models' templates write it.
    "chatml": ChatPromptFormat("chatml", header="<|im_start|>{role}\n", turn_end="<|im_end|>\n"),
    # Llama 3's chat layout.
    "llama3": ChatPromptFormat("llama3", header="<|start_header_id|>{role}<|end_header_id|>\n\n",
                               turn_end="<|eot_id|>", conversation_start="<|begin_of_text|>"),
    # Role names as plain text, for tokenizers without chat markers.
    "plain": ChatPromptFormat("plain", header="{role}: ", turn_end="\n\n"),
}
DEFAULT_PROMPT_FORMAT = "chatml"


def prompt_format(name):
    """The registered format called `name` (--sft-tokenizer-prompt-format)."""
    if name not in PROMPT_FORMATS:
        raise ValueError(f"--sft-tokenizer-prompt-format {name!r} is not one of {', '.join(sorted(PROMPT_FORMATS))}; "
                         "these formats write their markers as text, so any tokenizer reads them (upstream's "
                         "tokenizer-specific formats such as nemotron-h-aligned are not available)")
    return PROMPT_FORMATS[name]


def chat_prompt_format_for_flag(name, flag="--chat-prompt-format"):
    """The registered format a generation program's `flag` names (the format the model was fine-tuned with)."""
    if name not in PROMPT_FORMATS:
        raise ValueError(f"{flag} {name!r} is not one of {', '.join(sorted(PROMPT_FORMATS))}: give the format the "
                         "model was fine-tuned with (its --sft-tokenizer-prompt-format)")
    return PROMPT_FORMATS[name]


def check_messages(messages, where="conversation"):
    """Raise naming the message when `messages` is not a non-empty list of {role, content} with a known role."""
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{where}: 'messages' must be a non-empty list of {{\"role\": ..., \"content\": ...}}, got "
                         f"{type(messages).__name__}")
    for position, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("content"), str):
            raise ValueError(f"{where}, message {position}: each message needs a string 'content', got {message!r:.80}")
        if message.get("role") not in ROLES:
            raise ValueError(f"{where}, message {position}: role {message.get('role')!r} is not one of "
                             f"{', '.join(ROLES)}")


def conversation_pieces(messages, chat_format, add_generation_prompt=False):
    """[(text, trained)] in order: the rendered conversation, each piece marked by whether the loss trains on it."""
    pieces = [(chat_format.conversation_start, False)] if chat_format.conversation_start else []
    for message in messages:
        trained = message["role"] == "assistant"
        pieces.append((chat_format.header.format(role=message["role"]), False))
        pieces.append((message["content"] + chat_format.turn_end, trained))
    if add_generation_prompt:
        pieces.append((chat_format.header.format(role="assistant"), False))
    return [(text, trained) for text, trained in pieces if text]


def text_ids(tokenizer, text):
    """The ids of `text` alone, without the special tokens a tokenizer adds to a whole text (a Hugging Face
    post-processor's BOS / EOS, Llama 2's `bos`)."""
    parameters = inspect.signature(tokenizer.tokenize).parameters
    if "add_special_tokens" in parameters:
        return list(tokenizer.tokenize(text, add_special_tokens=False))
    options = {name: False for name in ("bos", "eos") if name in parameters}
    return list(tokenizer.tokenize(text, **options))


def leading_special_ids(tokenizer, probe="a"):
    """The ids a tokenizer puts before a whole text of its own (a beginning-of-sequence id), found by locating the
    ids of `probe` alone in `tokenize(probe)`; [] for a tokenizer that adds none."""
    whole, alone = list(tokenizer.tokenize(probe)), text_ids(tokenizer, probe)
    for start in range(len(whole) - len(alone) + 1):
        if whole[start:start + len(alone)] == alone:
            return whole[:start]
    return []


def tokenize_conversation(tokenizer, messages, chat_format, add_generation_prompt=False, append_eod=True):
    """(tokens, target) of one conversation, both lists of ints: `target[i]` is `tokens[i]` where the loss trains
    on that id and `IGNORE_INDEX` elsewhere. With `append_eod` the end-of-document id closes the conversation
    (trained when the last message is the assistant's); a generation prompt leaves it off."""
    if isinstance(chat_format, str):
        chat_format = prompt_format(chat_format)
    check_messages(messages)
    tokens, target = [], []
    for text, trained in conversation_pieces(messages, chat_format, add_generation_prompt):
        ids = text_ids(tokenizer, text)
        tokens += ids
        target += ids if trained else [IGNORE_INDEX] * len(ids)
    # The tokenizer's own beginning-of-sequence id opens the conversation, once (unless the format writes it).
    leading = leading_special_ids(tokenizer)
    if leading and tokens[:len(leading)] != leading:
        tokens, target = leading + tokens, [IGNORE_INDEX] * len(leading) + target
    if append_eod and not add_generation_prompt:
        tokens.append(tokenizer.eod)
        target.append(tokenizer.eod if messages[-1]["role"] == "assistant" else IGNORE_INDEX)
    return tokens, target
