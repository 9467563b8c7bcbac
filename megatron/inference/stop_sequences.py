"""Stop a generated sequence once it ends with one of some token sequences (a chat format's end-of-turn marker),
applied to the logits the model returns.

The generation loop stops a sequence only at the end-of-document token, so a stop is made by leaving the
end-of-document token as the only choice of the step after the stop sequence (as `newline_rules` does for a
newline). Only generated tokens are matched: a prompt that ends with a stop sequence does not stop.
"""

from typing import Sequence

import torch

from megatron.core.inference.pipeline_decoding import decode_forward


class StopSequencesModel(torch.nn.Module):
    """`model` whose rows, once their generated tokens end with one of `stop_sequences` (lists of token ids), can
    only generate the end-of-document token next. `prompt_lengths` are the rows' prompt lengths of one static batch,
    decoded from position 0. With a pipeline stage as `model` it returns None on the stages before the last."""

    def __init__(self, model, stop_sequences: Sequence[Sequence[int]], prompt_lengths: Sequence[int], eod_id: int):
        super().__init__()
        self.model = model
        self.stop_sequences = [list(sequence) for sequence in stop_sequences if sequence]
        self.prompt_lengths = list(prompt_lengths)
        self.eod_id = eod_id
        self.generated = [[] for _ in self.prompt_lengths]  # each row's generated tokens read so far
        self.train(model.training)  # generation restores this mode afterwards: keep the model's

    def forward(self, tokens, position_ids, inference_context=None, runtime_gather_output=True):
        """The logits over the whole vocabulary, as `decode_forward` asks."""
        if not runtime_gather_output:
            raise ValueError("StopSequencesModel returns the logits gathered over tensor-parallel ranks: pass "
                             "runtime_gather_output=True")
        if position_ids is not None:
            raise ValueError("StopSequencesModel decodes the positions of the context's offset: pass position_ids=None")
        logits = decode_forward(self.model, tokens, inference_context)
        if logits is None:  # a pipeline stage before the last: the last stage stops the rows
            return None
        first_position = inference_context.sequence_len_offset
        for row, prompt_length in enumerate(self.prompt_lengths):
            skipped = max(0, prompt_length - first_position)  # this step's inputs that are still the prompt's
            self.generated[row] += tokens[row, skipped:].tolist()
            if any(self._ends_with(row, sequence) for sequence in self.stop_sequences):
                logits[row, -1] = float("-inf")
                logits[row, -1, self.eod_id] = 0.0
        return logits

    def _ends_with(self, row, sequence):
        generated = self.generated[row]
        return len(generated) >= len(sequence) and generated[-len(sequence):] == sequence
