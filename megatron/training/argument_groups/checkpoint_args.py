"""`--use-checkpoint-args`: the model arguments of the `--load` checkpoint override the command line.

This group validates first: the values it takes from the checkpoint are what every other group then checks
and derives from (the default FFN size, the data-parallel size, ...). Upstream's --load-main-params-from-ckpt
stops here: what a load does with the fp32 main weights is decided by whether the optimizer state is loaded.
"""

import os

from megatron.training import checkpoint_sources
from megatron.training.checkpoint_args import apply_checkpoint_args


def add_arguments(parser):
    group = parser.add_argument_group("checkpoint arguments")
    group.add_argument(
        "--use-checkpoint-args",
        action="store_true",
        help="Take the model's arguments (layers, sizes, heads, position embeddings, normalization, vocabulary "
        "and tokenizer, MoE and MLA shapes) from the --load checkpoint instead of the command line.",
    )
    group.add_argument(
        "--use-mp-args-from-checkpoint-args",
        action="store_true",
        help="With --use-checkpoint-args: also take the tensor-, pipeline- and expert-parallel layout (and the "
        "pipeline split) from the checkpoint.",
    )
    group.add_argument(
        "--no-use-tokenizer-model-from-checkpoint-args",
        action="store_false",
        dest="use_tokenizer_model_from_checkpoint_args",
        help="With --use-checkpoint-args: do not take --tokenizer-model from the checkpoint (a path recorded on "
        "another machine); the command line's value, or none, is used.",
    )
    group.add_argument(
        "--load-main-params-from-ckpt",
        action="store_true",
        help="Upstream: with --no-load-optim, still take the fp32 main weights from the checkpoint. Not supported "
        "here (a load with the optimizer state takes them from the checkpoint already): an error.",
    )


def validate(args):
    if args.load_main_params_from_ckpt:
        raise ValueError(
            "--load-main-params-from-ckpt is not supported. Here a --load that restores the optimizer state (the "
            "default) already takes the fp32 main weights from the checkpoint (its optimizer.state.<name>.fp32_param "
            "entries, saved when the model's weights are bf16/fp16); with --no-load-optim or --finetune the main "
            "weights are rebuilt from the loaded model weights. Drop the flag, and drop --no-load-optim if you need "
            "the saved fp32 main weights")
    if args.use_mp_args_from_checkpoint_args and not args.use_checkpoint_args:
        raise ValueError("--use-mp-args-from-checkpoint-args needs --use-checkpoint-args")
    if not args.use_checkpoint_args:
        return
    if args.load is None:
        raise ValueError("--use-checkpoint-args needs --load DIR (the checkpoint whose arguments to use)")
    source = checkpoint_sources.checkpoint_to_load(args)
    if source is None:
        message = f"--use-checkpoint-args: --load {args.load} holds no checkpoint"
        if args.exit_on_missing_checkpoint:
            raise FileNotFoundError(f"{message} and --exit-on-missing-checkpoint is set")
        _print_rank0(f"WARNING: {message}; the model is built from the command line")
        return
    saved = checkpoint_sources.saved_args(source)
    if saved is None:
        raise ValueError(f"--use-checkpoint-args: {source.directory} records no arguments (converted from bare "
                         "weights?); give the model's flags on the command line instead")
    changed = apply_checkpoint_args(args, saved, args.use_mp_args_from_checkpoint_args,
                                    with_tokenizer_model=args.use_tokenizer_model_from_checkpoint_args)
    _print_rank0(f"--use-checkpoint-args: model arguments from {source.directory}"
                 + (": " + ", ".join(changed) if changed else " (the command line agreed)"))


def _print_rank0(message):
    if int(os.environ.get("RANK", "0")) == 0:
        print(message, flush=True)
