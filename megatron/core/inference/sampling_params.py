"""`SamplingParams`: how the next token is chosen and how long a generation runs (upstream's name and defaults).

`top_k == 1` is greedy decoding (the example script's default, as upstream's). Otherwise the logits are divided
by `temperature` and, with `top_k > 1`, all but the k most likely tokens are dropped, or with `top_p > 0` all
but the smallest set of most likely tokens whose probability reaches `top_p` (nucleus sampling); `top_k == 0`
and `top_p == 0` sample from the whole distribution. Top-k and top-p cannot be combined (as upstream).
"""

from dataclasses import dataclass


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 0.0
    return_log_probs: bool = False
    num_tokens_to_generate: int = 30

    def __post_init__(self):
        if not self.temperature > 0:
            raise ValueError(f"--temperature must be > 0, got {self.temperature} (use --top_k 1 for greedy decoding)")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"--top_k must be an integer >= 0, got {self.top_k!r}")
        if not 0.0 <= self.top_p <= 1.0:
            raise ValueError(f"--top_p must be in [0, 1], got {self.top_p}")
        if self.top_k > 0 and self.top_p > 0.0:
            raise ValueError(f"--top_k {self.top_k} and --top_p {self.top_p}: set only one of them (the other to 0)")
        if not isinstance(self.num_tokens_to_generate, int) or self.num_tokens_to_generate < 1:
            raise ValueError(f"--num-tokens-to-generate must be an integer >= 1, got {self.num_tokens_to_generate!r}")

    @property
    def greedy(self) -> bool:
        return self.top_k == 1
