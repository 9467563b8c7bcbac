"""Generate text from a trained GPT checkpoint: static batches of prompts, decoded through a key/value cache.

    torchrun --nproc-per-node 1 examples/inference/gpt/gpt_static_inference.py \
        --load CKPT_DIR --use-checkpoint-args --tokenizer-type ByteLevelTokenizer --distributed-backend gloo \
        --prompts "def " "Return the" --num-tokens-to-generate 30

Takes pretrain_gpt.py's model and tokenizer flags (`--use-checkpoint-args` reads the model's from the
checkpoint) and `--load`; `--tensor-model-parallel-size 2` on 2 ranks splits the model, and so does
`--pipeline-model-parallel-size 2` (each stage its own layers; both: TP2 x PP2 on 4 ranks); the `torch_dist`
checkpoint reshards on load. No data-parallel wrapper is built; with more ranks than the model-parallel size
every data-parallel replica generates the same batches and rank 0 reports. Prompts come from `--prompts` or
`--prompt-file` (JSON lines with a "text" field); more of them than `--inference-max-requests` are generated in
several batches. Greedy by default (`--top_k 1`); `--temperature`, `--top_k`, `--top_p` and `--seed` select
sampling; `--return-log-probs` and `--top-n-logprobs N` add log-probabilities to the results. For a model fine-tuned
with `--sft`, `--chat-prompt-format` makes each prompt a user message in that chat format. See docs/inference.md.
"""

import json
import os
import sys
import time

import torch.distributed as dist

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

import pretrain_gpt  # noqa: E402
from megatron.core.inference.log_probs import top_n_by_text  # noqa: E402
from megatron.core.inference.sampling_params import SamplingParams  # noqa: E402
from megatron.core.inference.static_generation import check_prompts, generate_in_batches  # noqa: E402
from megatron.inference import launch  # noqa: E402
from megatron.inference.launch import build_tokenizer, run_with_megatron  # noqa: E402
from megatron.training.tokenizer.chat_prompt_formats import (  # noqa: E402
    PROMPT_FORMATS,
    chat_prompt_format_for_flag,
    check_messages,
    prompt_format,
    tokenize_conversation,
)


INFERENCE_MAX_REQUESTS = 8


def add_static_inference_args(parser):
    """Upstream's flags of static-batch generation (names and defaults)."""
    group = parser.add_argument_group("static inference")
    group.add_argument("--prompts", nargs="+", default=None, help="One or more prompts to generate from.")
    group.add_argument("--prompt-file", default=None,
                       help="JSON lines file of prompts: each line an object whose \"text\" field is a prompt "
                            "(other fields are ignored). Instead of --prompts.")
    group.add_argument("--prompt-file-num-truncate", type=int, default=None,
                       help="Use only the first N prompts of --prompt-file, in order.")
    group.add_argument("--num-tokens-to-generate", type=int, default=30, help="New tokens per prompt.")
    group.add_argument("--temperature", type=float, default=1.0,
                       help="Sampling temperature (> 0; unused by greedy --top_k 1, where 0 is accepted).")
    group.add_argument("--top_k", type=int, default=1, help="Top-k sampling; 1 is greedy, 0 keeps every token.")
    group.add_argument("--top_p", type=float, default=0.0, help="Top-p (nucleus) sampling; 0 turns it off.")
    group.add_argument("--return-log-probs", action="store_true",
                       help="Also compute the log-probability of every prompt and generated token.")
    group.add_argument("--top-n-logprobs", type=int, default=0,
                       help="Also list the N most likely tokens of every generated position, with their "
                            "log-probabilities (0: none).")
    group.add_argument("--output-path", default=None,
                       help="Write one JSON line per prompt (prompt, generated text, tokens, log-probs) here.")
    group.add_argument("--inference-max-seq-length", type=int, default=2560,
                       help="Key/value cache length: the longest prompt plus the generated tokens must fit (and "
                            "fit --max-position-embeddings).")
    group.add_argument("--inference-max-requests", type=int, default=INFERENCE_MAX_REQUESTS,
                       help="Key/value cache batch size: more prompts are generated in several batches.")
    group.add_argument("--max-batch-size", type=int, default=None,
                       help="Deprecated name of --inference-max-requests.")
    group.add_argument("--stream", action="store_true",
                       help="Print each prompt's new text as its tokens are generated (rank 0), before the results.")
    group.add_argument("--chat-prompt-format", default=None,
                       help="For a model fine-tuned with --sft: each prompt is a user message, rendered in this "
                            f"chat format ({', '.join(sorted(PROMPT_FORMATS))}) up to the assistant's header; "
                            "--prompt-file lines may then hold whole conversations as \"messages\"; the "
                            "generated text is the reply up to its end-of-turn marker.")
    return launch.declare_generation_program(parser)


def sampling_params_from_args(args) -> SamplingParams:
    return SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                          return_log_probs=args.return_log_probs,
                          num_tokens_to_generate=args.num_tokens_to_generate, top_n_logprobs=args.top_n_logprobs)


def _print_rank0(message):
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(message, flush=True)


def check_args(args):
    """Refuse what cannot generate, before a model is built (errors name the flag)."""
    if args.load is None:
        raise ValueError("gpt_static_inference.py needs --load: the checkpoint to generate from")
    if args.prompts and args.prompt_file is not None:
        raise ValueError("--prompts and --prompt-file are exclusive: give the prompts one way")
    if args.prompt_file is None and not args.prompts:
        raise ValueError("--prompts: give one or more prompts to generate from (or a --prompt-file)")
    if args.prompt_file_num_truncate is not None:
        if args.prompt_file is None:
            raise ValueError("--prompt-file-num-truncate needs --prompt-file")
        if args.prompt_file_num_truncate < 1:
            raise ValueError(f"--prompt-file-num-truncate must be at least 1, got {args.prompt_file_num_truncate}")
    if args.max_batch_size is not None:
        if args.inference_max_requests not in (INFERENCE_MAX_REQUESTS, args.max_batch_size):
            raise ValueError(f"--max-batch-size {args.max_batch_size} and --inference-max-requests "
                             f"{args.inference_max_requests} disagree: give only --inference-max-requests")
        _print_rank0(f"--max-batch-size is deprecated: use --inference-max-requests {args.max_batch_size}")
        args.inference_max_requests = args.max_batch_size
    if args.chat_prompt_format is not None:
        chat_prompt_format_for_flag(args.chat_prompt_format)
    launch.check_generation_args(args, _print_rank0)
    sampling_params_from_args(args)  # validates the sampling flags


def read_prompt_file(path, num_truncate=None, chat=False):
    """The prompts of a --prompt-file: the "text" field of each JSON line (blank lines skipped), the first
    `num_truncate` of them when given. With `chat` a line may instead hold a conversation, {"messages": [...]}
    (returned as that list), to be continued by the assistant."""
    prompts = []
    example = '{"text": "def "}' + (' or {"messages": [{"role": "user", "content": "Hi"}]}' if chat else "")
    with open(path) as prompt_file:
        for line_number, line in enumerate(prompt_file, start=1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"--prompt-file {path}: line {line_number} is not JSON ({error.msg}); write one "
                                 f"JSON object a line, such as {example}") from None
            if chat and isinstance(item, dict) and "messages" in item:
                check_messages(item["messages"], f"--prompt-file {path}: line {line_number}")
                prompts.append(item["messages"])
            elif not isinstance(item, dict) or not isinstance(item.get("text"), str):
                raise ValueError(f"--prompt-file {path}: line {line_number} has no string \"text\" field; write one "
                                 f"JSON object a line, such as {example}")
            else:
                prompts.append(item["text"])
            if num_truncate is not None and len(prompts) == num_truncate:
                break
    if not prompts:
        raise ValueError(f"--prompt-file {path} holds no prompts")
    return prompts


def prompt_tokens_of(prompt, tokenizer, chat_prompt_format=None):
    """The ids to continue: the prompt's, or with a chat format its conversation (a prompt string is one user
    message) rendered up to the assistant's header."""
    if chat_prompt_format is None:
        return tokenizer.tokenize(prompt)
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    return tokenize_conversation(tokenizer, messages, prompt_format(chat_prompt_format), add_generation_prompt=True)[0]


def tokenize_prompts(args, tokenizer):
    """(the prompts, their tokens, the cache length): every prompt plus --num-tokens-to-generate must fit
    --inference-max-seq-length and --max-position-embeddings (checked before a model is built)."""
    chat_format = getattr(args, "chat_prompt_format", None)
    prompts = args.prompts or read_prompt_file(args.prompt_file, args.prompt_file_num_truncate, chat_format is not None)
    prompt_tokens = [prompt_tokens_of(prompt, tokenizer, chat_format) for prompt in prompts]
    max_sequence_length, limit_flag = launch.generation_max_sequence_length(args)
    check_prompts(prompt_tokens, args.num_tokens_to_generate, max_sequence_length, limit_flag)
    return prompts, prompt_tokens, max_sequence_length


def load_model(args):
    """pretrain_gpt.py's model of this rank, unwrapped, with the weights of the latest checkpoint under --load."""
    return launch.load_model(args, pretrain_gpt.model_provider)


class TextStream:
    """--stream: prints, on rank 0, each prompt's text added by a step's new tokens (`stream <i>: '<text>'`); the
    end-of-document id adds no text. A token that only completes a character with the next one prints with it."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.tokens, self.printed = {}, {}

    def __call__(self, rows, tokens):
        for row, token in zip(rows, tokens):
            if token == self.tokenizer.eod:
                continue
            self.tokens.setdefault(row, []).append(token)
            text = self.tokenizer.detokenize(self.tokens[row])
            if text.endswith("\ufffd"):
                continue
            kept = len(os.path.commonprefix([text, self.printed.get(row, "")]))
            if len(text) > kept:
                _print_rank0(f"stream {row}: {text[kept:]!r}")
                self.printed[row] = text


def reply_of(text, chat_prompt_format):
    """With a chat format: the generated text up to the end of the assistant's turn (its end-of-turn marker and
    anything after it left out); the text itself otherwise."""
    if chat_prompt_format is None:
        return text
    for marker in prompt_format(chat_prompt_format).reply_ends:
        if marker and marker in text:
            return text[:text.index(marker)]
    return text


def result_record(prompt, result, tokenizer, chat_prompt_format=None):
    text_tokens = result.generated_tokens[:-1] if result.stopped_at_eod else result.generated_tokens
    text = reply_of(tokenizer.detokenize(text_tokens), chat_prompt_format)
    record = {"prompt": prompt, "generated_text": text,
              "prompt_tokens": result.prompt_tokens, "generated_tokens": result.generated_tokens,
              "stopped_at_eod": result.stopped_at_eod}
    if result.generated_log_probs is not None:
        record["prompt_log_probs"] = result.prompt_log_probs
        record["generated_log_probs"] = result.generated_log_probs
    if result.generated_top_n_logprobs is not None:
        record["generated_top_n_logprobs"] = top_n_by_text(result.generated_top_n_logprobs, tokenizer)
    return record


def run(args):
    """Load, generate, print (and write --output-path); returns the records (one per prompt)."""
    check_args(args)
    tokenizer = build_tokenizer(args)
    prompts, prompt_tokens, max_sequence_length = tokenize_prompts(args, tokenizer)
    params = sampling_params_from_args(args)
    model = load_model(args)
    started = time.perf_counter()
    results = generate_in_batches(model, prompt_tokens, params, eod_id=tokenizer.eod,
                                  max_sequence_length=max_sequence_length,
                                  max_batch_size=args.inference_max_requests, vocab_size=tokenizer.vocab_size,
                                  seed=args.seed, on_tokens=TextStream(tokenizer) if args.stream else None)
    elapsed = time.perf_counter() - started
    records = [result_record(prompt, result, tokenizer, args.chat_prompt_format)
               for prompt, result in zip(prompts, results)]
    print_records(records)
    generated = sum(len(result.generated_tokens) for result in results)
    prompts_phrase = f"{len(results)} prompt" + ("" if len(results) == 1 else "s")
    num_batches = -(-len(results) // args.inference_max_requests)
    if num_batches > 1:
        prompts_phrase += f" ({num_batches} batches of at most {args.inference_max_requests})"
    _print_rank0(f"generated {generated} tokens for {prompts_phrase} in {elapsed:.2f} s "
                 f"({generated / elapsed:.1f} tokens/s)")
    write_records(records, args.output_path)
    return records


def print_records(records):
    """Each prompt and its generated text, on rank 0."""
    for index, record in enumerate(records):
        _print_rank0(f"prompt {index}: {record['prompt']!r}\ngenerated {index}: {record['generated_text']!r}"
                     + (" [end of document]" if record["stopped_at_eod"] else ""))


def write_records(records, output_path):
    """--output-path: one JSON line per prompt, written by rank 0."""
    if output_path is not None and dist.get_rank() == 0:
        with open(output_path, "w") as output:
            for record in records:
                output.write(json.dumps(record) + "\n")
        print(f"wrote {len(records)} results to {output_path}", flush=True)


with_placeholder_data_flag = launch.with_placeholder_data_flag


def training_placeholders(argv):
    """pretrain_gpt.py's required training flags that `argv` leaves unset (see `megatron.inference.launch`)."""
    return launch.training_placeholders(argv, add_static_inference_args)


def main(argv=None):
    return run_with_megatron(add_static_inference_args, run, argv)


if __name__ == "__main__":
    main()
