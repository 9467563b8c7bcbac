"""Generate text from a trained GPT checkpoint with continuous batching (upstream's dynamic inference example).

    torchrun --nproc-per-node 1 examples/inference/gpt/gpt_dynamic_inference.py \
        --load CKPT_DIR --use-checkpoint-args --tokenizer-type ByteLevelTokenizer --distributed-backend gloo \
        --prompts "def " "Return the" --num-tokens-to-generate 30 --inference-dynamic-batching-buffer-size-gb 1

The prompts go to a `DynamicInferenceEngine` as requests, at most `--inference-dynamic-batching-max-requests-override`
(default `--inference-max-requests`) at a time; each one runs from its admission to its end without waiting for the
others (docs/inference.md, continuous batching). Takes gpt_static_inference.py's flags (model, checkpoint, prompts,
sampling, `--output-path`) and upstream's `--inference-dynamic-batching-*` flags: the memory per rank
(`-buffer-size-gb`), its chunk (`-chunk-size`) and the requests and tokens of a step (`-max-requests-override`,
`-max-tokens-override`); `-buffer-guaranteed-fraction` and `-buffer-overflow-factor` are accepted and unused.
`--return-log-probs` and `--top-n-logprobs` work as there (not with pipeline parallelism); `--stream` needs
gpt_static_inference.py. Greedy requests generate the same text as gpt_static_inference.py.
"""

import os
import sys
import time

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

from examples.inference.gpt import gpt_static_inference as static  # noqa: E402
from megatron.core.inference.contexts import DynamicInferenceContext  # noqa: E402
from megatron.core.inference.engines import DynamicInferenceEngine  # noqa: E402
from megatron.core.inference.model_inference_wrappers.gpt.gpt_inference_wrapper import GPTInferenceWrapper  # noqa
from megatron.core.inference.model_inference_wrappers.inference_wrapper_config import InferenceWrapperConfig  # noqa
from megatron.core.inference.text_generation_controllers.text_generation_controller import (  # noqa: E402
    TextGenerationController,
)
from megatron.core.transformer.heterogeneous.linear_replacements import LinearReplacedAttention  # noqa: E402
from megatron.inference import launch  # noqa: E402
from megatron.inference.launch import build_tokenizer, run_with_megatron  # noqa: E402


def add_dynamic_inference_args(parser):
    """gpt_static_inference.py's flags and upstream's `--inference-dynamic-batching-*` (names and defaults)."""
    static.add_static_inference_args(parser)
    group = parser.add_argument_group("dynamic inference")
    group.add_argument("--inference-dynamic-batching-buffer-size-gb", type=float, default=40.0,
                       help="Key/value memory per rank, in GB (at most what the requests can fill is allocated).")
    group.add_argument("--inference-dynamic-batching-chunk-size", type=int, default=256,
                       help="Positions per chunk of the key/value memory.")
    group.add_argument("--inference-dynamic-batching-buffer-guaranteed-fraction", type=float, default=0.2,
                       help="Accepted and unused: requests reserve their whole length when admitted.")
    group.add_argument("--inference-dynamic-batching-buffer-overflow-factor", type=float, default=None,
                       help="Accepted and unused: requests reserve their whole length when admitted.")
    group.add_argument("--inference-dynamic-batching-max-requests-override", type=int, default=None,
                       help="Requests decoded together (default: --inference-max-requests).")
    group.add_argument("--inference-dynamic-batching-max-tokens-override", type=int, default=None,
                       help="Tokens of a step (default: --inference-max-seq-length, so that any prompt fits).")
    return parser


def check_args(args):
    """gpt_static_inference.py's checks, and what continuous batching does not do (errors name the flag)."""
    if args.stream:
        raise ValueError("--stream is not supported with continuous batching: use gpt_static_inference.py")
    static.check_args(args)


def _caching_attentions(model):
    """The attention modules of this pipeline stage that cache keys and values: not a hybrid model's Mamba and MLP
    layers, nor a heterogeneous model's dropped attentions and their linear stand-ins."""
    layers = getattr(getattr(model, "decoder", None), "layers", None) or []
    attentions = (getattr(layer, "self_attention", None) for layer in layers)
    return [attention for attention in attentions
            if attention is not None and not isinstance(attention, LinearReplacedAttention)]


def cached_layers(model):
    """Layers of this pipeline stage that cache keys and values, at least one: the context sizes its chunks by
    them."""
    if getattr(getattr(model, "decoder", None), "layers", None) is None:
        return model.config.num_layers
    return max(1, len(_caching_attentions(model)))


def cached_key_value_heads(model):
    """Key/value heads of each caching layer: the most any of them has (a heterogeneous model's layers have their
    own), so the chunks the context counts hold any layer's keys and values."""
    groups = [attention.config.num_query_groups for attention in _caching_attentions(model)
              if hasattr(attention, "config")]
    return max(groups, default=model.config.num_query_groups)


def mamba_state_bytes(model):
    """Bytes of one request's decoding states in this stage's Mamba layers (a hybrid model's; 0 for others)."""
    layers = getattr(getattr(model, "decoder", None), "layers", None) or []
    mixers = (getattr(layer, "mixer", None) for layer in layers)
    return sum(mixer.decoding_state_bytes(model.config.params_dtype) for mixer in mixers
               if hasattr(mixer, "decoding_state_bytes"))


def build_engine(args, model, tokenizer, max_sequence_length):
    config = model.config
    max_requests = args.inference_dynamic_batching_max_requests_override or args.inference_max_requests
    context = DynamicInferenceContext(
        params_dtype=config.params_dtype, num_layers=cached_layers(model), kv_channels=config.kv_channels,
        num_attention_heads=cached_key_value_heads(model), max_sequence_length=max_sequence_length,
        buffer_size_gb=args.inference_dynamic_batching_buffer_size_gb,
        chunk_size_tokens=args.inference_dynamic_batching_chunk_size, max_requests_override=max_requests,
        max_tokens_override=args.inference_dynamic_batching_max_tokens_override,
        tensor_model_parallel_size=config.tensor_model_parallel_size,
        mamba_state_bytes_per_request=mamba_state_bytes(model))
    wrapper_config = InferenceWrapperConfig(hidden_size=config.hidden_size, params_dtype=config.params_dtype,
                                            inference_batch_times_seqlen_threshold=-1,
                                            padded_vocab_size=args.padded_vocab_size,
                                            inference_max_requests=max_requests,
                                            inference_max_seq_length=max_sequence_length)
    controller = TextGenerationController(GPTInferenceWrapper(model, wrapper_config, context), tokenizer)
    return DynamicInferenceEngine(controller, context, termination_id=tokenizer.eod, random_seed=args.seed)


def run(args):
    """Load, generate, print (and write --output-path); returns the records (one per prompt, in order)."""
    check_args(args)
    tokenizer = build_tokenizer(args)
    prompts, prompt_tokens, max_sequence_length = static.tokenize_prompts(args, tokenizer)
    params = static.sampling_params_from_args(args)
    model = static.load_model(args).eval()
    engine = build_engine(args, model, tokenizer, max_sequence_length)
    started, steps = time.perf_counter(), 0
    results = [engine.add_request(request_id, tokens, sampling_params=params)
               for request_id, tokens in enumerate(prompt_tokens)]
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    elapsed = time.perf_counter() - started
    records = [static.result_record(prompt, result, tokenizer, args.chat_prompt_format)
               for prompt, result in zip(prompts, results)]
    static.print_records(records)
    generated = sum(len(result.generated_tokens) for result in results)
    static._print_rank0(f"generated {generated} tokens for {len(results)} prompts in {steps} steps, {elapsed:.2f} s "
                        f"({generated / elapsed:.1f} tokens/s)")
    static.write_records(records, args.output_path)
    return records


def training_placeholders(argv):
    """pretrain_gpt.py's required training flags that `argv` leaves unset (see `megatron.inference.launch`)."""
    return launch.training_placeholders(argv, add_dynamic_inference_args)


def main(argv=None):
    return run_with_megatron(add_dynamic_inference_args, run, argv)


if __name__ == "__main__":
    main()
