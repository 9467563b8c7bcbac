"""Post-training quantization of a trained GPT checkpoint with nvidia-modelopt.

    torchrun --nproc-per-node N examples/post_training/quantize.py <the model's pretrain_gpt.py flags> \
        --micro-batch-size 4 --lr 0 --train-iters 1 --load CKPT --ckpt-format torch --data-path ... --quant-cfg fp8 \
        --calib-batches 8 --eval-iters 4 --export-dir QUANTIZED

Loads the latest checkpoint under `--load` (weights only), measures the validation loss, inserts modelopt's
quantizers (`--quant-cfg`: fp8, fp8_per_channel_per_token, int8, int8_weight_only; all run on CPUs), calibrates
them on `--calib-batches` global batches (or `--calib-size` samples) of training data from the data pipeline,
measures the validation loss again on the same batches, and saves the quantized model under `--export-dir` (else
`--save`) in the checkpoint layout (`iter_XXXXXXX/mp_rank_TT[_PPP]/model_optim_rng.pt`) with modelopt's own state
(`modelopt_state`), which `load_quantized_model` replays on a freshly built model before loading the weights and
quantizer states. With `--ckpt-format torch_dist` the export is a training checkpoint holding modelopt's state
(`megatron.training.modelopt_checkpoint`): `pretrain_gpt.py --load QUANTIZED --finetune` continues with
quantization-aware training, at any tensor- or data-parallel size.
"""

import os
import sys

import torch
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
from megatron.core.extensions import modelopt as modelopt_support  # noqa: E402
from megatron.training import checkpointing  # noqa: E402

MODELOPT_STATE_KEY = "modelopt_state"
DEFAULT_CALIB_BATCHES = 4


def add_quantize_arguments(parser):
    group = parser.add_argument_group("post-training quantization")
    group.add_argument("--quant-cfg", "--export-quant-cfg", dest="quant_cfg", default="fp8",
                       choices=sorted(modelopt_support.QUANT_CONFIGS),
                       help="modelopt quantization configuration (--export-quant-cfg: upstream's name).")
    group.add_argument("--calib-batches", type=int, default=None,
                       help=f"Global batches of training data to calibrate on (default {DEFAULT_CALIB_BATCHES}).")
    group.add_argument("--calib-size", type=int, default=None,
                       help="Training samples to calibrate on, rounded up to whole global batches (instead of "
                            "--calib-batches).")
    group.add_argument("--export-dir", default=None,
                       help="Where to save the quantized model (default: --save, where upstream saves it).")
    return parser


def calibration_batches(args):
    """Global batches to calibrate on: --calib-batches, or --calib-size samples rounded up to whole batches."""
    if args.calib_batches is not None and args.calib_size is not None:
        raise ValueError("give --calib-batches (global batches) or --calib-size (samples), not both")
    if args.calib_size is not None:
        if args.calib_size < 1:
            raise ValueError(f"--calib-size must be >= 1, got {args.calib_size}")
        return -(-args.calib_size // args.global_batch_size)
    if args.calib_batches is not None and args.calib_batches < 1:
        raise ValueError(f"--calib-batches must be >= 1, got {args.calib_batches}")
    return DEFAULT_CALIB_BATCHES if args.calib_batches is None else args.calib_batches


def export_root(args):
    """Where the quantized model goes: --export-dir, else --save (None: not saved)."""
    return args.export_dir if args.export_dir is not None else args.save


def _setup(args):
    if args.load is None:
        raise ValueError("quantize.py needs --load: the checkpoint of the model to quantize")
    calibration_batches(args)  # checks --calib-batches / --calib-size
    if args.eval_iters < 1:
        raise ValueError("quantize.py needs --eval-iters >= 1 to report the validation loss before and after")
    setup_tokenizer_and_batches(args)


def quantize_model(model, args):
    """Insert and calibrate `--quant-cfg` quantizers on the calibration batches of training data."""
    train_iterator, _ = data_iterators(args)

    def forward_loop(quantized):
        run_global_batches(quantized, train_iterator, calibration_batches(args), args)

    return modelopt_support.quantize(model, args.quant_cfg, forward_loop)


def _export_path(root, iteration):
    ranks = checkpointing._parallel_ranks()
    directory = checkpointing.checkpoint_dir(
        root, iteration, ranks["tensor_rank"], ranks["pipeline_rank"], ranks["pipeline_size"]
    )
    return os.path.join(directory, checkpointing.MODEL_FILENAME)


def save_quantized_model(model, root, iteration, args, losses):
    """Save the quantized model under `root`: with --ckpt-format torch_dist (or its aliases) as a training
    checkpoint without optimizer state, which pretrain_gpt.py loads for quantization-aware training
    (`--load root --finetune`); with --ckpt-format torch as one file per model-parallel rank."""
    if checkpointing.is_logical_format(args):
        saved_root = args.save
        args.save = root
        try:
            checkpointing.save_checkpoint(iteration, [model], None, None, args)
        finally:
            args.save = saved_root
        return root
    path = _export_path(root, iteration)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    state = {
        "model": model.state_dict(),
        MODELOPT_STATE_KEY: modelopt_support.modelopt_state(model),
        "iteration": iteration,
        "quant_cfg": args.quant_cfg,
        "validation_loss": losses,
    }
    if parallel_state.get_data_parallel_rank() == 0:
        checkpointing.atomic_torch_save(state, path)
    dist.barrier()
    if dist.get_rank() == 0:
        checkpointing.write_tracker(root, iteration)
    dist.barrier()
    return path


def load_quantized_model(model, root, args=None):
    """Replay the saved modelopt conversions on the freshly built `model`, then load weights and quantizer
    states from the latest quantized checkpoint under `root`; returns the saved record (torch format) or the
    iteration (torch_dist, whose loader restores modelopt's state itself; `args` is then required)."""
    if args is not None and checkpointing.is_logical_format(args):
        saved_load, saved_finetune = args.load, args.finetune
        args.load, args.finetune = root, True
        try:
            return checkpointing.load_checkpoint([model], None, None, args)
        finally:
            args.load, args.finetune = saved_load, saved_finetune
    iteration = checkpointing.read_tracker(root)
    if iteration is None:
        raise FileNotFoundError(f"no quantized checkpoint under {root} (no tracker file)")
    state = torch.load(_export_path(root, iteration), map_location="cpu", weights_only=False)
    if MODELOPT_STATE_KEY not in state:
        raise ValueError(f"{root} holds no {MODELOPT_STATE_KEY}: not written by quantize.py")
    modelopt_support.restore(model, state[MODELOPT_STATE_KEY])
    model.load_state_dict(state["model"])
    return state


def run(args):
    """Load, evaluate, quantize, evaluate, save; returns the losses, the quantized model and the export path."""
    _setup(args)
    modelopt_support.require_modelopt()
    model = build_model(args)
    iteration = checkpointing.load_checkpoint([model], None, None, args)
    if iteration == 0 and checkpointing.read_tracker(args.load) is None:
        raise FileNotFoundError(f"no checkpoint under --load {args.load}")
    converted = modelopt_modes(model)
    if converted:
        raise ValueError(
            f"--load {args.load} holds a model modelopt already converted ({', '.join(converted)}): quantize.py "
            "quantizes an unquantized checkpoint. Load the checkpoint it was quantized from, or train the quantized "
            f"model on (quantization-aware training) with pretrain_gpt.py --load {args.load} --finetune")
    before = validation_loss(model, args)
    quantize_model(model, args)
    after = validation_loss(model, args)
    result = {"before": before, "after": after, "iteration": iteration, "model": model}
    if dist.get_rank() == dist.get_world_size() - 1:
        print(f"validation loss ({global_batches_phrase(args.eval_iters)}): before {before:.6f} | after "
              f"{args.quant_cfg} PTQ {after:.6f} | change {after - before:+.6f}", flush=True)
    if export_root(args) is not None:
        result["export"] = save_quantized_model(model, export_root(args), iteration, args,
                                                {"before": before, "after": after})
    return result


def main(argv=None):
    return run_with_megatron(add_quantize_arguments, run, argv)


if __name__ == "__main__":
    main()
