"""Greedy generation speed of a GPT checkpoint with and without the key/value cache: prefill, decoding steps and
tokens/s of one batch of prompts, best of `--benchmark-repeats` runs.

    torchrun --nproc-per-node 1 examples/inference/gpt/benchmark_kv_cache.py \
        --load CKPT_DIR --use-checkpoint-args --tokenizer-type ByteLevelTokenizer --distributed-backend gloo \
        --num-tokens-to-generate 64 --inference-max-requests 8

Takes gpt_static_inference.py's flags; without `--prompts` / `--prompt-file` it generates from eight built-in
prompts of different lengths. With the cache, the prompts are generated as gpt_static_inference.py generates
them (`generate_in_batches`). Without it, every step runs the whole batch, right-padded to its longest sequence,
through the model again (no context; the causal mask keeps each sequence's logits free of the padding after
it). Both are greedy; the benchmark checks that they choose the same tokens. One pipeline stage only
(`--pipeline-model-parallel-size 1`). Results in docs/inference.md.
"""

import os
import sys
import time

import torch
import torch.distributed as dist

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

from examples.inference.gpt import gpt_static_inference  # noqa: E402
from megatron.core.inference.sampling_params import SamplingParams  # noqa: E402
from megatron.core.inference.static_generation import generate_in_batches  # noqa: E402

BUILT_IN_PROMPTS = [
    "def ",
    "Return the number of",
    "The path",
    "If the argument is omitted, the",
    "import os\n",
    "Raise ValueError if",
    "This module provides access to the",
    "class ",
]


@torch.no_grad()
def generate_greedy_without_cache(model, prompts, num_tokens_to_generate, pad_id=0, vocab_size=None):
    """`num_tokens_to_generate` greedy tokens for each prompt (token ids), every step a full forward of the batch
    over all positions so far; no end-of-document stop. `vocab_size` is the tokenizer's vocabulary (the padding
    rows of the model's are never chosen, as with the cache); None: the model's whole vocabulary. Returns one
    list of new tokens per prompt."""
    device = next(model.parameters()).device
    lengths = torch.tensor([len(prompt) for prompt in prompts], device=device)
    tokens = torch.full((len(prompts), int(lengths.max()) + num_tokens_to_generate), pad_id, dtype=torch.long,
                        device=device)
    for row, prompt in enumerate(prompts):
        tokens[row, :len(prompt)] = torch.tensor(list(prompt), dtype=torch.long, device=device)
    rows = torch.arange(len(prompts), device=device)
    was_training = model.training
    model.eval()
    try:
        for step in range(num_tokens_to_generate):
            end = int(lengths.max()) + step  # positions 0 .. end - 1 hold every sequence so far
            position_ids = torch.arange(end, device=device).unsqueeze(0).expand(len(prompts), end)
            logits = model(tokens[:, :end], position_ids, runtime_gather_output=True)[..., :vocab_size]
            tokens[rows, lengths + step] = logits[rows, lengths + step - 1].argmax(-1)
    finally:
        model.train(was_training)
    return [tokens[row, length:length + num_tokens_to_generate].tolist() for row, length in enumerate(lengths.tolist())]


class ForwardTimer:
    """Wall time of each forward call of a model (forward hooks): the first call of a cached generation is its
    prefill, the others its decoding steps."""

    def __init__(self, model):
        self.durations = []
        self._started = None
        self._handles = [model.register_forward_pre_hook(self._pre), model.register_forward_hook(self._post)]

    def _pre(self, module, inputs):
        self._started = time.perf_counter()

    def _post(self, module, inputs, output):
        self.durations.append(time.perf_counter() - self._started)

    def remove(self):
        for handle in self._handles:
            handle.remove()


def _timed(model, generate):
    timer = ForwardTimer(model)
    try:
        started = time.perf_counter()
        result = generate()
        return result, time.perf_counter() - started, timer.durations
    finally:
        timer.remove()


def benchmark(model, prompt_tokens, num_tokens_to_generate, eod_id, vocab_size, max_sequence_length,
              max_batch_size, repeats):
    """Best-of-`repeats` timings of greedy generation with and without the cache: a dict per mode with
    `seconds`, `prefill_seconds`, `forward_calls` and `generated_tokens`. Raises if the tokens differ."""
    params = SamplingParams(top_k=1, num_tokens_to_generate=num_tokens_to_generate)
    best = {}
    for _ in range(repeats):
        cached, seconds, calls = _timed(model, lambda: generate_in_batches(
            model, prompt_tokens, params, eod_id=eod_id, max_sequence_length=max_sequence_length,
            max_batch_size=max_batch_size, vocab_size=vocab_size))
        cached_tokens = [result.generated_tokens for result in cached]
        uncached_tokens, uncached_seconds, uncached_calls = _timed(
            model, lambda: generate_greedy_without_cache(model, prompt_tokens, num_tokens_to_generate,
                                                        vocab_size=vocab_size))
        for mine, full in zip(cached_tokens, uncached_tokens):
            if mine != full[:len(mine)]:  # a cached sequence may stop early at end-of-document
                raise RuntimeError(f"greedy tokens with the cache {mine} differ from those without {full}")
        for mode, total, durations, generated in (
                ("kv cache", seconds, calls, sum(map(len, cached_tokens))),
                ("no cache", uncached_seconds, uncached_calls, sum(map(len, uncached_tokens)))):
            if mode not in best or total < best[mode]["seconds"]:
                best[mode] = {"seconds": total, "prefill_seconds": durations[0], "forward_calls": len(durations),
                              "generated_tokens": generated}
    return best


def add_benchmark_args(parser):
    gpt_static_inference.add_static_inference_args(parser)
    group = parser.add_argument_group("kv cache benchmark")
    group.add_argument("--benchmark-repeats", type=int, default=3, help="Runs of each mode; the fastest counts.")
    return parser


def run(args):
    if not args.prompts and args.prompt_file is None:
        args.prompts = BUILT_IN_PROMPTS
    gpt_static_inference.check_args(args)
    if args.pipeline_model_parallel_size > 1:
        raise ValueError(f"benchmark_kv_cache.py needs --pipeline-model-parallel-size 1 (got "
                         f"{args.pipeline_model_parallel_size}): its run without the cache calls the whole model; "
                         "gpt_static_inference.py generates with pipeline parallelism")
    tokenizer = gpt_static_inference.build_tokenizer(args)
    prompts, prompt_tokens, max_sequence_length = gpt_static_inference.tokenize_prompts(args, tokenizer)
    model = gpt_static_inference.load_model(args)
    best = benchmark(model, prompt_tokens, args.num_tokens_to_generate, tokenizer.eod, tokenizer.vocab_size,
                     max_sequence_length, args.inference_max_requests, args.benchmark_repeats)
    if dist.get_rank() == 0:
        print(f"{len(prompts)} prompts ({sum(map(len, prompt_tokens))} prompt tokens), {args.num_tokens_to_generate} "
              f"new tokens each, greedy, {dist.get_world_size()} rank(s), {torch.get_num_threads()} threads, "
              f"best of {args.benchmark_repeats}")
        print(f"{'mode':<9} {'forwards':>8} {'prefill s':>9} {'total s':>8} {'new tokens/s':>12}")
        for mode, timing in best.items():
            print(f"{mode:<9} {timing['forward_calls']:>8} {timing['prefill_seconds']:>9.3f} "
                  f"{timing['seconds']:>8.3f} {timing['generated_tokens'] / timing['seconds']:>12.1f}")
        speedup = best['no cache']['seconds'] / best['kv cache']['seconds']
        verdict = f"{speedup:.2f}x faster" if speedup >= 1 else f"{1 / speedup:.2f}x slower"
        print(f"the cache is {verdict}; both choose the same tokens", flush=True)
    return best


def main(argv=None):
    return gpt_static_inference.run_with_megatron(add_benchmark_args, run, argv)


if __name__ == "__main__":
    main()
