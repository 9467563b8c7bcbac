"""Convert a logical (torch_dist) checkpoint to one full-precision torch.save file, a safetensors file or a
Hugging Face model directory, and back.

    python tools/checkpoint/convert_checkpoint.py --to torch       --input CKPT_ROOT --output model.pt
    python tools/checkpoint/convert_checkpoint.py --to safetensors --input CKPT_ROOT --output model.safetensors
    python tools/checkpoint/convert_checkpoint.py --to hf          --input CKPT_ROOT --output HF_DIR
    python tools/checkpoint/convert_checkpoint.py --from torch       --input model.pt --output NEW_ROOT
    python tools/checkpoint/convert_checkpoint.py --from safetensors --input model.safetensors --output NEW_ROOT
    python tools/checkpoint/convert_checkpoint.py --from hf          --input HF_DIR --output NEW_ROOT

torch: `{"model": {logical name: fp32 tensor}, "checkpoint": {every other key: value}}` (optimizer moments and
main weights, step, scheduler, each rank's RNG states, iteration, args); converting back gives a checkpoint that
resumes exactly (dropout masks included).
safetensors: the fp32 model weights under their logical names, the iteration in the file's metadata; converting
back gives a model-only checkpoint (training loads it with a fresh optimizer).
hf: config.json and model.safetensors of a GPT2LMHeadModel (learned positions), LlamaForCausalLM (RoPE) or
Qwen3ForCausalLM (RoPE with --qk-layernorm), with --num-experts of a MixtralForCausalLM, Qwen3MoeForCausalLM
(--qk-layernorm) or Qwen2MoeForCausalLM (gated shared experts), with --multi-latent-attention of a
DeepseekV3ForCausalLM (hf_deepseek.py), with --hybrid-override-pattern of a NemotronHForCausalLM or, Mamba layers
only, a Mamba2ForCausalLM (hf_hybrid.py), with --heterogeneous-layers-config-path of a Llama-Nemotron
DeciLMForCausalLM (hf_nemotron_nas.py), or of the MistralForCausalLM or Qwen2ForCausalLM a
checkpoint was imported from (--hf-architecture names one), in the dtype the checkpoint trained in (--hf-dtype), that
`transformers.AutoModelForCausalLM.from_pretrained(HF_DIR)` loads and that computes our model's logits, plus
megatron_extras.safetensors (vocabulary padding rows and what else HF has no place for); converting back gives
the same model tensors bit for bit. Models HF cannot compute exactly are refused, naming the flag (see
hf_mapping.py); so are models with routers HF does not have (but DeepSeek-V3's), which convert between our own
formats only (see hf_unsupported.py). `--from hf` reads these architectures (Mistral and Mixtral without a
sliding window) and prints the pretrain_gpt.py flags that train from the checkpoint it wrote.
The logical names are those of the unsplit GPTModel, and a checkpoint written back loads at any TP/PP/DP.
"""

import argparse
import json
import os

import _paths  # noqa: F401  (repository on sys.path)
import torch

# In an imported checkpoint's `common`: what the Hugging Face model was beyond our flags (its architecture, the
# dtype of its weights, its tokenizer's special token ids), so that `--to hf` writes the same model back.
HF_SOURCE_KEY = "hf_source"


def _make_parent_directory(path):
    """Create the directory a file `--output` goes in, as the directory outputs are created."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)


def to_torch(directory, output):
    from megatron.core.dist_checkpointing import offline

    state = offline.read_checkpoint(_paths.logical_checkpoint_dir(directory))
    model = offline.full_precision_model(state)
    rest = {key: value for key, value in state.items() if not key.startswith("model.")}
    _make_parent_directory(output)
    torch.save({"model": model, "checkpoint": rest}, output)
    return model


def to_safetensors(directory, output):
    from megatron.core.dist_checkpointing import offline, safetensors_format

    state = offline.read_checkpoint(_paths.logical_checkpoint_dir(directory))
    model = offline.full_precision_model(state)
    iteration = (state.get("common") or {}).get("iteration", 0)
    _make_parent_directory(output)
    safetensors_format.save_file(model, output, {"format": "megatron_logical", "iteration": iteration})
    return model


def true_vocab_size(common, vocab_size=None, vocab_size_flag="--vocab-size N"):
    """The vocabulary size HF's embedding gets: `vocab_size` if given, else the rows of the HF model an import
    came from, else the tokenizer's as the checkpoint recorded it, else from its arguments (a NullTokenizer's
    --vocab-size + 1, or the tokenizer rebuilt). `vocab_size_flag`: the calling tool's flag that gives the size."""
    if vocab_size is not None:
        return vocab_size
    imported_rows = (common.get(HF_SOURCE_KEY) or {}).get("vocab_size")
    if imported_rows is not None:  # HF's embedding rows, which its tokenizer may not fill
        return int(imported_rows)
    if common.get("vocab_size") is not None:
        return int(common["vocab_size"])
    args = common.get("args")
    tokenizer_type = getattr(args, "tokenizer_type", None)
    if tokenizer_type == "NullTokenizer" and getattr(args, "vocab_size", None) is not None:
        return args.vocab_size + 1  # the text ids and the end-of-document id after them
    if tokenizer_type is None and getattr(args, "vocab_size", None) is not None:
        return args.vocab_size
    from megatron.training.tokenizer import build_tokenizer_from_args

    try:
        return build_tokenizer_from_args(args).vocab_size
    except Exception as exc:  # a tokenizer file that is not here any more, say
        raise SystemExit(f"cannot rebuild the checkpoint's {tokenizer_type} tokenizer to learn the vocabulary size "
                         f"({exc}); pass {vocab_size_flag}") from exc


def export_dtype(common, requested=None):
    """The HF dtype name of the weights `--to hf` writes: `requested` (--hf-dtype), else the one the checkpoint
    trained in (--bf16: bfloat16, --fp16: float16), else the one an import recorded, else float32."""
    from hf_config import training_dtype

    recorded = (common.get(HF_SOURCE_KEY) or {}).get("dtype")
    return requested or training_dtype(common.get("args")) or recorded or "float32"


def trained_token_ids(args):
    """config.json's special token ids for a checkpoint that training wrote: the beginning-of-sequence and
    end-of-document ids of the tokenizer its arguments name (where it can be rebuilt, else none), as generation
    stops at the end-of-document id."""
    from megatron.training.tokenizer import build_tokenizer_from_args

    if getattr(args, "tokenizer_type", None) is None:
        return {}
    try:
        tokenizer = build_tokenizer_from_args(args)
        return {"bos_token_id": getattr(tokenizer, "bos", None), "eos_token_id": tokenizer.eod}
    except Exception:  # a tokenizer file that is not here any more, or one without these ids: they stay unset
        return {}


def to_hf(directory, output, vocab_size=None, architecture=None, dtype=None, vocab_size_flag="--vocab-size N"):
    """Write `output`/config.json, model.safetensors and megatron_extras.safetensors; returns the HF tensors.
    `architecture` (--hf-architecture) and `dtype` (--hf-dtype) default to what the checkpoint says: the
    architecture an import recorded, else the one our flags pick; the dtype of `export_dtype`. `vocab_size_flag`
    is named when the vocabulary size is needed and cannot be found."""
    import hf_deepseek
    import hf_hybrid
    import hf_hybrid_tensors
    import hf_mapping
    import hf_nemotron_nas
    import hf_unsupported
    from megatron.core.dist_checkpointing import offline, safetensors_format

    state = offline.read_checkpoint(_paths.logical_checkpoint_dir(directory))
    model = offline.full_precision_model(state)
    common = state.get("common") or {}
    args = common.get("args")
    if args is None:
        raise SystemExit(f"{directory}: the checkpoint records no training arguments (it was converted from a "
                         "file without them), so its model flags are unknown; convert the checkpoint training wrote")
    refusal = hf_unsupported.hf_export_refusal(args)
    if refusal is not None:
        raise SystemExit(f"{directory}: {refusal}")
    if hf_mapping.WORD_EMBEDDING not in model:
        raise SystemExit(f"{directory}: no '{hf_mapping.WORD_EMBEDDING}' in the checkpoint; is it a GPT model?")
    padded_vocab_size = model[hf_mapping.WORD_EMBEDDING].shape[0]
    source = common.get(HF_SOURCE_KEY) or {}
    requested_by = "as --hf-architecture asks" if architecture else (
        "the architecture it was imported from; pass --hf-architecture to write another")
    dtype = export_dtype(common, dtype)
    config_keys = dict(source.get("config_keys") or {})
    try:
        shape = hf_mapping.ModelShape.from_args(args, true_vocab_size(common, vocab_size, vocab_size_flag),
                                                 padded_vocab_size)
        architecture = hf_mapping.architecture_for(shape, architecture or source.get("architecture"), requested_by)
        if architecture == hf_deepseek.DEEPSEEK_V3:
            rope_interleave = (source.get("config_keys") or {}).get("rope_interleave", True)
            tensors, extras = hf_deepseek.to_hf_tensors(model, shape, hf_mapping.HF_DTYPES[dtype], rope_interleave)
        elif architecture in hf_hybrid.HYBRID_ARCHITECTURES:
            tensors, extras = hf_hybrid_tensors.to_hf_tensors(model, shape, architecture, hf_mapping.HF_DTYPES[dtype],
                                                              config_keys.get("use_conv_bias", True))
            if shape.layers_marked(hf_hybrid.MAMBA):  # zero biases an import had none of stay out
                config_keys["use_conv_bias"] = hf_hybrid_tensors.has_conv_bias(tensors)
        elif architecture == hf_nemotron_nas.NEMOTRON_NAS:
            tensors, extras = hf_nemotron_nas.to_hf_tensors(model, shape, hf_mapping.HF_DTYPES[dtype])
        else:
            tensors, extras = hf_mapping.to_hf_tensors(model, shape, architecture, hf_mapping.HF_DTYPES[dtype])
    except hf_mapping.ConversionError as exc:
        raise SystemExit(f"{directory}: {exc}") from exc
    os.makedirs(output, exist_ok=True)
    with open(os.path.join(output, hf_mapping.CONFIG_FILE), "w") as stream:
        token_ids = source["token_ids"] if "token_ids" in source else trained_token_ids(args)
        json.dump(hf_mapping.hf_config(shape, architecture, dtype, token_ids, config_keys), stream, indent=2)
    safetensors_format.save_file(tensors, os.path.join(output, hf_mapping.MODEL_FILE), {"format": "pt"})
    safetensors_format.save_file(extras, os.path.join(output, hf_mapping.EXTRAS_FILE),
                                 hf_mapping.extras_metadata(shape, common.get("iteration", 0)))
    return tensors


def _read_hf_tensors(directory):
    """The tensors of model.safetensors, or of the shards a model.safetensors.index.json names."""
    import hf_mapping
    from megatron.core.dist_checkpointing import safetensors_format

    index = os.path.join(directory, hf_mapping.MODEL_INDEX_FILE)
    if os.path.exists(index):
        with open(index) as stream:
            shards = sorted(set(json.load(stream)["weight_map"].values()))
    elif os.path.exists(os.path.join(directory, hf_mapping.MODEL_FILE)):
        shards = [hf_mapping.MODEL_FILE]
    else:
        raise SystemExit(f"{directory}: neither {hf_mapping.MODEL_FILE} nor {hf_mapping.MODEL_INDEX_FILE} (a "
                         "directory of PyTorch .bin weights: save it again with safe_serialization=True)")
    tensors = {}
    for shard in shards:
        tensors.update(safetensors_format.load_file(os.path.join(directory, shard))[0])
    return tensors


def from_hf(directory, root, iteration=None, make_vocab_size_divisible_by=128, apply_layernorm_1p=False):
    """A model-only logical checkpoint from a Hugging Face directory. What megatron_extras.safetensors records
    wins over `make_vocab_size_divisible_by` (the padding of a model from elsewhere) and `apply_layernorm_1p`."""
    return import_hf(directory, root, iteration, make_vocab_size_divisible_by, apply_layernorm_1p)[0]


def hf_tokenizer_vocab_size(directory):
    """The vocabulary size of the tokenizer in a Hugging Face model directory, or None when it has none that
    HuggingFaceTokenizer loads."""
    from megatron.training.tokenizer import HuggingFaceTokenizer

    if not any(os.path.isfile(os.path.join(directory, name)) for name in ("tokenizer.json", "tokenizer_config.json")):
        return None
    try:
        return HuggingFaceTokenizer(directory).vocab_size
    except Exception:  # a tokenizer that needs its own code, or another package: the hint then says less
        return None


def tensor_parallel_sizes(shape, largest=8):
    """The tensor-parallel sizes up to `largest` (powers of two) that split the model's attention heads and
    key/value heads evenly (a heterogeneous model's: every attention layer's), and a hybrid model's Mamba groups
    (its attention heads only with attention layers)."""
    from hf_nemotron_nas import layer_query_groups

    sizes, size = [], 1
    pattern = shape.hybrid_layer_pattern
    attention = pattern is None or "*" in pattern
    mamba = pattern is not None and "M" in pattern
    groups = layer_query_groups(shape)
    while size <= largest:
        if (not attention or shape.num_attention_heads % size == 0 and all(group % size == 0 for group in groups)) \
                and (not mamba or shape.mamba_num_groups % size == 0):
            sizes.append(size)
        size *= 2
    return sizes


def _padding_phrase(tokens, rows, sizes, preferred=None):
    """How --make-vocab-size-divisible-by pads `tokens` to exactly `rows` at each TP size of `sizes`."""
    from megatron.training.tokenizer import exact_padding_divisor

    divisors = {size: exact_padding_divisor(tokens, rows, size, preferred) for size in sizes}
    working = [(size, divisor) for size, divisor in divisors.items() if divisor is not None]
    if not working:
        return (f"no --make-vocab-size-divisible-by pads its {tokens} tokens to exactly the embedding's {rows} rows "
                f"at TP {', '.join(map(str, sizes))}: the padding rows then change on load")
    first = working[0][1]
    same = ", ".join(str(size) for size, divisor in working if divisor == first)
    phrase = (f"--make-vocab-size-divisible-by {first}, which pads its {tokens} tokens to the embedding's {rows} "
              f"rows at TP {same}")
    others = [f"{divisor} at TP {size}" for size, divisor in working if divisor != first]
    if others and preferred is not None:  # --use-checkpoint-args takes the recorded rows at any TP
        phrase += (" (" + ", ".join(others) + ", given with the model flags in place of --use-checkpoint-args, "
                   f"which keeps the embedding's {rows} rows at any TP size that divides them)")
    elif others:
        phrase += " (" + ", ".join(others) + ")"
    missing = [str(size) for size, divisor in divisors.items() if divisor is None]
    if missing:
        phrase += (f"; none gives {rows} rows at TP {', '.join(missing)} (the padding rows then change on load, "
                   "and a checkpoint imported without a tokenizer is refused)")
    return phrase


def recorded_vocab_divisor(recorded_vocab_size, rows, tokenizer_known, preferred=None):
    """The --make-vocab-size-divisible-by an import records (and prints among the model flags): the one that pads
    the recorded vocabulary to the embedding's rows at TP 1; None where the tokenizer is unknown (its rows then
    stand for the vocabulary, and the divisor is the run's, chosen for the tokenizer it brings)."""
    from megatron.training.tokenizer import exact_padding_divisor

    if not tokenizer_known:
        return None
    return exact_padding_divisor(recorded_vocab_size, rows, 1, preferred if recorded_vocab_size == rows else None)


def hf_import_training_hint(directory, root, shape, tokenizer_vocab_size=None, sizes=None, divisor=None):
    """How to train from the checkpoint `--from hf` wrote: the flags that rebuild its model and its tokenizer.
    `tokenizer_vocab_size`: the tokenizer's vocabulary size where known (else the embedding's rows stand for it);
    `sizes`: the TP sizes to give the vocabulary padding for (default: those that split the model);
    `divisor`: the --make-vocab-size-divisible-by the import recorded (None: none)."""
    tokens, rows = tokenizer_vocab_size or shape.vocab_size, shape.padded_vocab_size
    sizes = sizes or tensor_parallel_sizes(shape)
    known = tokenizer_vocab_size is not None or tokens < rows
    if hf_tokenizer_vocab_size(directory) is not None:
        tokenizer = f"the model's own (--tokenizer-type HuggingFaceTokenizer --tokenizer-model {directory})"
    else:
        tokenizer = (f"the one the model was trained with ({directory} holds no tokenizer: give its --tokenizer-type "
                     "and files as that training did)")
    mock = (f"with --mock-data, --tokenizer-type NullTokenizer --vocab-size {tokens - 1} (its ids and the "
            "end-of-document id)")
    if known:
        padding = _padding_phrase(tokens, rows, sizes, divisor)
        vocabulary = f"a tokenizer of {tokens} tokens: {tokenizer} or, {mock}; {padding}"
    else:
        vocabulary = (f"a tokenizer: {tokenizer} or, {mock}; the checkpoint records its {rows} embedding rows as its "
                      f"vocabulary, so give the --make-vocab-size-divisible-by that pads the tokenizer's tokens to "
                      f"exactly {rows} rows (D x TP divides {rows} and exceeds {rows} minus the tokens; "
                      f"{_padding_phrase(tokens, rows, sizes)})")
    # a heterogeneous model's layers: the directory's config.json, whose text the checkpoint records
    flags = shape.training_flags(os.path.join(directory, "config.json")) + \
        (f" --make-vocab-size-divisible-by {divisor}" if divisor else "")
    script = "pretrain_gpt.py" if shape.hybrid_layer_pattern is None else "pretrain_mamba.py"
    return (f"train from it with {script} --load {root} --finetune --use-checkpoint-args (the model flags "
            f"below, recorded in the checkpoint; without --use-checkpoint-args pass them all) and {vocabulary}; "
            f"--seq-length at most {shape.max_position_embeddings}\n"
            f"model flags: {flags}")


def import_hf(directory, root, iteration, make_vocab_size_divisible_by, apply_layernorm_1p, tokens=None):
    """from_hf's (model tensors, hf_mapping.ModelShape, the vocabulary size of the tokenizer or None, the
    --make-vocab-size-divisible-by recorded or None). `tokens`: the tokenizer's vocabulary size where it is known
    otherwise (at most the embedding's rows), else the directory's tokenizer's."""
    import hf_deepseek
    import hf_hybrid
    import hf_hybrid_tensors
    import hf_mapping
    import hf_nemotron_nas
    import hf_unsupported
    from megatron.core.dist_checkpointing import offline, safetensors_format
    from megatron.training.tokenizer import pad_vocab_size

    config_path = os.path.join(directory, hf_mapping.CONFIG_FILE)
    if not os.path.exists(config_path):
        raise SystemExit(f"{directory}: no {hf_mapping.CONFIG_FILE}; is it a Hugging Face model directory?")
    with open(config_path) as stream:
        config_text = stream.read()
    config = json.loads(config_text)
    refusal = hf_unsupported.hf_import_refusal(config, directory)
    if refusal is not None:
        raise SystemExit(refusal)
    extras, metadata = {}, {}
    extras_path = os.path.join(directory, hf_mapping.EXTRAS_FILE)
    if os.path.exists(extras_path):
        extras, metadata = safetensors_format.load_file(extras_path)
    recorded = json.loads(metadata["megatron_model"]) if "megatron_model" in metadata else None
    try:
        padded = pad_vocab_size(config.get("vocab_size", 1), make_vocab_size_divisible_by)
        shape, architecture = hf_mapping.shape_from_hf_config(config, directory, recorded, padded, apply_layernorm_1p,
                                                              config_text)
        hf_tensors = _read_hf_tensors(directory)
        if architecture == hf_deepseek.DEEPSEEK_V3:  # the shape gains the MTP layer and expert bias the files hold
            model, shape = hf_deepseek.from_hf_tensors(hf_tensors, extras, shape, directory,
                                                       config.get("rope_interleave", True),
                                                       config.get("num_nextn_predict_layers", 0))
        elif architecture in hf_hybrid.HYBRID_ARCHITECTURES:
            model = hf_hybrid_tensors.from_hf_tensors(hf_tensors, extras, shape, directory,
                                                      hf_hybrid.uses_conv_bias(config, architecture))
        elif architecture == hf_nemotron_nas.NEMOTRON_NAS:
            model = hf_nemotron_nas.from_hf_tensors(hf_tensors, extras, shape, directory)
        else:
            model = hf_mapping.from_hf_tensors(hf_tensors, extras, shape, architecture, directory)
    except hf_mapping.ConversionError as exc:
        raise SystemExit(str(exc)) from exc
    # The tokenizer's vocabulary is what training checks; HF's embedding may hold more rows (Qwen2's 151936 for
    # 151665 tokens), the padded vocabulary of that tokenizer, kept for `--to hf`.
    tokens = hf_tokenizer_vocab_size(directory) if tokens is None else tokens
    tokens = tokens if tokens is not None and tokens <= shape.vocab_size else None
    source = {"architecture": architecture, "dtype": hf_mapping.dtype_of_tensors(hf_tensors),
              "vocab_size": shape.vocab_size,
              "token_ids": {key: config.get(key) for key in hf_mapping.TOKEN_ID_KEYS},
              "config_keys": {key: config[key] for key in (*hf_mapping.RECORDED_CONFIG_KEYS,
                                                            *hf_deepseek.RECORDED_CONFIG_KEYS) if key in config}}
    if architecture in hf_hybrid.HYBRID_ARCHITECTURES:  # older Nemotron-H names under the current ones
        hybrid_config = hf_hybrid.with_class_defaults(config, architecture)
        source["config_keys"] = {key: hybrid_config[key] for key in hf_hybrid.RECORDED_CONFIG_KEYS
                                 if key in hybrid_config}
    iteration = int(metadata.get("iteration", 0)) if iteration is None else iteration
    state = {f"model.{name}": tensor for name, tensor in model.items()}
    layout = _layout(f"{os.path.basename(os.path.normpath(directory))} ({architecture})")
    # The model's flags and vocabulary, so that training checks them when it loads this and --to hf works again:
    # the embedding's rows, and the padding that gives them for the tokenizer where that is known (config.json's
    # vocab_size below the rows, or a tokenizer); without, the rows stand for the vocabulary.
    vocab_size = tokens or shape.vocab_size
    divisor = recorded_vocab_divisor(vocab_size, shape.padded_vocab_size,
                                     tokens is not None or vocab_size < shape.padded_vocab_size,
                                     make_vocab_size_divisible_by)
    args = shape.to_args()
    args.padded_vocab_size = shape.padded_vocab_size
    if divisor is not None:
        args.make_vocab_size_divisible_by = divisor
    state["common"] = {"checkpoint_version": 1, "iteration": iteration, "consumed_train_samples": 0,
                       "args": args, "layout": layout, "vocab_size": vocab_size, HF_SOURCE_KEY: source}
    offline.write_checkpoint(root, iteration, state, layout)
    return model, shape, tokens, divisor


def _layout(source):
    return {"tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1, "data_parallel_size": 1,
            "world_size": 1, "wrapper": f"converted from {source}", "ckpt_format": "torch_dist"}


def from_torch(path, root, iteration=None):
    from megatron.core.dist_checkpointing import offline

    try:
        saved = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as exc:  # pickle, zip and EOF errors alike: not a file torch.save wrote
        raise SystemExit(f"--input {path}: not a torch.save file ({type(exc).__name__}: {exc}); --from torch reads "
                         "the file --to torch wrote") from exc
    if not isinstance(saved, dict) or "model" not in saved:
        raise SystemExit(f"--input {path}: expected a dict with 'model' (as written by --to torch)")
    state = {f"model.{name}": tensor for name, tensor in saved["model"].items()}
    state.update(saved.get("checkpoint", {}))
    common = dict(state.get("common") or {})
    common["iteration"] = common.get("iteration", 0) if iteration is None else iteration
    common["layout"] = _layout(os.path.basename(path))
    state["common"] = common
    offline.write_checkpoint(root, common["iteration"], state, common["layout"])


def from_safetensors(path, root, iteration=None):
    from megatron.core.dist_checkpointing import offline, safetensors_format

    try:
        tensors, metadata = safetensors_format.load_file(path)
    except ValueError as exc:
        raise SystemExit(f"--input {exc}; --from safetensors reads the file --to safetensors wrote (one from "
                         "--to torch converts with --from torch)") from exc
    iteration = int(metadata.get("iteration", 0)) if iteration is None else iteration
    state = {f"model.{name}": tensor for name, tensor in tensors.items()}
    layout = _layout(os.path.basename(path))
    state["common"] = {"checkpoint_version": 1, "iteration": iteration, "consumed_train_samples": 0,
                       "args": None, "layout": layout}
    offline.write_checkpoint(root, iteration, state, layout)


def main(argv=None):
    from hf_families import ARCHITECTURES

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    direction = parser.add_mutually_exclusive_group(required=True)
    direction.add_argument("--to", choices=["torch", "safetensors", "hf"])
    direction.add_argument("--from", dest="source", choices=["torch", "safetensors", "hf"])
    parser.add_argument("--input", required=True)
    parser.add_argument("--output", required=True)
    parser.add_argument("--iteration", type=int, default=None,
                        help="With --from: iteration of the written checkpoint (default: the one recorded).")
    parser.add_argument("--vocab-size", type=int, default=None,
                        help="With --to hf: the tokenizer's vocabulary size, where the checkpoint's tokenizer "
                        "cannot be rebuilt (default: from the recorded arguments).")
    parser.add_argument("--hf-architecture", default=None, choices=ARCHITECTURES,
                        help="With --to hf: the Hugging Face architecture to write (default: the one the checkpoint "
                        "was imported from, else GPT2LMHeadModel for learned positions, LlamaForCausalLM for RoPE, "
                        "Qwen3ForCausalLM for RoPE with --qk-layernorm, DeepseekV3ForCausalLM for "
                        "--multi-latent-attention, NemotronHForCausalLM or Mamba2ForCausalLM for "
                        "--hybrid-override-pattern, DeciLMForCausalLM for --heterogeneous-layers-config-path); "
                        "refused, naming the flags, where it would compute another model.")
    parser.add_argument("--hf-dtype", default=None, choices=["float32", "bfloat16", "float16"],
                        help="With --to hf: the dtype of the weights written (default: the one the checkpoint "
                        "trained in, bfloat16 with --bf16 and float16 with --fp16; for an imported checkpoint the "
                        "one it was imported in).")
    parser.add_argument("--make-vocab-size-divisible-by", type=int, default=128,
                        help="With --from hf, for a directory not written by --to hf: pad the vocabulary to a "
                        "multiple of this, as training does at TP 1.")
    parser.add_argument("--apply-layernorm-1p", action="store_true",
                        help="With --from hf, for a directory not written by --to hf: store norm weights as "
                        "gamma - 1, for training with --apply-layernorm-1p.")
    options = parser.parse_args(argv)
    if options.source in ("torch", "safetensors") and not os.path.isfile(options.input):
        parser.error(f"--input {options.input}: not a file (--from {options.source} reads the file that "
                     f"--to {options.source} wrote)")
    if options.source == "hf" and not os.path.isdir(options.input):
        parser.error(f"--input {options.input}: not a directory (--from hf reads a Hugging Face model directory)")
    if options.to in ("torch", "safetensors") and os.path.isdir(options.output):
        suffix = "pt" if options.to == "torch" else "safetensors"
        parser.error(f"--output {options.output}: a directory; --to {options.to} writes one file, such as "
                     f"{os.path.join(options.output, 'model.' + suffix)}")
    if options.to == "torch":
        to_torch(options.input, options.output)
    elif options.to == "safetensors":
        to_safetensors(options.input, options.output)
    elif options.to == "hf":
        to_hf(options.input, options.output, options.vocab_size, options.hf_architecture, options.hf_dtype)
    elif options.source == "torch":
        from_torch(options.input, options.output, options.iteration)
    elif options.source == "safetensors":
        from_safetensors(options.input, options.output, options.iteration)
    else:
        _, shape, tokens, divisor = import_hf(options.input, options.output, options.iteration,
                                              options.make_vocab_size_divisible_by, options.apply_layernorm_1p)
        print(f"wrote {options.output}")
        print(hf_import_training_hint(options.input, options.output, shape, tokens, divisor=divisor))
        return
    print(f"wrote {options.output}")


if __name__ == "__main__":
    main()
