"""Serve text generation from a trained GPT checkpoint over HTTP, as upstream Megatron-LM's server does.

    torchrun --standalone --nproc-per-node 1 tools/run_text_generation_server.py \
        --load CKPT_DIR --use-checkpoint-args --tokenizer-type ByteLevelTokenizer --distributed-backend gloo

Takes pretrain_gpt.py's model and tokenizer flags (`--use-checkpoint-args` reads the model's from the checkpoint)
and `--load`; `--tensor-model-parallel-size 2` or `--pipeline-model-parallel-size 2` on 2 ranks splits the model
(both on 4 ranks). Rank 0 answers `PUT /api` and OpenAI's text completions (`POST /v1/completions`) on `--port`
(default 5000) on every interface; the other ranks follow its requests. Query it with curl or
`python tools/text_generation_cli.py localhost:5000`. For a model fine-tuned with `--sft`, `--chat-prompt-format
FORMAT` (its `--sft-tokenizer-prompt-format`) also answers OpenAI's `POST /v1/chat/completions`: the messages
rendered in that format, the reply up to its end-of-turn marker. Upstream's
server-wide sampling flags (`--temperature`, `--top_k`, `--top_p`, `--num-tokens-to-generate`, `--out-seq-length`,
`--return-log-probs`) are accepted and, as upstream's, set nothing: each request gives its own fields (a note
names each). See docs/inference.md.
"""

import os
import sys

import torch.distributed as dist

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

import pretrain_gpt  # noqa: E402
from megatron.inference import launch  # noqa: E402
from megatron.inference.text_generation import GenerationLimits  # noqa: E402
from megatron.inference.text_generation_server import TextGenerationServer, follow_requests  # noqa: E402
from megatron.training.tokenizer.chat_prompt_formats import (  # noqa: E402
    PROMPT_FORMATS,
    chat_prompt_format_for_flag,
)


# Upstream's server-wide sampling flags -> (the PUT /api field that sets it per request, the field's default).
# Upstream's server accepts them and its requests do not read them; here they are accepted and say so.
REQUEST_FIELD_FLAGS = {
    "--temperature": ("temperature", "1.0"),
    "--top_k": ("top_k", "0"),
    "--top_p": ("top_p", "0.0"),
    "--num-tokens-to-generate": ("tokens_to_generate", "64"),
    "--out-seq-length": ("tokens_to_generate", "64"),
    "--return-log-probs": ("logprobs", "false"),
}


def add_text_generation_server_args(parser):
    group = parser.add_argument_group("text generation server")
    group.add_argument("--port", type=int, default=5000, help="Port of the HTTP endpoint (rank 0).")
    group.add_argument("--inference-max-seq-length", type=int, default=2560,
                       help="Key/value cache length: a prompt plus its generated tokens must fit (and fit "
                            "--max-position-embeddings).")
    group.add_argument("--inference-max-requests", type=int, default=8,
                       help="Key/value cache batch size: a request with more prompts runs in several batches.")
    group.add_argument("--chat-prompt-format", default=None,
                       help="For a model fine-tuned with --sft: also answer POST /v1/chat/completions, rendering "
                            f"each conversation in this chat format ({', '.join(sorted(PROMPT_FORMATS))}), the "
                            "model's --sft-tokenizer-prompt-format.")
    group = parser.add_argument_group("upstream's server sampling flags (each request sets its own)")
    for flag, (field, default) in REQUEST_FIELD_FLAGS.items():
        help_text = f'Accepted for upstream launch scripts; a request\'s "{field}" (default {default}) sets it.'
        if flag == "--return-log-probs":
            group.add_argument(flag, action="store_true", help=help_text)
        else:
            group.add_argument(flag, type=float if flag in ("--temperature", "--top_p") else int, default=None,
                               help=help_text)
    return launch.declare_generation_program(parser)


def request_field_flag_notes(args):
    """A line for each of upstream's server-wide sampling flags given: what sets it instead."""
    notes = []
    for flag, (field, default) in REQUEST_FIELD_FLAGS.items():
        value = getattr(args, flag.lstrip("-").replace("-", "_"))
        if value is not None and value is not False:
            shown = flag if value is True else f"{flag} {value}"
            notes.append(f'note: {shown} sets no default of this server (nor of upstream\'s): each PUT /api request '
                         f'gives its own "{field}" (default {default})')
    return notes


def _print_rank0(message):
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(message, flush=True)


def generation_limits(args, tokenizer) -> GenerationLimits:
    for flag, value in (("--inference-max-seq-length", args.inference_max_seq_length),
                        ("--inference-max-requests", args.inference_max_requests)):
        if value < 1:
            raise ValueError(f"{flag} must be at least 1, got {value}")
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in [0, 65535], got {args.port}")
    max_sequence_length, _ = launch.generation_max_sequence_length(args)
    return GenerationLimits(eod_id=tokenizer.eod, vocab_size=tokenizer.vocab_size,
                            max_sequence_length=max_sequence_length, max_batch_size=args.inference_max_requests)


def chat_format_of(args):
    """The --chat-prompt-format's ChatPromptFormat (None without the flag: no chat endpoint)."""
    return None if args.chat_prompt_format is None else chat_prompt_format_for_flag(args.chat_prompt_format)


def run(args):
    launch.check_generation_args(args, _print_rank0)
    for note in request_field_flag_notes(args):
        _print_rank0(note)
    chat_format = chat_format_of(args)
    tokenizer = launch.build_tokenizer(args)
    limits = generation_limits(args, tokenizer)
    model = launch.load_model(args, pretrain_gpt.model_provider)
    try:
        if dist.get_rank() == 0:
            server = TextGenerationServer(model, tokenizer, limits, chat_format=chat_format, model_name=args.load)
            server.serve("0.0.0.0", args.port)
        else:
            follow_requests(model, limits)
    except KeyboardInterrupt:  # Ctrl-C reaches every rank of the job
        _print_rank0("text generation server stopped")


def main(argv=None):
    return launch.run_with_megatron(add_text_generation_server_args, run, argv)


if __name__ == "__main__":
    main()
