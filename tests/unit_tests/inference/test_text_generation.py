"""The newline options' token ids come from the text alone, also for Hugging Face tokenizers that add a BOS (and
an EOS) to every encoded string, as upstream's `tokenizer(text)` does."""

from megatron.inference.generation_request import GenerationRequest
from megatron.inference.text_generation import newline_rules_for

IDS = {"\n": 7, "\n\n": 8, ":": 9}


class _BosAddingTokenizer:
    bos, eod = 1, 2

    def tokenize(self, text, add_special_tokens=True):
        ids = [IDS[text]]
        return [self.bos, *ids, self.eod] if add_special_tokens else ids


class _PlainTokenizer:
    def tokenize(self, text):
        return [IDS[text]]


def test_newline_ids_leave_out_the_special_tokens_a_tokenizer_adds():
    request = GenerationRequest(prompts=["a"], stop_on_eol=True, prevent_newline_after_colon=True)
    for tokenizer in (_BosAddingTokenizer(), _PlainTokenizer()):
        rules = newline_rules_for(request, tokenizer)
        assert (rules.newline_id, rules.double_newline_id, rules.colon_id) == (7, 8, 9)
