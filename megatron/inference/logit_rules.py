"""A model wrapped so that a generation rule adjusts the logits of each row's next token (the server's newline
options, a chat reply's end-of-turn marker): the wrapper runs the model through `decode_forward` and hands the
last stage's logits to the rule. A rule ends a row by leaving the end-of-document token as its only choice."""

from typing import Sequence

import torch

from megatron.core.inference.pipeline_decoding import decode_forward


class LogitRulesModel(torch.nn.Module):
    """`model` whose logits `apply_rules(logits, tokens, inference_context)` adjusts in place. `prompt_lengths` are
    the rows' prompt lengths of one static batch, decoded from position 0. With a pipeline stage as `model` it
    returns None on the stages before the last (the last stage applies the rules)."""

    def __init__(self, model, prompt_lengths: Sequence[int], eod_id: int):
        super().__init__()
        self.model = model
        self.prompt_lengths = list(prompt_lengths)
        self.eod_id = eod_id
        self.train(model.training)  # generation restores this mode afterwards: keep the model's

    def forward(self, tokens, position_ids, inference_context=None, runtime_gather_output=True):
        """The logits over the whole vocabulary (the rules read it by token id), as `decode_forward` asks."""
        name = type(self).__name__
        if not runtime_gather_output:
            raise ValueError(f"{name} returns the logits gathered over tensor-parallel ranks: pass "
                             "runtime_gather_output=True")
        if position_ids is not None:
            raise ValueError(f"{name} decodes the positions of the context's offset: pass position_ids=None")
        logits = decode_forward(self.model, tokens, inference_context)
        if logits is not None:
            self.apply_rules(logits, tokens, inference_context)
        return logits

    def apply_rules(self, logits, tokens, inference_context):
        raise NotImplementedError

    def force_stop(self, logits, row):
        """Row `row`'s next token can only be the end-of-document token."""
        logits[row, -1] = float("-inf")
        logits[row, -1, self.eod_id] = 0.0
