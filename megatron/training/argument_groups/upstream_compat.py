"""Upstream Megatron-LM flags that name no feature of their own here, so that pasted launch scripts parse and
each one gets upstream's answer or a clear one:

- aliases: --encoder-num-layers and --encoder-seq-length are upstream's other names of --num-layers and
  --seq-length;
- removed flags: --batch-size, --warmup and --model-parallel-size stop with upstream's own messages, and the
  deprecated --[no-]async-tensor-model-parallel-allreduce are ignored, as upstream does;
- no-ops: telemetry (one-logger, app tags, the config logger), the legacy tokenizer switch, --onnx-safe, the
  sub-switches of --tp-comm-overlap, --use-te-activation-func (a kernel choice: the torch activation computes the
  same function) and --enable-experimental (nothing is gated behind it here); none of them changes what is
  computed;
- refusals: features this build does not have (lazy model-parallel initialisation, pre-0.14 checkpoint layouts,
  local checkpoint replication, Transformer Engine export, in-process restart, NVIDIA Kitchen quantization; the
  --inprocess-* settings alone only warn) and the flags of other upstream programs (BERT, T5,
  RETRO, REALM, the multimodal tokenizer, the inference server and engine), each named with what to do.
"""

import warnings

PRETRAIN_GPT_ONLY = "this project trains GPT models with pretrain_gpt.py"

# (flag, the upstream feature it belongs to); given, each stops validation.
OTHER_PROGRAMS_FLAGS = (
    ("--decoder-seq-length", "encoder-decoder (T5) models (their decoder's sequence length; GPT's is --seq-length)"),
    ("--bert-no-binary-head", "BERT pretraining (the sentence-order head)"),
    ("--output-bert-embeddings", "BERT embedding export"),
    ("--embedding-path", "the REALM / ORQA retriever's embedding store"),
    ("--retro-project-dir", "RETRO (retrieval-augmented) pretraining"),
    ("--tokenizer-prompt-format", "the multimodal tokenizer's chat prompt format (for --sft data the format "
     "is --sft-tokenizer-prompt-format)"),
)
# (flag, what tools/run_text_generation_server.py does instead); given, each stops validation.
SERVER_TUNING_FLAGS = (
    ("--inference-batch-times-seqlen-threshold", "it batches up to --inference-max-requests prompts, without "
     "pipelined batch splitting"),
    ("--max-tokens-to-oom", "each request is bounded by --inference-max-seq-length (prompt + generated tokens)"),
)

# Upstream: "DEPRECATED. This flag is ignored."
IGNORED_DEPRECATED_FLAGS = ("--async-tensor-model-parallel-allreduce", "--no-async-tensor-model-parallel-allreduce")

# They tune --tp-comm-overlap (Transformer Engine userbuffers), which communication.py refuses; without it they
# do nothing upstream either.
TP_COMM_OVERLAP_SWITCHES = (
    ("--disable-tp-comm-overlap-ag", "store_false", "tp_comm_overlap_ag"),
    ("--disable-tp-comm-overlap-rs", "store_false", "tp_comm_overlap_rs"),
    ("--tp-comm-overlap-rs-dgrad", "store_true", "tp_comm_overlap_rs_dgrad"),
    ("--disable-tp-comm-bulk-dgrad", "store_false", "tp_comm_bulk_dgrad"),
    ("--disable-tp-comm-bulk-wgrad", "store_false", "tp_comm_bulk_wgrad"),
    ("--disable-tp-comm-split-ag", "store_false", "tp_comm_split_ag"),
    ("--disable-tp-comm-split-rs", "store_false", "tp_comm_split_rs"),
)

DEFAULT_REPLICATION_FACTOR = 2

# The settings of upstream's in-process restart (nvidia-resiliency-ext), with upstream's defaults for the help.
INPROCESS_SETTINGS = (
    ("--inprocess-max-iterations", int, "None", "restart attempts"),
    ("--inprocess-monitor-thread-interval", float, "1.0", "monitoring thread interval (s)"),
    ("--inprocess-monitor-process-interval", float, "1.0", "monitoring process interval (s)"),
    ("--inprocess-progress-watchdog-interval", float, "1.0", "progress watchdog interval (s)"),
    ("--inprocess-heartbeat-interval", float, "30", "heartbeat interval (s)"),
    ("--inprocess-soft-timeout", float, "60", "soft progress timeout (s)"),
    ("--inprocess-hard-timeout", float, "90", "hard progress timeout (s)"),
    ("--inprocess-heartbeat-timeout", float, "60", "missing-heartbeat timeout (s)"),
    ("--inprocess-barrier-timeout", float, "120", "internal barrier timeout (s)"),
    ("--inprocess-completion-timeout", float, "120", "completion barrier timeout (s)"),
    ("--inprocess-last-call-wait", float, "1", "wait for concurrent failures (s)"),
    ("--inprocess-termination-grace-time", float, "1", "SIGTERM-to-SIGKILL grace time (s)"),
    ("--inprocess-granularity", str, "node", "restart granularity, node or rank"),
    ("--inprocess-active-world-size", int, "WORLD_SIZE", "ranks running the job (the rest a warm reserve)"),
)


def boolean(text):
    """Upstream declares --lazy-mpu-init and --onnx-safe with type=bool, which reads "False" as True; here the
    value means what it says."""
    lowered = text.lower()
    if lowered in ("true", "1", "yes"):
        return True
    if lowered in ("false", "0", "no"):
        return False
    raise ValueError(f"expected True or False, got {text!r}")


def add_arguments(parser):
    group = parser.add_argument_group("upstream compatibility (aliases, removed and no-op flags)")
    _add_aliases(group)
    _add_removed(group)
    _add_no_ops(group)
    _add_refused(group)


def _add_aliases(group):
    group.add_argument("--encoder-num-layers", type=int, default=None,
                       help="Upstream's other name of --num-layers (give one of them).")
    group.add_argument("--encoder-seq-length", type=int, default=None,
                       help="Upstream's other name of --seq-length (give one of them).")


def _add_removed(group):
    group.add_argument("--batch-size", type=int, default=None,
                       help="Removed upstream: an error; use --micro-batch-size.")
    group.add_argument("--warmup", type=int, default=None,
                       help="Removed upstream: an error; use --lr-warmup-fraction (or --lr-warmup-iters).")
    group.add_argument("--model-parallel-size", type=int, default=None,
                       help="Removed upstream: an error; use --tensor-model-parallel-size.")
    group.add_argument("--async-tensor-model-parallel-allreduce", action="store_const", const=True, default=None,
                       dest="async_tensor_model_parallel_allreduce",
                       help="Deprecated upstream and ignored (a warning says so).")
    group.add_argument("--no-async-tensor-model-parallel-allreduce", action="store_const", const=False,
                       dest="async_tensor_model_parallel_allreduce",
                       help="Deprecated upstream and ignored (a warning says so).")


def _add_no_ops(group):
    accepted = "Accepted for upstream scripts: "
    no_telemetry = "there is no one-logger telemetry here."
    group.add_argument("--no-one-logger", action="store_false", dest="enable_one_logger",
                       help=f"{accepted}upstream turns one-logger telemetry off with it; {no_telemetry}")
    group.add_argument("--enable-one-logger", action="store_true", dest="enable_one_logger", default=True,
                       help=f"{accepted}older upstream switch of one-logger telemetry; {no_telemetry}")
    group.add_argument("--one-logger-project", default="megatron-lm",
                       help=f"{accepted}one-logger telemetry's project; {no_telemetry}")
    group.add_argument("--one-logger-run-name", default=None,
                       help=f"{accepted}one-logger telemetry's run name; {no_telemetry}")
    group.add_argument("--one-logger-async", action="store_true",
                       help=f"{accepted}asynchronous one-logger telemetry; {no_telemetry}")
    group.add_argument("--app-tag-run-name", default=None,
                       help=f"{accepted}one-logger telemetry's application tag; {no_telemetry}")
    group.add_argument("--app-tag-run-version", default="0.0.0",
                       help=f"{accepted}one-logger telemetry's application tag version; {no_telemetry}")
    group.add_argument("--config-logger-dir", default="",
                       help=f"{accepted}upstream dumps every module's config, inputs and outputs there (debugging); "
                       "nothing is written here (a warning says so).")
    group.add_argument("--legacy-tokenizer", action="store_true",
                       help=f"{accepted}upstream then uses megatron.training.tokenizer instead of the newer "
                       "megatron.core.tokenizers; the tokenizers here are always those of megatron.training.tokenizer.")
    group.add_argument("--onnx-safe", type=boolean, default=None,
                       help=f"{accepted}ONNX-exporter workarounds of upstream's legacy models (Megatron-Core's GPT "
                       "ignores it); there is no ONNX export here.")
    group.add_argument("--use-te-activation-func", action="store_true",
                       help=f"{accepted}upstream takes the MLP activation's kernel from Transformer Engine; the "
                       "torch activation here computes the same function.")
    group.add_argument("--enable-experimental", action="store_true",
                       help=f"{accepted}upstream unlocks the features it marks experimental; nothing is gated behind "
                       "it here.")
    for flag, action, dest in TP_COMM_OVERLAP_SWITCHES:
        group.add_argument(flag, action=action, dest=dest,
                           help=f"{accepted}it tunes --tp-comm-overlap, which this build does not support (an "
                           "error); without it there is nothing to tune, as upstream.")


def _add_refused(group):
    group.add_argument("--lazy-mpu-init", type=boolean, default=None,
                       help="Upstream: initialize_megatron() leaves the model-parallel set-up to an external DDP "
                       "manager. pretrain_gpt.py sets it up itself: True is an error.")
    group.add_argument("--dist-ckpt-save-pre-mcore-014", action="store_true",
                       help="Upstream: save torch_dist checkpoints in the layout of Megatron-Core before 0.14. Not "
                       "supported: an error.")
    group.add_argument("--replication", action="store_true",
                       help="Upstream: replicate local checkpoints to other ranks (nvidia-resiliency-ext). Not "
                       "supported: an error.")
    group.add_argument("--replication-jump", type=int, default=None,
                       help="With --replication: the rank spacing of the replicas.")
    group.add_argument("--replication-factor", type=int, default=DEFAULT_REPLICATION_FACTOR,
                       help="With --replication: how many machines hold each rank's checkpoint.")
    group.add_argument("--inprocess-restart", action="store_true",
                       help="Upstream: restart training inside the running processes after a fault "
                       "(nvidia-resiliency-ext). Not supported: an error.")
    for flag, kind, default, what in INPROCESS_SETTINGS:
        extra = {"choices": ["node", "rank"]} if flag == "--inprocess-granularity" else {}
        group.add_argument(flag, type=kind, default=None, help=f"With --inprocess-restart (not supported): the "
                           f"{what}; upstream's default {default}.", **extra)
    group.add_argument("--inprocess-empty-cuda-cache", action="store_true",
                       help="With --inprocess-restart (not supported): empty the CUDA cache on every restart.")
    group.add_argument("--export-te-mcore-model", action="store_true",
                       help="Upstream (Model Optimizer): export a Transformer Engine Megatron-Core model. Not "
                       "supported: an error.")
    group.add_argument("--bert-no-binary-head", action="store_true", help="BERT: an error here.")
    group.add_argument("--output-bert-embeddings", action="store_true", help="BERT: an error here.")
    group.add_argument("--decoder-seq-length", type=int, default=None, help="T5: an error here.")
    group.add_argument("--embedding-path", default=None, help="REALM / ORQA: an error here.")
    group.add_argument("--retro-project-dir", default=None, help="RETRO: an error here.")
    group.add_argument("--tokenizer-prompt-format", default=None,
                       help="The multimodal tokenizer: an error here.")
    group.add_argument("--inference-batch-times-seqlen-threshold", type=int, default=None,
                       help="Upstream's text-generation server: an error here.")
    group.add_argument("--max-tokens-to-oom", type=int, default=None,
                       help="Upstream's text-generation server: an error here.")
    group.add_argument("--nccl-all-reduce-for-prefill", action="store_true",
                       help="Upstream's inference engine: NCCL's all-reduce instead of the --symmetric-ar-type "
                       "kernels during prefill. An error here.")
    kitchen = group.add_mutually_exclusive_group()
    kitchen.add_argument("--kitchen-config-file", default=None,
                         help="Upstream: a YAML configuring NVIDIA Kitchen quantization per layer. Not supported: an "
                         "error.")
    kitchen.add_argument("--kitchen-recipe-number", type=int, default=None,
                         help="Upstream: one NVIDIA Kitchen quantization recipe for all layers. Not supported: an "
                         "error.")


def validate(args):
    _reject_removed(args)
    _resolve_aliases(args)
    _reject_unsupported(args)
    _warn_ignored(args)


def _reject_removed(args):
    # Upstream's messages, word for word.
    if args.batch_size is not None:
        raise ValueError("--batch-size argument is no longer valid, use --micro-batch-size instead")
    if args.warmup is not None:
        raise ValueError("--warmup argument is no longer valid, use --lr-warmup-fraction instead")
    if args.model_parallel_size is not None:
        raise ValueError("--model-parallel-size is no longer valid, use --tensor-model-parallel-size instead")


def _resolve_aliases(args):
    for alias, name, attribute, alias_attribute in (
            ("--encoder-num-layers", "--num-layers", "num_layers", "encoder_num_layers"),
            ("--encoder-seq-length", "--seq-length", "seq_length", "encoder_seq_length")):
        alias_value = getattr(args, alias_attribute)
        if alias_value is None:
            setattr(args, alias_attribute, getattr(args, attribute))
            continue
        value = getattr(args, attribute)
        if value is not None and value != alias_value:
            raise ValueError(f"{alias} {alias_value} and {name} {value} set the same value (upstream's two names "
                             "of it): give one of them")
        setattr(args, attribute, alias_value)


def _reject_unsupported(args):
    if args.lazy_mpu_init:
        raise ValueError("--lazy-mpu-init leaves the model-parallel set-up to an external DDP manager that calls "
                         "initialize_megatron() itself; pretrain_gpt.py sets up its process groups on its own: drop "
                         "the flag (for weights initialised on the host, use --use-cpu-initialization)")
    if args.dist_ckpt_save_pre_mcore_014:
        raise ValueError("--dist-ckpt-save-pre-mcore-014 is not supported: torch_dist checkpoints here have one "
                         "layout, which loaders of Megatron-Core before 0.14 may not read; drop the flag, and convert "
                         "checkpoints with tools/checkpoint/convert_checkpoint.py where another tool must read them")
    if args.replication:
        raise ValueError("--replication (copies of each rank's local checkpoint on other machines, upstream's "
                         "nvidia-resiliency-ext) is not implemented: --non-persistent-ckpt-type local writes each "
                         "rank's part once, to --non-persistent-local-ckpt-dir; drop --replication (and "
                         "--replication-jump / --replication-factor), and keep persistent checkpoints (--save, "
                         "--save-interval) on shared storage")
    if args.inprocess_restart:
        raise ValueError("--inprocess-restart (restarting training inside the running processes after a fault, "
                         "upstream's nvidia-resiliency-ext wrapper) is not supported: drop it and the --inprocess-* "
                         "flags, and relaunch the job to resume from its last checkpoint instead (--save with "
                         "--save-interval, and --load)")
    if args.export_te_mcore_model:
        raise ValueError("--export-te-mcore-model is not supported: there is no Transformer Engine export; drop it "
                         "(checkpoints convert with tools/checkpoint/convert_checkpoint.py, e.g. --to hf)")
    for flag, use in OTHER_PROGRAMS_FLAGS:
        if getattr(args, flag[2:].replace("-", "_")) not in (None, False):
            raise ValueError(f"{flag} belongs to {use}, which this project does not have; {PRETRAIN_GPT_ONLY}: "
                             f"drop {flag}")
    for flag, value in (("--kitchen-config-file", args.kitchen_config_file),
                        ("--kitchen-recipe-number", args.kitchen_recipe_number)):
        if value is not None:
            raise ValueError(f"{flag} configures NVIDIA Kitchen quantization, a library this build does not support: "
                             f"drop {flag}; for low-precision linear layers use --fp8-format / --fp8-recipe, and for "
                             "nvidia-modelopt quantization examples/post_training/quantize.py (then pretrain_gpt.py "
                             "--load <quantized> --finetune trains it quantization-aware)")
    if args.nccl_all_reduce_for_prefill:
        raise ValueError("--nccl-all-reduce-for-prefill switches upstream's inference engine from --symmetric-ar-type "
                         "kernels to NCCL's all-reduce during prefill; neither pretrain_gpt.py nor "
                         "tools/run_text_generation_server.py has symmetric-memory kernels (every tensor-parallel "
                         "all-reduce, prefill included, is torch.distributed all_reduce): drop the flag")
    for flag, instead in SERVER_TUNING_FLAGS:
        if getattr(args, flag[2:].replace("-", "_")) is not None:
            raise ValueError(f"{flag} tunes upstream's text-generation server; tools/run_text_generation_server.py "
                             f"has no such setting ({instead}): drop {flag}")


def _warn_ignored(args):
    if args.async_tensor_model_parallel_allreduce is not None:
        flag = IGNORED_DEPRECATED_FLAGS[0 if args.async_tensor_model_parallel_allreduce else 1]
        warnings.warn(f"{flag} is deprecated upstream and ignored (tensor-parallel all-reduces always run as "
                      "they must); drop it")
    if args.config_logger_dir:
        warnings.warn(f"--config-logger-dir {args.config_logger_dir}: this build does not dump module configs, "
                      "inputs or outputs; nothing is written there")
    given = [flag for flag, _, _, _ in INPROCESS_SETTINGS if getattr(args, flag[2:].replace("-", "_")) is not None]
    given += ["--inprocess-empty-cuda-cache"] if args.inprocess_empty_cuda_cache else []
    if given:
        warnings.warn(f"{', '.join(given)} have no effect without --inprocess-restart (which is not supported "
                      "here); drop them")
    if not args.replication and (args.replication_jump is not None
                                 or args.replication_factor != DEFAULT_REPLICATION_FACTOR):
        warnings.warn("--replication-jump / --replication-factor have no effect without --replication (which is "
                      "not supported here); drop them")
