"""Stop a generated sequence once it ends with one of some token sequences (a chat format's end-of-turn marker),
applied to the logits the model returns.

The generation loop stops a sequence only at the end-of-document token, so a stop is made by leaving the
end-of-document token as the only choice of the step after the stop sequence (as `newline_rules` does for a
newline). Only generated tokens are matched: a prompt that ends with a stop sequence does not stop.
"""

from typing import Sequence

from megatron.inference.logit_rules import LogitRulesModel


class StopSequencesModel(LogitRulesModel):
    """`model` whose rows, once their generated tokens end with one of `stop_sequences` (lists of token ids), can
    only generate the end-of-document token next; see `LogitRulesModel`."""

    def __init__(self, model, stop_sequences: Sequence[Sequence[int]], prompt_lengths: Sequence[int], eod_id: int):
        super().__init__(model, prompt_lengths, eod_id)
        self.stop_sequences = [list(sequence) for sequence in stop_sequences if sequence]
        self.generated = [[] for _ in self.prompt_lengths]  # each row's generated tokens read so far

    def apply_rules(self, logits, tokens, inference_context):
        first_position = inference_context.sequence_len_offset
        for row, prompt_length in enumerate(self.prompt_lengths):
            skipped = max(0, prompt_length - first_position)  # this step's inputs that are still the prompt's
            self.generated[row] += tokens[row, skipped:].tolist()
            if any(self._ends_with(row, sequence) for sequence in self.stop_sequences):
                self.force_stop(logits, row)

    def _ends_with(self, row, sequence):
        generated = self.generated[row]
        return len(generated) >= len(sequence) and generated[-len(sequence):] == sequence
