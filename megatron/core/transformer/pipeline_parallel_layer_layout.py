"""`--pipeline-model-parallel-layout`: upstream Megatron-LM's language for placing layers on pipeline stages.

A layout lists the virtual pipeline stages in order, separated by `|`: virtual stage `c * p + r` is model chunk `c`
of pipeline rank `r`, so a layout of `p * v` stages gives every rank `v` chunks. Symbols:

    E   the embedding (must open the first stage)
    t   one transformer layer
    L   the loss: final norm, output layer and loss (must close the last stage)
    m   a multi-token-prediction depth (`--mtp-num-layers`): all of them in the last stage, just before `L`

`X*N` repeats the symbol or parenthesised group `X` N times (N >= 0; groups nest and may contain `|`);
whitespace and commas are ignored (they only help reading). A stage may hold no transformer layer: it then
passes its input through. Examples with p = 2: `Ett|ttL` (two layers each), `E|t*4L` (the embedding alone
on rank 0), `Et|(tt|)*2tL` (p = 2, v = 2: 1, 2, 2, 1 layers of six), `Ett|ttmL` (one MTP depth).

Grammar (after dropping whitespace and commas):

    sequence := item*
    item     := atom ('*' digits)?
    atom     := 'E' | 't' | 'L' | 'm' | '|' | '(' sequence ')'

Differences from upstream's regular-expression parser, which agrees on every layout it accepts: nested groups
expand from the inside out, and `X*N*M` is an error instead of being read as something else.

Pure parsing and arithmetic: no torch, no process groups.
"""

from typing import Optional, Sequence, Tuple, Union

EMBEDDING = "E"
DECODER = "t"
LOSS = "L"
MTP = "m"
SYMBOLS = (EMBEDDING, DECODER, LOSS, MTP)
STAGE_SEPARATOR = "|"
LAYOUT_FLAG = "--pipeline-model-parallel-layout"
_IGNORED = set(" \t\r\n,")


class _Parser:
    """Recursive descent over the layout text, producing a flat token list (symbols and separators)."""

    def __init__(self, text: str):
        self.text = text
        self.position = 0

    def error(self, what: str) -> ValueError:
        return ValueError(f"{LAYOUT_FLAG} {self.text!r}: {what} at character {self.position + 1}")

    def _skip_ignored(self):
        while self.position < len(self.text) and self.text[self.position] in _IGNORED:
            self.position += 1

    def _peek(self) -> Optional[str]:
        self._skip_ignored()
        return self.text[self.position] if self.position < len(self.text) else None

    def parse(self):
        tokens = self._sequence()
        if self._peek() is not None:  # only an unmatched ')' stops a top-level sequence
            raise self.error("')' without a matching '('")
        return tokens

    def _sequence(self):
        tokens = []
        while (char := self._peek()) is not None and char != ")":
            tokens += self._item()
        return tokens

    def _item(self):
        atom = self._atom()
        if self._peek() != "*":
            return atom
        self.position += 1
        count = self._count()
        if self._peek() == "*":
            raise self.error("a repetition of a repetition ('X*N*M'); write '(X*N)*M'")
        return atom * count

    def _atom(self):
        char = self._peek()
        if char in SYMBOLS or char == STAGE_SEPARATOR:
            self.position += 1
            return [char]
        if char == "(":
            self.position += 1
            group = self._sequence()
            if self._peek() != ")":
                raise self.error("'(' without a matching ')'")
            self.position += 1
            return group
        if char == "*":
            raise self.error("'*N' must follow a symbol or a parenthesised group")
        raise self.error(f"unknown symbol {char!r} (expected one of E t L m | ( ) *N)")

    def _count(self) -> int:
        self._skip_ignored()
        start = self.position
        while self.position < len(self.text) and self.text[self.position].isdigit():
            self.position += 1
        if start == self.position:
            raise self.error("'*' must be followed by a repetition count")
        return int(self.text[start:self.position])


def parse_layout_stages(text: str) -> Tuple[Tuple[str, ...], ...]:
    """The stages of a layout string, each a tuple of symbols, in virtual-stage order."""
    if not isinstance(text, str):
        raise TypeError(f"{LAYOUT_FLAG} must be a string, got {type(text).__name__}")
    stages, current = [], []
    for token in _Parser(text).parse():
        if token == STAGE_SEPARATOR:
            stages.append(tuple(current))
            current = []
        else:
            current.append(token)
    stages.append(tuple(current))
    return tuple(stages)


class PipelineParallelLayerLayout:
    """A parsed layout (upstream's class name): `stages` in virtual-stage order, for a pipeline of
    `pipeline_model_parallel_size` ranks. Construction checks only the stage count against the pipeline size;
    `validate_layer_layout(num_layers)` checks the rest. Hashable and comparable, so it can sit in a frozen config.

    Args: layout: the layout string, or a list of stages (each a list or string of symbols).
    """

    def __init__(self, layout: Union[str, Sequence[Sequence[str]]], pipeline_model_parallel_size: int):
        if isinstance(layout, str):
            self.text = layout
            stages = parse_layout_stages(layout)
        else:
            stages = tuple(tuple(stage) for stage in layout)
            self.text = STAGE_SEPARATOR.join("".join(stage) for stage in stages)
            for stage in stages:
                for symbol in stage:
                    if symbol not in SYMBOLS:
                        raise ValueError(f"{LAYOUT_FLAG}: unknown symbol {symbol!r} in stage {stage!r} "
                                         "(expected one of E t L m)")
        pp = pipeline_model_parallel_size
        if not isinstance(pp, int) or pp < 1:
            raise ValueError(f"--pipeline-model-parallel-size must be a positive integer, got {pp!r}")
        if len(stages) % pp != 0:
            raise ValueError(
                f"{LAYOUT_FLAG} {self.text!r} has {len(stages)} stages, not a multiple of "
                f"--pipeline-model-parallel-size ({pp}): give every pipeline rank the same number of virtual "
                "stages ('|' separates stages)"
            )
        self.stages: Tuple[Tuple[str, ...], ...] = stages
        self.pipeline_model_parallel_size = pp

    @staticmethod
    def parse_str_to_list(layout: str):
        """Upstream's helper: the stages as lists of symbols."""
        return [list(stage) for stage in parse_layout_stages(layout)]

    @staticmethod
    def get_num_stages_from_str(layout: str) -> int:
        return len(parse_layout_stages(layout))

    @property
    def virtual_pipeline_model_parallel_size(self) -> int:
        """Virtual stages (model chunks) per pipeline rank."""
        return len(self.stages) // self.pipeline_model_parallel_size

    def decoder_layer_counts(self) -> Tuple[int, ...]:
        """Transformer layers of each virtual stage, in virtual-stage order."""
        return tuple(stage.count(DECODER) for stage in self.stages)

    def validate_layer_layout(self, num_layers: int, mtp_num_layers: Optional[int] = None):
        """Raise ValueError unless the layout places exactly `num_layers` transformer layers, the embedding at
        the start of the first stage and the loss at the end of the last, and any multi-token-prediction depths
        (`m`) together just before the loss. `mtp_num_layers` (`--mtp-num-layers`, 0 for none) must then equal
        the count of `m`; None leaves the count unchecked (a caller that does not know the flag)."""
        placed = sum(self.decoder_layer_counts())
        if placed != num_layers:
            raise ValueError(
                f"{LAYOUT_FLAG} {self.text!r} places {placed} transformer layers ('t') but --num-layers is "
                f"{num_layers}; make them agree"
            )
        for symbol, name, where, stage_index, position in (
            (EMBEDDING, "embedding", "first symbol of the first stage", 0, 0),
            (LOSS, "loss", "last symbol of the last stage", len(self.stages) - 1, -1),
        ):
            found = sum(stage.count(symbol) for stage in self.stages)
            stage = self.stages[stage_index]
            if found != 1 or not stage or stage[position] != symbol:
                if found == 1:
                    at = next(index for index, candidate in enumerate(self.stages) if symbol in candidate)
                    seen = f"found in stage {at} of stages 0-{len(self.stages) - 1}"
                    if not stage:
                        seen += f", and stage {stage_index} is empty"
                else:
                    seen = f"found {found}"
                raise ValueError(
                    f"{LAYOUT_FLAG} {self.text!r}: the {name} ('{symbol}') must appear once, as the {where} "
                    f"({seen}); e.g. 'Ett|ttL'"
                )
        self._validate_mtp_placement(mtp_num_layers)

    def mtp_layer_count(self) -> int:
        """Multi-token-prediction depths (`m`) the layout places."""
        return sum(stage.count(MTP) for stage in self.stages)

    def _validate_mtp_placement(self, mtp_num_layers):
        found = self.mtp_layer_count()
        if mtp_num_layers is not None and found != mtp_num_layers:
            raise ValueError(
                f"{LAYOUT_FLAG} {self.text!r} places {found} multi-token-prediction depths ('m') but "
                f"--mtp-num-layers is {mtp_num_layers or 'unset'}; make them agree (e.g. 'Ett|tt"
                f"{'m' * max(mtp_num_layers or 1, 1)}L')"
            )
        if not found:
            return
        last = self.stages[-1]
        # The depths run after the decoder's last layer on the last stage and feed the loss: '...t m m L'.
        expected_tail = (MTP,) * found + (LOSS,)
        if any(MTP in stage for stage in self.stages[:-1]) or last[-len(expected_tail):] != expected_tail:
            raise ValueError(
                f"{LAYOUT_FLAG} {self.text!r}: the multi-token-prediction depths ('m') must all sit in the last "
                "stage, after its transformer layers and just before the loss ('L'), e.g. 'Et|tt|tmL'"
            )

    def __eq__(self, other):
        if not isinstance(other, PipelineParallelLayerLayout):
            return NotImplemented
        return (self.stages, self.pipeline_model_parallel_size) == (other.stages, other.pipeline_model_parallel_size)

    def __hash__(self):
        return hash((self.stages, self.pipeline_model_parallel_size))

    def __repr__(self):
        return self.text
