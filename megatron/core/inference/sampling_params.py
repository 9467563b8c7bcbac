"""`SamplingParams`: how the next token is chosen and how long a generation runs (upstream's name and defaults).

`top_k == 1` is greedy decoding (the example script's default, as upstream's; the temperature is then unused and
may be 0). Otherwise the logits are divided by `temperature` and, with `top_k > 1`, all but the k most likely
tokens are dropped, or with `top_p > 0` all but the smallest set of most likely tokens whose probability reaches
`top_p` (nucleus sampling); `top_k == 0` and `top_p == 0` sample from the whole distribution. Top-k and top-p
cannot be combined (as upstream).

`top_p_decay` / `top_p_bound` (upstream's text-generation server fields; 0 turns each off) shrink the nucleus per
step: after each token is chosen, `top_p <- max(top_p * top_p_decay, top_p_bound)` (`sampling.params_for_next_step`).

`return_log_probs` adds the log-probability of every prompt token after the first and every generated token;
`top_n_logprobs > 0` the `top_n_logprobs` most likely tokens of each generated position with their
log-probabilities (and of each prompt position after the first with `return_prompt_top_n_logprobs`), both under the
model's distribution over the real vocabulary (`log_probs`).

`skip_prompt_log_probs` (with `return_log_probs`) leaves the prompt's out: `prompt_log_probs` stays None.
`return_segments` adds `segments`, the generated text split at its tokens (their concatenation is the text).
`add_BOS` puts the tokenizer's beginning-of-sequence id before every prompt given as text.

A sequence stops after `num_tokens_to_generate` new tokens, or with `num_tokens_total` once prompt and generated
tokens are that many (set one of the two; neither given means `num_tokens_to_generate=30`), or once it generates
`termination_id` (None: the tokenizer's end-of-document id), which it keeps as its last token.

As upstream's, the params may be changed after they are made (`params.top_k = 1`, `add_attributes({...})`): they
are checked when made and again when a generation starts (`check`).
"""

from dataclasses import dataclass
from typing import Optional

DEFAULT_NUM_TOKENS_TO_GENERATE = 30  # upstream's


@dataclass
class SamplingParams:
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 0.0
    return_log_probs: bool = False
    num_tokens_to_generate: Optional[int] = None  # 30 unless num_tokens_total is given
    top_p_decay: float = 0.0
    top_p_bound: float = 0.0
    top_n_logprobs: int = 0
    return_prompt_top_n_logprobs: bool = False
    termination_id: Optional[int] = None
    skip_prompt_log_probs: bool = False
    return_segments: bool = False
    num_tokens_total: Optional[int] = None
    add_BOS: bool = False

    def __post_init__(self):
        if self.num_tokens_to_generate is None and self.num_tokens_total is None:
            self.num_tokens_to_generate = DEFAULT_NUM_TOKENS_TO_GENERATE
        self.check()

    def check(self):
        """Raise ValueError naming the flag when these params cannot generate."""
        # Greedy decoding ignores the temperature, so it may be 0 there (as upstream's, which never divides by it).
        if not (self.temperature > 0 or (self.temperature == 0 and self.top_k == 1)):
            raise ValueError(f"--temperature must be > 0, got {self.temperature} (use --top_k 1 for greedy decoding, "
                             "where a temperature of 0 is accepted)")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"--top_k must be an integer >= 0, got {self.top_k!r}")
        if not 0.0 <= self.top_p <= 1.0:
            raise ValueError(f"--top_p must be in [0, 1], got {self.top_p}")
        if self.top_k > 0 and self.top_p > 0.0:
            raise ValueError(f"--top_k {self.top_k} and --top_p {self.top_p}: set only one of them (the other to 0)")
        for name in ("top_p_decay", "top_p_bound"):
            if getattr(self, name) != 0.0 and self.top_p == 0.0:
                raise ValueError(f"{name} cannot be set without top_p: set top_p > 0 or leave {name} at 0")
        if not 0.0 <= self.top_p_decay <= 1.0:
            raise ValueError(f"top_p_decay must be in [0, 1] (0: top_p stays fixed), got {self.top_p_decay}")
        if not 0.0 <= self.top_p_bound <= self.top_p:
            raise ValueError(f"top_p_bound must be in [0, top_p {self.top_p}] (0: no bound), got {self.top_p_bound}")
        if (self.num_tokens_to_generate is None) == (self.num_tokens_total is None):
            raise ValueError(f"num_tokens_to_generate {self.num_tokens_to_generate} and num_tokens_total "
                             f"{self.num_tokens_total}: set exactly one of them (the other to None)")
        if self.num_tokens_to_generate is not None and (not isinstance(self.num_tokens_to_generate, int)
                                                        or self.num_tokens_to_generate < 1):
            raise ValueError(f"--num-tokens-to-generate must be an integer >= 1, got {self.num_tokens_to_generate!r}")
        if self.num_tokens_total is not None and (not isinstance(self.num_tokens_total, int)
                                                  or isinstance(self.num_tokens_total, bool)
                                                  or self.num_tokens_total < 2):
            raise ValueError(f"num_tokens_total (prompt plus generated tokens) must be an integer >= 2, got "
                             f"{self.num_tokens_total!r}")
        if not isinstance(self.top_n_logprobs, int) or isinstance(self.top_n_logprobs, bool) \
                or self.top_n_logprobs < 0:
            raise ValueError(f"--top-n-logprobs must be an integer >= 0 (0: none), got {self.top_n_logprobs!r}")
        if self.return_prompt_top_n_logprobs and self.top_n_logprobs == 0:
            raise ValueError("return_prompt_top_n_logprobs needs top_n_logprobs > 0 (how many tokens to list)")
        if self.termination_id is not None and (not isinstance(self.termination_id, int)
                                                or isinstance(self.termination_id, bool) or self.termination_id < 0):
            raise ValueError(f"termination_id must be a token id >= 0 or None (the end-of-document id), got "
                             f"{self.termination_id!r}")

    def add_attributes(self, attribute_value_pair: dict):
        """Set several attributes at once (upstream's helper); checked when a generation starts."""
        for key, value in attribute_value_pair.items():
            setattr(self, key, value)

    def tokens_to_generate(self, prompt_length: int) -> int:
        """How many tokens a prompt of `prompt_length` tokens may generate."""
        if self.num_tokens_total is None:
            return self.num_tokens_to_generate
        return self.num_tokens_total - prompt_length

    @property
    def greedy(self) -> bool:
        return self.top_k == 1
