"""Starting a generation program from pretrain_gpt.py's flags: placeholder training flags, the tokenizer and the
model of the latest checkpoint under --load (shared by the generation examples and the text-generation server).

Generation trains nothing and reads no data: pretrain_gpt.py's required training flags get placeholder values when
absent, so a launch needs only the model, tokenizer and inference flags. Given ones are validated as for training
and otherwise unused: no dataset, optimizer or scheduler is built.
"""

import os
import sys

DATA_FLAGS = ("--data-path", "--train-data-path", "--mock-data", "--data-args-path", "--per-split-data-args-path")


def with_placeholder_data_flag(argv, add_arguments=None):
    """`argv` plus --mock-data when it names no dataset (the data flags' validation asks for one), neither as a flag
    nor in its --yaml-cfg file. `add_arguments` adds the program's own flags (keys of the file too)."""
    from megatron.training import yaml_arguments

    words = argv
    if yaml_arguments.yaml_cfg_path(argv) is not None:
        from megatron.training.arguments import build_parser

        words = yaml_arguments.with_yaml_arguments(build_parser(add_arguments), list(argv))
    if any(arg.split("=")[0] in DATA_FLAGS for arg in words):
        return argv
    return [*argv, "--mock-data"]


def declare_generation_program(parser):
    """Mark what `parser` parses as a generation program's flags (`args.generation_program`): the flags'
    validation then skips the rules that hold for training only (MoE layers at --tensor-model-parallel-size > 1
    without --sequence-parallel, which generation runs with every tensor-parallel rank routing all the tokens).
    Each generation program's flag function calls it."""
    parser.set_defaults(generation_program=True)
    return parser


def training_placeholders(argv, add_arguments=None):
    """Values for pretrain_gpt.py's required training flags that `argv` leaves unset. The run length fits the
    schedule flags `argv` gives: none when it sets --train-samples, and longer than any --lr-warmup-iters.
    `add_arguments` adds the program's own flags to the parser (so their values are not read as training flags)."""
    from megatron.training import yaml_arguments
    from megatron.training.arguments import build_parser

    parser = build_parser(add_arguments)
    # A --yaml-cfg file's keys count as given, like the flags.
    given, _ = parser.parse_known_args(yaml_arguments.with_yaml_arguments(parser, list(argv)))
    placeholders = {"micro_batch_size": 1, "lr": 0.0}
    if given.global_batch_size is None and (given.pipeline_model_parallel_size or 1) > 1:
        # An interleaved pipeline's validation wants at least --pipeline-model-parallel-size microbatches a
        # global batch (a multiple of it): p microbatches on every data-parallel rank the world could hold.
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
        placeholders["global_batch_size"] = (given.micro_batch_size or 1) * given.pipeline_model_parallel_size \
            * world_size
    if given.train_iters is None and given.train_samples is None:
        placeholders["train_iters"] = max(1, int(given.lr_warmup_iters or 0) + 1)
    if given.seq_length is None:
        # The training sequence length sizes nothing in generation (its limit is --max-position-embeddings). A
        # checkpoint imported from Hugging Face records none: --use-checkpoint-args then keeps this placeholder.
        max_positions = given.max_position_embeddings or _checkpoint_max_positions(given)
        if max_positions is not None:
            placeholders["seq_length"] = max_positions
    return placeholders


def _checkpoint_max_positions(given):
    """--max-position-embeddings of the --load checkpoint under --use-checkpoint-args (None without the flag, or
    when the checkpoint records none; a missing checkpoint is reported by the flags' validation)."""
    from megatron.training import checkpoint_sources

    if not given.use_checkpoint_args or given.load is None:
        return None
    try:
        source = checkpoint_sources.checkpoint_to_load(given)
        saved = checkpoint_sources.saved_args(source) if source is not None else None
    except (FileNotFoundError, ValueError):
        return None
    return getattr(saved, "max_position_embeddings", None)


def run_with_megatron(add_arguments, run_function, argv=None):
    """Initialize Megatron from the command line (`argv`, default sys.argv) with the training-only placeholders,
    call `run_function(args)` and tear down."""
    from megatron.training.initialize import initialize_megatron
    from megatron.training.training import _teardown

    argv = with_placeholder_data_flag(sys.argv[1:] if argv is None else list(argv), add_arguments)
    args = initialize_megatron(extra_args_provider=add_arguments,
                               args_defaults=training_placeholders(argv, add_arguments), args=argv)
    try:
        return run_function(args)
    finally:
        _teardown(args)


def check_generation_args(args, print_rank0=print):
    """Refuse what cannot generate, before a model is built (errors name the flag); turn off the flags that only
    matter to training (and say so through `print_rank0`)."""
    from megatron.core.inference.model_checks import check_inference_supported
    from megatron.training.model_config import core_transformer_config_from_args

    if args.load is None:
        raise ValueError("--load: give the checkpoint directory to generate from")
    if args.init_model_with_meta_device:
        # The model is built unwrapped; the meta device is for Megatron-FSDP to materialise shard by shard.
        print_rank0("--init-model-with-meta-device is turned off for generation (the model is built whole)")
        args.init_model_with_meta_device = False
    if args.sequence_parallel:
        # Sequence parallelism changes no weight; a one-position decoding step cannot be split over TP ranks.
        print_rank0("--sequence-parallel is turned off for generation (the weights are the same)")
        args.sequence_parallel = False
    check_inference_supported(core_transformer_config_from_args(args))


def generation_max_sequence_length(args):
    """(the longest prompt plus generated tokens, the flag that sets it): --inference-max-seq-length, capped by
    --max-position-embeddings as upstream's generation caps it whatever the position embedding (learned absolute
    positions have no row past the table; a rotary model was trained on no position past it)."""
    if args.inference_max_seq_length < 1:
        raise ValueError(f"--inference-max-seq-length must be at least 1, got {args.inference_max_seq_length}")
    max_positions = args.max_position_embeddings
    if max_positions is not None and max_positions < args.inference_max_seq_length:
        return max_positions, "--max-position-embeddings"
    return args.inference_max_seq_length, "--inference-max-seq-length"


def build_tokenizer(args):
    """The tokenizer of --tokenizer-type (set as the global one), and `args.padded_vocab_size` from it: the one
    `initialize_megatron()` (`run_with_megatron`) built from `args`, else built here."""
    from megatron.training.tokenizer.tokenizer import padded_vocab_size
    from megatron.training.global_state import set_tokenizer
    from megatron.training.initialize import tokenizer_set_up_for
    from megatron.training.tokenizer import build_tokenizer_from_args

    tokenizer = tokenizer_set_up_for(args)
    if tokenizer is not None:
        return tokenizer
    tokenizer = build_tokenizer_from_args(args)
    set_tokenizer(tokenizer)
    # The checkpoint's rows under --use-checkpoint-args.
    args.padded_vocab_size = padded_vocab_size(args, tokenizer.vocab_size)
    return tokenizer


def load_model(args, model_provider):
    """The model `model_provider` builds on this rank (pretrain_gpt.py's), unwrapped, with the weights of the
    latest checkpoint under --load. With a virtual pipeline, this rank's model chunks as one
    `VirtualPipelineModel`."""
    from megatron.inference.virtual_pipeline import VirtualPipelineModel
    from megatron.training import checkpointing
    from megatron.training.model_setup import get_model

    if args.load is None:
        raise ValueError("--load: give the checkpoint directory to generate from")
    checkpointing.check_checkpoint_format(args)
    chunks = get_model(model_provider, args, wrap_with_ddp=False)
    if checkpointing.read_tracker(args.load) is None:
        raise FileNotFoundError(f"--load {args.load}: no checkpoint there (no tracker file)")
    checkpointing.load_checkpoint(chunks, None, None, args)
    return chunks[0] if len(chunks) == 1 else VirtualPipelineModel(chunks)
