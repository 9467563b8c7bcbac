"""Minitron width pruning of a trained GPT checkpoint (hidden size, FFN size, attention heads), on any device.

    torchrun --nproc-per-node N examples/post_training/prune.py <the model's pretrain_gpt.py flags> --load CKPT \
        --ckpt-format torch_dist --data-path ... --calib-size 64 --eval-iters 8 \
        --target-hidden-size 48 --target-ffn-hidden-size 96 [--target-num-attention-heads 1] --save PRUNED

Loads the latest checkpoint under `--load` (weights only), measures the validation loss, scores every FFN neuron,
attention head and hidden channel by its mean absolute activation over `--calib-size` training samples (summed
over the data-parallel ranks; see `megatron.core.post_training.prune`), keeps the most important ones for the
`--target-*` sizes (modelopt's flag names), builds the smaller model with their weights, measures the validation
loss again on the same batches and saves the pruned model under `--save` as a checkpoint without optimizer state.
The head width (`--kv-channels`) stays. Continue with `pretrain_gpt.py --load PRUNED --finetune` and the pruned
sizes (printed at the end), or distil it from the original model (`distill.py`). Runs at tensor- and
pipeline-parallel size 1, any data-parallel size.

`--use-modelopt-plugin` runs nvidia-modelopt's own Minitron plugin (`mcore_minitron` mode) instead. Its Megatron
NAS plugin imports transformer_engine unconditionally, so it needs Transformer Engine and therefore CUDA; beyond TE it
builds on upstream Megatron-Core modules this code base does not have (hybrid/Mamba models
`megatron.core.models.hybrid`, `megatron.core.ssm.gated_delta_net`, the MoE layer specs
`megatron.core.models.gpt.moe_module_specs`, module specs `megatron.core.transformer.spec_utils`);
`check_pruning_available()` says which of these stands in the way.
"""

import importlib
import os
import sys

import torch.distributed as dist

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

from examples.post_training.model_and_data import (  # noqa: E402
    build_model,
    data_iterators,
    global_batches_phrase,
    modelopt_modes,
    run_global_batches,
    run_with_megatron,
    setup_tokenizer_and_batches,
    validation_loss,
)
from megatron.core import parallel_state  # noqa: E402
from megatron.core.post_training import prune as width_pruning  # noqa: E402
from megatron.training import checkpointing  # noqa: E402

MINITRON_PLUGIN = "modelopt.torch.prune.plugins.mcore_minitron"


def add_prune_arguments(parser):
    group = parser.add_argument_group("Minitron width pruning")
    group.add_argument("--calib-size", type=int, default=64,
                       help="Training samples to score the channels on (rounded up to whole global batches).")
    group.add_argument("--target-hidden-size", type=int, default=None, help="Prune the hidden size to this value.")
    group.add_argument("--target-ffn-hidden-size", type=int, default=None,
                       help="Prune the MLP's FFN hidden size to this value.")
    group.add_argument("--target-num-attention-heads", type=int, default=None,
                       help="Prune the attention heads to this number (with grouped-query attention a multiple of "
                            "--num-query-groups: every group keeps the same number of heads).")
    group.add_argument("--use-modelopt-plugin", action="store_true",
                       help="Prune with nvidia-modelopt's mcore_minitron plugin (needs Transformer Engine) instead.")
    return parser


def check_pruning_available():
    """Raise RuntimeError naming what modelopt's Minitron pruning plugin needs and this environment lacks."""
    from megatron.core.optional_deps import HAVE_TE, have_modelopt

    if not have_modelopt():
        raise RuntimeError("--use-modelopt-plugin needs nvidia-modelopt: pip install -e '.[modelopt]' (or drop the "
                           "flag: prune.py prunes without modelopt)")
    if not HAVE_TE:
        raise RuntimeError(
            "Minitron pruning with modelopt's mcore_minitron plugin (--use-modelopt-plugin) needs transformer-engine, "
            "which modelopt's Megatron NAS plugin imports unconditionally, and so a CUDA machine with TE installed "
            "(pip install '.[te]'); it does not run on CPUs. Drop --use-modelopt-plugin: prune.py's own Minitron "
            "width pruning runs everywhere."
        )
    try:
        importlib.import_module(MINITRON_PLUGIN)
    except ImportError as exc:
        raise RuntimeError(
            f"modelopt's Minitron pruning plugin does not import against this megatron.core ({exc}): it builds on "
            "upstream Megatron-Core modules (hybrid and Mamba models, gated delta net, MoE and layer specs) that "
            "this code base does not provide. Drop --use-modelopt-plugin: prune.py's own width pruning needs none"
        ) from exc


def target_of(args):
    return width_pruning.WidthPruningTarget(hidden_size=args.target_hidden_size,
                                            ffn_hidden_size=args.target_ffn_hidden_size,
                                            num_attention_heads=args.target_num_attention_heads)


def _check_arguments(args):
    if args.load is None:
        raise ValueError("prune.py needs --load: the checkpoint of the model to prune")
    if args.tensor_model_parallel_size != 1 or args.pipeline_model_parallel_size != 1:
        raise ValueError(
            f"prune.py runs at --tensor-model-parallel-size 1 and --pipeline-model-parallel-size 1 (got "
            f"{args.tensor_model_parallel_size} and {args.pipeline_model_parallel_size}); a torch_dist checkpoint "
            "saved at another layout loads at TP1/PP1, and the pruned one loads at any layout again"
        )
    if target_of(args) == width_pruning.WidthPruningTarget():
        raise ValueError("prune.py needs at least one of --target-hidden-size, --target-ffn-hidden-size, "
                         "--target-num-attention-heads")
    if args.calib_size < 1:
        raise ValueError(f"--calib-size must be >= 1, got {args.calib_size}")


def calibration_batches(args):
    """Global batches that hold --calib-size samples."""
    return -(-args.calib_size // args.global_batch_size)


def _gpt_model(model):
    """The GPTModel inside data-parallel and Float16Module wrappers."""
    from megatron.core.distributed.data_parallel_base import unwrap_model
    from megatron.core.models.gpt.gpt_model import GPTModel

    model = unwrap_model(model)
    while not isinstance(model, GPTModel) and hasattr(model, "module"):
        model = model.module
    return model


def _validation_loss(model, args):
    return validation_loss(model, args) if args.eval_iters > 0 else None


def collect_importance(model, args):
    """Channel scores from --calib-size training samples, summed over the data-parallel ranks."""
    train_iterator, _ = data_iterators(args)

    def forward_loop(_):
        run_global_batches(model, train_iterator, calibration_batches(args), args)

    return width_pruning.collect_width_importance(
        _gpt_model(model), forward_loop, group=parallel_state.get_data_parallel_group(with_context_parallel=True))


def set_pruned_sizes(args, config):
    """Make the run's arguments describe the pruned model (they are saved with its checkpoint)."""
    args.hidden_size, args.ffn_hidden_size = config.hidden_size, config.ffn_hidden_size
    args.num_attention_heads, args.num_query_groups = config.num_attention_heads, config.num_query_groups
    args.kv_channels = config.kv_channels


def pruned_model_flags(args):
    flags = (f"--hidden-size {args.hidden_size} --ffn-hidden-size {args.ffn_hidden_size} "
             f"--num-attention-heads {args.num_attention_heads} --kv-channels {args.kv_channels}")
    if getattr(args, "group_query_attention", False):
        flags += f" --group-query-attention --num-query-groups {args.num_query_groups}"
    return flags


def prune_model(model, args):
    """The pruned model (built like pretrain_gpt's, wrapped alike) and the kept channels; `args` then describe it."""
    importance = collect_importance(model, args)
    original = _gpt_model(model)
    kept = width_pruning.select_kept_channels(importance, original.config, target_of(args))
    set_pruned_sizes(args, width_pruning.pruned_config(original.config, kept))
    pruned = build_model(args)
    width_pruning.copy_kept_weights(original, _gpt_model(pruned), kept)
    return pruned, kept


def modelopt_minitron_prune(model, target, forward_loop):
    """Prune the GPTModel `model` in place to `target` with modelopt's mcore_minitron mode, scoring on
    `forward_loop(model)`; needs Transformer Engine (see the module docstring)."""
    check_pruning_available()
    import modelopt.torch.prune as mtp

    export_config = {name: value for name, value in vars(target).items() if value is not None}
    mtp.prune(model, mode="mcore_minitron", constraints={"export_config": export_config}, dummy_input=None,
              config={"forward_loop": forward_loop})
    return model


def prune_with_modelopt_plugin(model, args):
    """modelopt's mcore_minitron mode on `model`, scored on --calib-size training samples."""
    train_iterator, _ = data_iterators(args)

    def forward_loop(pruned):
        run_global_batches(pruned, train_iterator, calibration_batches(args), args)

    modelopt_minitron_prune(_gpt_model(model), target_of(args), forward_loop)
    set_pruned_sizes(args, _gpt_model(model).config)
    return model


def save_pruned_model(model, iteration, args):
    """A checkpoint without optimizer state under --save (its arguments describe the pruned model)."""
    checkpointing.save_checkpoint(iteration, [model], None, None, args)


def run(args):
    """Load, evaluate, prune, evaluate, save; returns the losses, the pruned model and the kept channels."""
    _check_arguments(args)
    if args.use_modelopt_plugin:
        check_pruning_available()  # before loading anything
    setup_tokenizer_and_batches(args)
    model = build_model(args)
    iteration = checkpointing.load_checkpoint([model], None, None, args)
    if iteration == 0 and checkpointing.read_tracker(args.load) is None:
        raise FileNotFoundError(f"no checkpoint under --load {args.load}")
    converted = modelopt_modes(model)
    if converted:
        raise ValueError(
            f"--load {args.load} holds a model modelopt converted ({', '.join(converted)}): prune.py prunes an "
            "unconverted model (the pruned model would be built without its quantizers). Prune the checkpoint it "
            "was quantized from, then quantize the pruned one (quantize.py --load PRUNED)")
    before = _validation_loss(model, args)
    if args.use_modelopt_plugin:
        pruned, kept = prune_with_modelopt_plugin(model, args), None
    else:
        pruned, kept = prune_model(model, args)
    after = _validation_loss(pruned, args)
    if args.save is not None:
        save_pruned_model(pruned, iteration, args)
    if dist.get_rank() == dist.get_world_size() - 1:
        if before is not None:
            print(f"validation loss ({global_batches_phrase(args.eval_iters)}): before {before:.6f} | after pruning "
                  f"{after:.6f} | change {after - before:+.6f}", flush=True)
        print(f"pruned model: {pruned_model_flags(args)}" + (f", saved under {args.save}" if args.save else ""),
              flush=True)
    return {"before": before, "after": after, "iteration": iteration, "model": pruned, "kept": kept}


def main(argv=None):
    return run_with_megatron(add_prune_arguments, run, argv)


if __name__ == "__main__":
    main()
