"""`SFTTokenizer` (upstream's `--tokenizer-type SFTTokenizer`): the Hugging Face tokenizer of `--tokenizer-model`
that also renders chat conversations in `--sft-tokenizer-prompt-format`
(megatron/training/tokenizer/chat_prompt_formats.py)."""

import numpy as np

from megatron.training.tokenizer.chat_prompt_formats import DEFAULT_PROMPT_FORMAT, prompt_format, tokenize_conversation
from megatron.training.tokenizer.huggingface_tokenizer import HuggingFaceTokenizer


class SFTTokenizer(HuggingFaceTokenizer):
    """A `HuggingFaceTokenizer` with upstream's `tokenize_conversation`; `--sft` datasets render conversations the
    same way whatever the tokenizer type."""

    def __init__(self, tokenizer_model, prompt_format_name=None, **tokenizer_options):
        super().__init__(tokenizer_model, **tokenizer_options)
        self.prompt_format = prompt_format(prompt_format_name or DEFAULT_PROMPT_FORMAT)
        self.unique_identifiers["prompt_format"] = self.prompt_format.name

    def tokenize_conversation(self, conversation, return_target=True, add_generation_prompt=False):
        """Upstream's signature: the conversation's ids, and with `return_target` also the target (each trained id,
        `IGNORE_INDEX` elsewhere), as int64 arrays."""
        tokens, target = tokenize_conversation(self, conversation, self.prompt_format, add_generation_prompt)
        tokens, target = np.asarray(tokens, dtype=np.int64), np.asarray(target, dtype=np.int64)
        return (tokens, target) if return_target else tokens
