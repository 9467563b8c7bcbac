"""Upstream's newline options of a generation request, applied to the logits the model returns:

- `prevent_newline_after_colon`: after a ":" the newline token cannot be chosen (its logit is -inf);
- `stop_on_eol`: a sequence stops after it generates a newline (or a double-newline token);
- `stop_on_double_eol`: it stops after a double-newline token, or a newline that follows a newline.

The generation loop stops a sequence only at the end-of-document token, so a stop is made by leaving the
end-of-document token as the only choice of the step after the newline; `strip_forced_stop` removes that token
again. The newline kept in the output is the one upstream keeps. Token ids come from the tokenizer ("\\n", "\\n\\n"
and ":" must each be one token; "\\n\\n" may be none).
"""

from dataclasses import dataclass
from typing import List, Optional, Sequence

from megatron.inference.logit_rules import LogitRulesModel


@dataclass(frozen=True)
class NewlineRules:
    newline_id: int
    double_newline_id: Optional[int]
    colon_id: Optional[int]
    stop_on_eol: bool = False
    stop_on_double_eol: bool = False
    prevent_newline_after_colon: bool = False

    @property
    def active(self) -> bool:
        return self.stop_on_eol or self.stop_on_double_eol or self.prevent_newline_after_colon

    def stops_after(self, previous: int, last: int) -> bool:
        """True when a sequence whose last two tokens are `previous`, `last` (`last` generated) is done."""
        if last == self.double_newline_id and (self.stop_on_eol or self.stop_on_double_eol):
            return True
        if last != self.newline_id:
            return False
        return self.stop_on_eol or (self.stop_on_double_eol and previous == self.newline_id)


class NewlineRulesModel(LogitRulesModel):
    """`model` with `rules` applied to the logits of the last position of every row that is generating (its
    next token is past its prompt); see `LogitRulesModel`."""

    def __init__(self, model, rules: NewlineRules, prompt_lengths: Sequence[int], eod_id: int):
        super().__init__(model, prompt_lengths, eod_id)
        self.rules = rules
        self.last_tokens = [None] * len(self.prompt_lengths)  # the input token before this step's, per row

    def apply_rules(self, logits, tokens, inference_context):
        next_position = inference_context.sequence_len_offset + tokens.shape[1]
        for row, prompt_length in enumerate(self.prompt_lengths):
            last = int(tokens[row, -1])
            previous = int(tokens[row, -2]) if tokens.shape[1] > 1 else self.last_tokens[row]
            self.last_tokens[row] = last
            if next_position < prompt_length:
                continue  # the next token is the prompt's
            if next_position - 1 >= prompt_length and self.rules.stops_after(previous, last):
                self.force_stop(logits, row)
            elif self.rules.prevent_newline_after_colon and last == self.rules.colon_id:
                logits[row, -1, self.rules.newline_id] = float("-inf")


def strip_forced_stop(prompt_tokens: List[int], generated_tokens: List[int], rules: NewlineRules,
                      eod_id: int) -> List[int]:
    """`generated_tokens` without the end-of-document token that a newline stop added."""
    if len(generated_tokens) < 2 or generated_tokens[-1] != eod_id:
        return generated_tokens
    sequence = list(prompt_tokens) + list(generated_tokens)
    if rules.stops_after(sequence[-3] if len(sequence) >= 3 else None, sequence[-2]):
        return generated_tokens[:-1]
    return generated_tokens
