"""Megatron-LM's checkpoint converter command line (`--loader` and `--saver` plugins) on this repository's
converters.

    python tools/checkpoint/convert.py --model-type GPT --loader llama_mistral --checkpoint-type hf \\
        --model-size llama3 --load-dir HF_DIR --tokenizer-model HF_DIR --bf16 --saver core --save-dir OUT \\
        --target-tensor-parallel-size 2 --target-pipeline-parallel-size 1
    python tools/checkpoint/convert.py --model-type GPT --loader core --saver core --load-dir IN --save-dir OUT \\
        --target-tensor-parallel-size 2 --target-pipeline-parallel-size 2
    python tools/checkpoint/convert.py --model-type GPT --loader core --saver hf --load-dir IN --save-dir HF_DIR

Loaders: core (also named mcore, legacy, megatron) reads a checkpoint training wrote, torch_dist as it is and
--ckpt-format torch (mp_rank_* directories) joined as convert_legacy.py joins it; llama_mistral with
--checkpoint-type hf reads a Hugging Face Llama, Mistral, Qwen2 or Qwen3 directory as
`convert_checkpoint.py --from hf` does (config.json gives the shape; a --model-size naming another gets a note).
Either loader's --vocab-file (a GPT-2 vocab.json) gives the tokenizer's vocabulary size as --true-vocab-size does;
the core loader's --position-embedding-type is checked against the checkpoint's, which the conversion keeps.
Savers: core (also mcore) writes a torch_dist checkpoint. It loads at any tensor-, pipeline-, expert- and
data-parallel size, so the --target-* sizes are checked against the model and printed with the flags to train at
them, not written into the files; hf writes a Hugging Face directory as `convert_checkpoint.py --to hf` does.
A --ckpt-format torch checkpoint at the target layout (what upstream's savers write) is not written here: it is one
run of pretrain_gpt.py with --ckpt-convert-format torch at that layout, which the core saver prints.
"""

import argparse
import json
import os
import sys
import tempfile

import _paths  # noqa: F401  (repository on sys.path)
import convert_checkpoint

# --loader / --saver name -> what reads or writes it here.
LOADERS = {"core": "ours", "mcore": "ours", "legacy": "ours", "megatron": "ours", "llama_mistral": "hf"}
SAVERS = {"core": "torch_dist", "mcore": "torch_dist", "hf": "hf"}
# Upstream plugins that have no counterpart here, and what to do instead.
NOT_HERE = {
    ("--loader", "mixtral_hf"): "import the Mixtral directory with tools/checkpoint/convert_checkpoint.py --from hf "
                                "--input HF_DIR --output OUT, which prints the flags to train from it",
    ("--loader", "llava"): "multimodal LLaVA models are not built here",
    ("--saver", "llava"): "multimodal LLaVA models are not built here",
    ("--saver", "hf_llava"): "multimodal LLaVA models are not built here",
    ("--saver", "legacy"): "upstream's legacy saver writes --ckpt-format torch at one layout; use --saver core (a "
                           "torch_dist checkpoint, which loads at any layout): it prints the pretrain_gpt.py "
                           "--ckpt-convert-format torch run that writes the torch format at the target layout",
}
NOT_HERE[("--saver", "megatron")] = "upstream's default saver; " + NOT_HERE[("--saver", "legacy")]
# Upstream's llama_mistral --model-size choices, and the Hugging Face architecture each names.
MODEL_SIZES = ("llama2-7B", "llama2-13B", "llama2-70B", "llama2-7Bf", "llama2-13Bf", "llama2-70Bf", "llama3",
               "llama3-8B", "llama3-70B", "llama3-8Bf", "llama3-70Bf", "mistral", "mistral-7B", "mistral-7Bf",
               "yi-34B", "qwen2.5", "qwen2.5-7B", "qwen2.5-72B", "qwen2.5-7Bf", "qwen2.5-72Bf")
TRANSFORMER_IMPLS = ("local", "transformer_engine")
POSITION_EMBEDDING_TYPES = ("learned_absolute", "rope", "mrope", "relative", "none")
# The training flags pretrain_gpt.py asks for, given to its --ckpt-convert-format torch launch: it trains no
# iteration (and keeps the checkpoint's learning-rate schedule), so these values are used for nothing.
PLACEHOLDER_TRAINING_FLAGS = "--micro-batch-size 1 --train-iters 1 --lr 0 --mock-data"


def model_size_architecture(model_size):
    from hf_families import LLAMA, MISTRAL, QWEN2

    return MISTRAL if model_size.startswith("mistral") else QWEN2 if model_size.startswith("qwen") else LLAMA


def _plugin(parser, flag, name, known, asks_help=False):
    """The plugin `flag` names (None: not given, upstream's default `megatron`, which is not one here)."""
    shown = f"{flag} {name}" if name is not None else f"{flag} not given (upstream's default: megatron)"
    name = "megatron" if name is None else name
    if name in known:
        return known[name]
    if asks_help:  # --help without a plugin of ours (upstream's default, megatron): the common flags
        return None
    reason = NOT_HERE.get((flag, name))
    parser.error(f"{shown}: " + (f"{reason}; " if reason else "not a plugin here; ")
                 + f"choose one of {', '.join(known)}")


def _loader_arguments(parser, name, kind):
    group = parser.add_argument_group(f"--loader {name}")
    group.add_argument("--true-vocab-size", type=int, default=None,
                       help="The tokenizer's vocabulary size (the embedding's rows beyond it are padding): recorded "
                       "by an import, the rows the hf saver keeps.")
    group.add_argument("--vocab-file", default=None,
                       help="A GPT-2 vocab.json: its number of entries is the tokenizer's vocabulary size, as "
                       "--true-vocab-size gives it.")
    group.add_argument("--megatron-path", default=None, help="Accepted and ignored: this repository converts.")
    group.add_argument("--loader-transformer-impl", default=None, choices=TRANSFORMER_IMPLS,
                       help="Accepted: both implementations use the same checkpoint names here.")
    if kind != "hf":
        group.add_argument("--position-embedding-type", default=None, choices=POSITION_EMBEDDING_TYPES,
                           help="Checked against the one the checkpoint records (which the conversion keeps).")
        return
    group.add_argument("--checkpoint-type", required=True, choices=["meta", "hf"],
                       help="hf: a Hugging Face model directory (meta's consolidated.*.pth files are refused).")
    group.add_argument("--model-size", default=None, choices=MODEL_SIZES,
                       help="Compared with config.json's architecture, which gives the shape.")
    group.add_argument("--tokenizer-model", default=None,
                       help="Hugging Face tokenizer directory (default: --load-dir): its vocabulary size is recorded.")
    group.add_argument("--bf16", action="store_true", help="Printed among the flags to train with.")
    group.add_argument("--fp16", action="store_true", help="Printed among the flags to train with.")
    group.add_argument("--make-vocab-size-divisible-by", type=int, default=128,
                       help="Pad the embedding to a multiple of this, as training does at TP 1 (a directory "
                       "convert_checkpoint.py --to hf wrote keeps its recorded padding).")


def _saver_arguments(parser, name, kind):
    group = parser.add_argument_group(f"--saver {name}")
    group.add_argument("--megatron-path", default=None, help="Accepted and ignored: this repository converts.")
    if kind != "torch_dist":
        return
    for name in ("tensor", "pipeline", "expert"):
        group.add_argument(f"--target-{name}-parallel-size", type=int, default=None,
                           help=f"The {name}-parallel size to train at, checked against the model and printed "
                           "(default: the input checkpoint's, else 1); the checkpoint loads at any.")
    group.add_argument("--saver-transformer-impl", default=None, choices=TRANSFORMER_IMPLS,
                       help="Accepted: both implementations use the same checkpoint names here.")


def parse_args(argv=None):
    """Upstream's two-step parse: --loader and --saver pick the flag groups, then every flag is parsed."""
    first = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    first.add_argument("--loader", default=None)
    first.add_argument("--saver", default=None)
    plugins, _ = first.parse_known_args(argv)
    asks_help = any(arg in ("-h", "--help") for arg in (sys.argv[1:] if argv is None else argv))
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     allow_abbrev=False, conflict_handler="resolve")
    loader = _plugin(parser, "--loader", plugins.loader, LOADERS, asks_help)
    saver = _plugin(parser, "--saver", plugins.saver, SAVERS, asks_help)
    plugins.loader, plugins.saver = plugins.loader or "megatron", plugins.saver or "megatron"
    parser.add_argument("--model-type", required=True, help="GPT (upstream's BERT is not built here).")
    parser.add_argument("--loader", default="megatron", help=f"One of {', '.join(LOADERS)}.")
    parser.add_argument("--saver", default="megatron", help=f"One of {', '.join(SAVERS)}.")
    parser.add_argument("--load-dir", required=True, help="Checkpoint root (or iteration directory), or HF directory.")
    parser.add_argument("--save-dir", required=True, help="Root of the checkpoint, or the HF directory, to write.")
    parser.add_argument("--max-queue-size", type=int, default=50, help="Accepted: no tensors pass through a queue.")
    parser.add_argument("--no-checking", dest="checking", action="store_false",
                        help="Accepted: no loader-to-saver messages to check here.")
    _loader_arguments(parser, plugins.loader, loader)
    _saver_arguments(parser, plugins.saver, saver)
    options = parser.parse_args(argv)
    options.loader_kind, options.saver_kind = loader, saver
    if options.model_type != "GPT":
        parser.error(f"--model-type {options.model_type}: only GPT models convert here; choose GPT")
    if loader == "hf":
        if options.checkpoint_type == "meta":
            parser.error("--checkpoint-type meta: Meta's consolidated.*.pth files are not read here; convert them "
                         "to a Hugging Face directory (transformers' convert_llama_weights_to_hf) and pass "
                         "--checkpoint-type hf")
        if options.bf16 and options.fp16:
            parser.error("--bf16 and --fp16: pass one")
    if options.vocab_file is not None:
        _vocabulary_size_from_file(parser, options)
    for flag in ("tensor", "pipeline", "expert"):
        size = getattr(options, f"target_{flag}_parallel_size", None)
        if size is not None and size < 1:
            parser.error(f"--target-{flag}-parallel-size {size}: must be at least 1")
    if os.path.abspath(options.load_dir) == os.path.abspath(options.save_dir):
        parser.error(f"--save-dir {options.save_dir}: the same as --load-dir; write the conversion elsewhere")
    return options


def _vocabulary_size_from_file(parser, options):
    """--vocab-file gives the tokenizer's vocabulary size (its JSON object's entries), as upstream's loaders read
    it; it must agree with --true-vocab-size when both are given."""
    try:
        with open(options.vocab_file, encoding="utf-8") as stream:
            vocabulary = json.load(stream)
    except (OSError, ValueError) as error:
        parser.error(f"--vocab-file {options.vocab_file}: cannot read it as a JSON vocabulary ({error}); give the "
                     "vocab.json the model was trained with, or --true-vocab-size N")
    if not isinstance(vocabulary, dict) or not vocabulary:
        parser.error(f"--vocab-file {options.vocab_file}: not a JSON object of tokens to ids (a GPT-2 vocab.json); "
                     "give --true-vocab-size N instead")
    if options.true_vocab_size is not None and options.true_vocab_size != len(vocabulary):
        parser.error(f"--true-vocab-size {options.true_vocab_size} and --vocab-file {options.vocab_file} "
                     f"({len(vocabulary)} tokens) disagree; pass one")
    options.true_vocab_size = len(vocabulary)


def check_position_embedding_type(options):
    """--position-embedding-type (upstream's core loader flag) must be the checkpoint's: the conversion keeps the
    model as it was trained."""
    given = getattr(options, "position_embedding_type", None)
    if given is None:
        return
    recorded = getattr(_input_common(options).get("args"), "position_embedding_type", None)
    if recorded is not None and recorded != given:
        raise SystemExit(f"--position-embedding-type {given}: the checkpoint at {options.load_dir} was trained "
                         f"with --position-embedding-type {recorded}, which the conversion keeps; drop the flag or "
                         f"pass {recorded}; nothing was written to {options.save_dir}")


def accepted_flag_notes(options):
    """A line for each flag that is accepted for upstream's command line and changes nothing here."""
    notes = []
    if options.megatron_path is not None:
        notes.append(f"--megatron-path {options.megatron_path}: ignored; the code of this repository converts")
    for flag in ("loader_transformer_impl", "saver_transformer_impl"):
        if getattr(options, flag, None) is not None:
            notes.append(f"--{flag.replace('_', '-')}: ignored; local and transformer_engine layers use the same "
                         "checkpoint names here (training picks with --transformer-impl)")
    if options.true_vocab_size is not None and options.loader_kind == "ours" and options.saver_kind == "torch_dist":
        flag = "--vocab-file" if options.vocab_file is not None else "--true-vocab-size"
        notes.append(f"{flag}: ignored; the torch_dist checkpoint keeps the padded embedding training "
                     "wrote (the hf saver drops the rows beyond it)")
    return notes


def _load_ours(options, staging):
    """(The root of a torch_dist checkpoint with --load-dir's state: --load-dir itself, or, for a --ckpt-format
    torch checkpoint, `staging`, where convert_legacy.py joins it; lines to print)."""
    import convert_legacy

    directory = _paths.resolve_iteration_dir(options.load_dir, "--load-dir")
    if _paths.is_legacy_directory(directory):
        model, iteration, _ = convert_legacy.convert(options.load_dir, staging)
        return staging, [f"joined the --ckpt-format torch checkpoint of iteration {iteration} ({len(model)} model "
                         "tensors) as convert_legacy.py does"]
    if os.path.isfile(os.path.join(directory, "config.json")) and not os.path.isfile(
            os.path.join(directory, ".metadata")):
        raise SystemExit(f"--load-dir {options.load_dir}: a Hugging Face model directory; read it with --loader "
                         "llama_mistral --checkpoint-type hf")
    _paths.logical_checkpoint_dir(options.load_dir, "--load-dir")  # exits saying what the directory is instead
    return options.load_dir, []


def _load_hf(options, staging):
    """(`staging`, where the Hugging Face directory --load-dir is imported; lines to print: how to train from it)."""
    import hf_mapping

    if not os.path.isdir(options.load_dir):
        raise SystemExit(f"--load-dir {options.load_dir}: not a directory (--checkpoint-type hf reads a Hugging "
                         "Face model directory)")
    config_path = os.path.join(options.load_dir, hf_mapping.CONFIG_FILE)
    if not os.path.isfile(config_path):
        raise SystemExit(f"--load-dir {options.load_dir}: no {hf_mapping.CONFIG_FILE}, so not a Hugging Face model "
                         "directory (a checkpoint training wrote reads with --loader core)")
    with open(config_path) as stream:
        config = json.load(stream)
    architecture = (config.get("architectures") or [None])[0]
    if options.model_size is not None and architecture != model_size_architecture(options.model_size):
        print(f"note: --model-size {options.model_size} names a {model_size_architecture(options.model_size)}; "
              f"{config_path} is a {architecture}, converted as it says")
    rows = config.get("vocab_size")
    if options.true_vocab_size is not None and rows is not None and options.true_vocab_size > rows:
        given = (f"--vocab-file {options.vocab_file} ({options.true_vocab_size} tokens)"
                 if options.vocab_file is not None else f"--true-vocab-size {options.true_vocab_size}")
        raise SystemExit(f"{given}: more than the {rows} embedding rows of "
                         f"{config_path} (vocab_size); pass the tokenizer's vocabulary size")
    tokenizer = options.tokenizer_model or options.load_dir
    tokenizer = tokenizer if os.path.isdir(tokenizer) else os.path.dirname(os.path.abspath(tokenizer))
    tokens = options.true_vocab_size or convert_checkpoint.hf_tokenizer_vocab_size(tokenizer)
    _, shape, tokens, divisor = convert_checkpoint.import_hf(options.load_dir, staging, None,
                                                             options.make_vocab_size_divisible_by, False, tokens)
    lines = [f"imported {options.load_dir} ({shape.num_layers} layers) as convert_checkpoint.py --from hf does"]
    if options.saver_kind == "torch_dist":
        sizes = sorted({1, options.target_tensor_parallel_size or 1})
        lines.append(convert_checkpoint.hf_import_training_hint(tokenizer, options.save_dir, shape, tokens, sizes,
                                                                divisor))
        precision = "--bf16" if options.bf16 else "--fp16" if options.fp16 else None
        if precision:
            lines.append(f"{precision}: the checkpoint holds fp32 weights (as --from hf writes them); train with "
                         f"{precision}, which keeps them as the main weights")
    return staging, lines


def _read_common(root):
    from megatron.core.dist_checkpointing import offline

    return offline.read_checkpoint(_paths.logical_checkpoint_dir(root, "--load-dir"), keys={"common"}).get(
        "common") or {}


def target_sizes(options, common):
    """{flag: size} of the target layout: the --target-* sizes, else those the input was trained at, else 1."""
    layout = common.get("layout") or {}
    return {
        "--tensor-model-parallel-size": options.target_tensor_parallel_size
        or layout.get("tensor_model_parallel_size") or 1,
        "--pipeline-model-parallel-size": options.target_pipeline_parallel_size
        or layout.get("pipeline_model_parallel_size") or 1,
        "--expert-model-parallel-size": options.target_expert_parallel_size
        or layout.get("expert_model_parallel_size") or 1,
    }


def target_size_problems(args, tensor, pipeline, expert):
    """Why the model of `args` (the checkpoint's recorded arguments) cannot train at these sizes; [] if it can."""
    if args is None:
        return []
    problems = []
    heads = getattr(args, "num_attention_heads", None)
    groups = getattr(args, "num_query_groups", None) if getattr(args, "group_query_attention", False) else heads
    if heads and heads % tensor:
        problems.append(f"--target-tensor-parallel-size {tensor}: the model's {heads} attention heads "
                        "(--num-attention-heads) do not split evenly over it")
    elif groups and groups % tensor:
        problems.append(f"--target-tensor-parallel-size {tensor}: the model's {groups} key/value heads "
                        "(--num-query-groups) do not split evenly over it")
    layers = getattr(args, "num_layers", None)
    uneven_split = any(getattr(args, name, None) is not None for name in (
        "decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers", "pipeline_model_parallel_layout"))
    if layers and pipeline > layers:
        problems.append(f"--target-pipeline-parallel-size {pipeline}: more stages than the model's {layers} layers")
    elif layers and layers % pipeline and not uneven_split:
        problems.append(f"--target-pipeline-parallel-size {pipeline}: the model's {layers} layers (--num-layers) do "
                        "not split evenly over it, which training needs without --decoder-first-pipeline-num-layers "
                        "/ --decoder-last-pipeline-num-layers or --pipeline-model-parallel-layout (the checkpoint "
                        "written is the same at any target size: give one that divides the layers, and those flags "
                        "to the training run)")
    experts = getattr(args, "num_experts", None)
    if expert > 1 and not experts:
        problems.append(f"--target-expert-parallel-size {expert}: the model has no experts (--num-experts)")
    elif experts and experts % expert:
        problems.append(f"--target-expert-parallel-size {expert}: the model's {experts} experts (--num-experts) do "
                        "not split evenly over it")
    return problems


def _hf_input_common(options):
    """The `common` an import of the Hugging Face directory --load-dir records, as far as the target sizes need it
    (the model's arguments), read from its config.json before anything is written."""
    import hf_mapping

    from megatron.core.dist_checkpointing import safetensors_format
    from megatron.training.tokenizer import pad_vocab_size

    with open(os.path.join(options.load_dir, hf_mapping.CONFIG_FILE)) as stream:
        config = json.load(stream)
    extras_path = os.path.join(options.load_dir, hf_mapping.EXTRAS_FILE)
    metadata = safetensors_format.load_file(extras_path)[1] if os.path.isfile(extras_path) else {}
    recorded = json.loads(metadata["megatron_model"]) if "megatron_model" in metadata else None
    try:
        padded = pad_vocab_size(config.get("vocab_size", 1), options.make_vocab_size_divisible_by)
        shape, _ = hf_mapping.shape_from_hf_config(config, options.load_dir, recorded, padded, False)
    except hf_mapping.ConversionError as exc:
        raise SystemExit(str(exc)) from exc
    return {"args": shape.to_args()}


def _input_common(options):
    """The input's `common` (its arguments and layout) for checking the target sizes, read without writing
    anything: a torch_dist checkpoint's own, a --ckpt-format torch checkpoint's first rank file's, a Hugging Face
    directory's config.json."""
    import convert_legacy

    from megatron.training.checkpointing import _torch_load

    if options.loader_kind == "hf":
        if not os.path.isfile(os.path.join(options.load_dir, "config.json")):
            return {}  # the loader names what the directory lacks
        return _hf_input_common(options)
    directory = _paths.resolve_iteration_dir(options.load_dir, "--load-dir")
    if _paths.is_legacy_directory(directory):
        files = convert_legacy._rank_files(directory)
        layout = {"tensor_model_parallel_size": 1 + max(tp for tp, _ in files),
                  "pipeline_model_parallel_size": 1 + max(pp for _, pp in files)}
        return {"args": _torch_load(files[(0, 0)]).get("args"), "layout": layout}
    if not os.path.isfile(os.path.join(directory, ".metadata")):
        return {}  # the loader names what the directory is instead
    return _read_common(options.load_dir)


def check_target_sizes(options):
    """Refuse target sizes the input's model cannot take, before anything is written."""
    common = _input_common(options)
    problems = target_size_problems(common.get("args"), *target_sizes(options, common).values())
    if problems:
        raise SystemExit("; ".join(problems) + f"; nothing was written to {options.save_dir}")


def save_torch_dist(options, source):
    """Write --save-dir from the torch_dist checkpoint at root `source` (a copy unless it is --save-dir already),
    whose target sizes `check_target_sizes` checked; returns the lines to print."""
    from megatron.core.dist_checkpointing import offline

    common = _read_common(source)
    sizes = target_sizes(options, common)
    iteration = _paths.output_iteration(source, common.get("iteration", 0))
    if source != options.save_dir:
        state = offline.read_checkpoint(_paths.logical_checkpoint_dir(source, "--load-dir"))
        offline.write_checkpoint(options.save_dir, iteration, state, common.get("layout") or {})
    directory = _paths.logical_checkpoint_dir(options.save_dir, "--save-dir")
    model_only = not any(key.startswith("optimizer.") for key, *_ in offline.describe(directory))
    layout = " ".join(f"{flag} {size}" for flag, size in sizes.items()
                      if size > 1 or flag != "--expert-model-parallel-size")
    load = f"--load {options.save_dir}" + (" --finetune" if model_only else "")
    written = "released: its tracker says release" if iteration == "release" else f"iteration {iteration}"
    lines = [f"wrote {options.save_dir}: a torch_dist checkpoint ({written}), which "
             "reshards on load at any tensor-, pipeline-, expert- and data-parallel size",
             f"train at the target layout with: pretrain_gpt.py {load} {layout} (and the model flags, or "
             "--use-checkpoint-args)"]
    if sizes["--expert-model-parallel-size"] > 1:
        return lines + ["a --ckpt-format torch checkpoint (what upstream's savers write) is not written at "
                        "--expert-model-parallel-size above 1 (training refuses the torch format there): train from "
                        "this torch_dist checkpoint"]
    ranks = sizes["--tensor-model-parallel-size"] * sizes["--pipeline-model-parallel-size"]
    unrecorded = _unrecorded_model_flags(common)
    return lines + [
        "a --ckpt-format torch checkpoint at that layout (what upstream's savers write), which this tool does not "
        f"write itself: torchrun --nproc-per-node {ranks} pretrain_gpt.py --load {options.save_dir} "
        f"--use-checkpoint-args {layout} --ckpt-convert-format torch --ckpt-convert-save TORCH_DIR "
        "--use-checkpoint-opt_param-scheduler " + " ".join([PLACEHOLDER_TRAINING_FLAGS, *unrecorded])
        + " (the launch trains no iteration: --use-checkpoint-opt_param-scheduler keeps the learning-rate schedule "
        f"the checkpoint holds, and {PLACEHOLDER_TRAINING_FLAGS} only fill in what every training launch asks for"
        + ("".join(f"; {flag}: {what}" for flag, what in unrecorded.items()) if unrecorded else "")
        + "), which writes TORCH_DIR/torch; train from it with --ckpt-format torch --load TORCH_DIR/torch "
        f"--use-checkpoint-args {layout}"]


def _unrecorded_model_flags(common):
    """{placeholder: what to give} for the model arguments pretrain_gpt.py needs that the checkpoint's arguments
    lack (an import from Hugging Face records neither a sequence length nor a tokenizer). The launch records what it
    is given, and --use-checkpoint-args takes it from TORCH_DIR/torch later: so the training's own values."""
    saved = common.get("args")
    unrecorded = {}
    if getattr(saved, "seq_length", None) is None:
        limit = getattr(saved, "max_position_embeddings", None)
        unrecorded["--seq-length SEQ_LENGTH"] = ("the training's sequence length"
                                                 + (f", at most {limit}" if limit else ""))
    if getattr(saved, "tokenizer_type", None) is None:
        tokens = common.get("vocab_size")
        unrecorded["TOKENIZER_FLAGS"] = (
            "the training's tokenizer, as the checkpoint records none: its --tokenizer-type and files"
            + (f" ({tokens} tokens), or --tokenizer-type NullTokenizer --vocab-size {tokens - 1} with --mock-data"
               if tokens else ""))
    return unrecorded


def main(argv=None):
    options = parse_args(argv)
    for note in accepted_flag_notes(options):
        print(f"note: {note}")
    check_position_embedding_type(options)
    load = _load_hf if options.loader_kind == "hf" else _load_ours
    if options.saver_kind == "torch_dist":
        check_target_sizes(options)
        source, lines = load(options, options.save_dir)
        lines += save_torch_dist(options, source)
    else:
        parent = os.path.dirname(os.path.abspath(options.save_dir))
        os.makedirs(parent, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix=".convert_", dir=parent) as scratch:
            source, lines = load(options, os.path.join(scratch, "checkpoint"))
            convert_checkpoint.to_hf(source, options.save_dir, options.true_vocab_size,
                                     vocab_size_flag="--true-vocab-size N or --vocab-file VOCAB_JSON")
        lines.append(f"wrote {options.save_dir}: a Hugging Face model directory, as convert_checkpoint.py --to hf "
                     "writes it")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
