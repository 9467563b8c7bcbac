"""Flag parsing and validation: derived values, the rules with their messages, unknown flags, unfinished features."""

import os
import warnings

import pytest

from megatron.training.arguments import parse_args, validate_args
from tests.unit_tests.training.argument_checks import BASE


def validated(extra="", world_size=1, monkeypatch=None, defaults=None):
    """Other test modules import this one: with `monkeypatch` WORLD_SIZE / RANK stay set for the rest of their
    test; without, validation reads the environment as it is."""
    if monkeypatch is not None:
        monkeypatch.setenv("WORLD_SIZE", str(world_size))
        monkeypatch.setenv("RANK", "0")
    return validate_args(parse_args(args=(BASE + " " + extra).split()), defaults)


@pytest.fixture(autouse=True)
def single_process_env(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")


def test_megatron_defaults():
    args = validated()
    assert args.ckpt_format == "torch_dist"
    assert args.log_interval == 100
    assert args.init_method_std == 0.02
    assert args.hidden_dropout == 0.1 and args.attention_dropout == 0.1
    assert args.make_vocab_size_divisible_by == 128
    assert args.split == "969, 30, 1"
    assert args.data_parallel_sharding_strategy == "optim_grads_params"
    assert args.outer_dp_sharding_strategy == "no_shard"
    assert args.num_distributed_optimizer_instances == 1
    assert args.gradient_accumulation_fusion is True
    assert (args.adam_beta1, args.adam_beta2, args.adam_eps, args.weight_decay) == (0.9, 0.999, 1e-8, 0.01)
    assert (args.clip_grad, args.seed, args.min_lr) == (1.0, 1234, 0.0)


def test_derived_values(monkeypatch):
    args = validated("--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2", 8, monkeypatch)
    assert args.data_parallel_size == 2
    assert args.global_batch_size == 2 * 2  # micro x DP
    assert args.ffn_hidden_size == 4 * 64
    assert args.kv_channels == 16
    assert args.max_position_embeddings == 32
    assert args.lr_decay_iters == 10
    assert args.tokenizer_type == "NullTokenizer"


def test_swiglu_ffn_default_is_two_thirds_rounded_to_64():
    assert validated("--hidden-size 768 --num-attention-heads 12 --swiglu").ffn_hidden_size == 2048
    assert validated("--ffn-hidden-size 100").ffn_hidden_size == 100


def test_args_defaults_fill_only_unset_options():
    args = validated("--lr 2e-3", defaults={"lr": 5.0, "save": "/ckpt"})
    assert args.lr == 2e-3 and args.save == "/ckpt"


@pytest.mark.parametrize(
    "extra, world_size, message",
    [
        ("--global-batch-size 6", 2,
         r"--global-batch-size \(6\) must be a positive multiple of --micro-batch-size \(2\) x data-parallel size "
         r"\(2\)"),
        ("--tensor-model-parallel-size 3", 4,
         r"world size \(4\) must be divisible by --tensor-model-parallel-size \(3\)"),
        ("--num-attention-heads 3 --hidden-size 63 --tensor-model-parallel-size 2", 2,
         r"--num-attention-heads \(3\) must be divisible by --tensor-model-parallel-size \(2\)"),
        ("--num-layers 3 --pipeline-model-parallel-size 2", 2,
         r"--num-layers \(3\) must be divisible by --pipeline-model-parallel-size \(2\)"),
        ("--hidden-size 65", 1, r"--hidden-size \(65\) must be divisible by --num-attention-heads \(4\)"),
        ("--seq-length 64 --max-position-embeddings 32", 1,
         r"--seq-length \(64\) must not exceed --max-position-embeddings \(32\)"),
        ("--overlap-param-gather", 1, r"--overlap-param-gather needs --overlap-grad-reduce"),
        ("--overlap-param-gather --overlap-grad-reduce", 1,
         r"--overlap-param-gather needs --use-distributed-optimizer or --use-megatron-fsdp"),
        ("--use-distributed-optimizer --num-distributed-optimizer-instances 3", 4,
         r"data-parallel x --context-parallel-size \(4\) must be divisible by --num-distributed-optimizer-instances "
         r"\(3\)"),
        ("--num-distributed-optimizer-instances 2", 4,
         r"--num-distributed-optimizer-instances > 1 needs --use-distributed-optimizer"),
        ("--use-megatron-fsdp --init-model-with-meta-device --data-parallel-sharding-strategy no_shard", 2,
         r"--init-model-with-meta-device needs a sharded --data-parallel-sharding-strategy"),
        ("--init-model-with-meta-device", 1, r"--init-model-with-meta-device needs --use-megatron-fsdp"),
        ("--use-torch-fsdp2 --untie-embeddings-and-output-weights --init-model-with-meta-device", 2,
         r"--init-model-with-meta-device needs --use-megatron-fsdp"),
        ("--use-torch-fsdp2 --untie-embeddings-and-output-weights --num-distributed-optimizer-instances 2", 4,
         r"--num-distributed-optimizer-instances > 1 needs --use-distributed-optimizer or --use-megatron-fsdp"),
        ("--use-torch-fsdp2 --untie-embeddings-and-output-weights --ckpt-format fsdp_dtensor", 2,
         r"--use-torch-fsdp2 needs --ckpt-format torch_dist or torch_dcp"),
        ("--lr-warmup-fraction 0.1 --lr-warmup-iters 2", 1,
         r"--lr-warmup-fraction and --lr-warmup-iters are exclusive"),
        ("--lr-warmup-fraction 1.0", 1, r"--lr-warmup-fraction must be in \[0, 1\), got 1.0"),
        ("--use-checkpoint-opt_param-scheduler --override-opt_param-scheduler", 1,
         r"--use-checkpoint-opt_param-scheduler and --override-opt_param-scheduler are exclusive"),
        ("--attention-backend flash", 1,
         r"--attention-backend flash is a Transformer Engine kernel .* pass --attention-backend auto, local or "
         r"unfused"),
        ("--attention-backend fused", 1, r"--attention-backend fused is a Transformer Engine kernel"),
        ("--use-megatron-fsdp --outer-dp-sharding-strategy optim --data-parallel-sharding-strategy "
         "optim_grads --num-distributed-optimizer-instances 2", 4,
         r"--outer-dp-sharding-strategy optim needs --data-parallel-sharding-strategy optim_grads_params"),
        ("--use-torch-fsdp2 --ckpt-format torch --untie-embeddings-and-output-weights", 2,
         r"--use-torch-fsdp2 needs --ckpt-format torch_dist or torch_dcp"),
        ("--use-torch-fsdp2", 2, r"--use-torch-fsdp2 needs --untie-embeddings-and-output-weights"),
        ("--use-torch-fsdp2 --untie-embeddings-and-output-weights --fp16", 2,
         r"--use-torch-fsdp2 does not support --fp16"),
        ("--use-torch-fsdp2 --untie-embeddings-and-output-weights --use-distributed-optimizer", 2,
         r"--use-torch-fsdp2 and --use-distributed-optimizer are exclusive"),
        ("--use-megatron-fsdp --use-torch-fsdp2", 2, r"--use-megatron-fsdp and --use-torch-fsdp2 are exclusive"),
        ("--fp8-format e4m3 --fp4-format e2m1", 1, r"--fp8-format and --fp4-format are exclusive"),
        ("--fp8-param-gather", 1, r"--fp8-param-gather needs --fp8-format"),
        ("--fp8-format e4m3 --fp8-param-gather", 2, r"--fp8-param-gather needs --use-distributed-optimizer"),
        ("--use-megatron-fsdp --fp8-format e4m3 --fp8-param-gather --data-parallel-sharding-strategy optim_grads", 2,
         r"--fp8-param-gather with --use-megatron-fsdp needs --data-parallel-sharding-strategy optim_grads_params "
         r"\(got optim_grads\)"),
        ("--fp8-format e4m3 --fp8-recipe mxfp8", 1, r"--fp8-recipe mxfp8 needs Transformer Engine on a GPU"),
        ("--first-last-layers-bf16", 1, r"--first-last-layers-bf16 needs --fp8-format"),
        ("--bf16 --fp16", 1, r"--bf16 and --fp16 are exclusive"),
        ("--min-lr 1.0", 1, r"--min-lr \(1.0\) must not exceed --lr"),
        ("--lr-warmup-iters 10", 1, r"--lr-warmup-iters \(10\) must be in \[0, --lr-decay-iters \(10\)\)"),
        ("--lr-warmup-init 0.1", 1, r"--lr-warmup-init \(0.1\) must be in \[0, --lr \(0.001\)\]"),
        ("--recompute-granularity full", 1, r"--recompute-granularity full needs --recompute-method"),
        ("--recompute-method uniform", 1, r"--recompute-method needs --recompute-granularity full"),
        ("--num-experts 4 --moe-layer-recompute --recompute-granularity full --recompute-method uniform "
         "--recompute-num-layers 1", 1,
         r"^--moe-layer-recompute does not work with --recompute-granularity full \(full recompute already "
         r"recomputes the whole layer, its MoE part included\): drop one of them$"),
        ("--save-interval 5", 1, r"--save-interval needs --save"),
        ("--data-path a_text_document", 1, r"--mock-data and --data-path are exclusive"),
        ("--split 1,x", 1, r"--split must be comma-separated numbers"),
        ("--group-query-attention --num-query-groups 3", 1,
         r"--num-query-groups \(3\) must be a positive divisor of --num-attention-heads \(4\)"),
        ("--group-query-attention --num-query-groups 1 --tensor-model-parallel-size 2", 2,
         r"--num-query-groups \(1\) must be divisible by --tensor-model-parallel-size \(2\)"),
        ("--use-flash-attn", 1, r"--use-flash-attn asks for the flash-attention kernel.*--attention-backend auto"),
        ("--squared-relu --swiglu", 1, r"--squared-relu and --swiglu are exclusive"),
        ("--rotary-percent 0", 1, r"--rotary-percent must be in \(0, 1\]"),
        ("--use-rope-scaling", 1, r"^--use-rope-scaling scales rotary position embeddings: it needs "
         r"--position-embedding-type rope \(got learned_absolute\); add that or drop --use-rope-scaling$"),
        ("--position-embedding-type rope --use-rope-scaling --rope-scaling-factor 0", 1,
         r"^--rope-scaling-factor must be positive, got 0.0$"),
        ("--position-embedding-type rope --rope-scaling-factor -8", 1, r"^--rope-scaling-factor must be positive, "
         r"got -8.0$"),
        ("--multi-latent-attention --position-embedding-type rope --use-rope-scaling", 1,
         r"^--use-rope-scaling scales the RoPE of ordinary attention; --multi-latent-attention has its own rotary "
         r"embedding \(--rope-type\), which it would not change: drop --use-rope-scaling$"),
        ("--start-weight-decay 0.1", 1,
         r"--start-weight-decay \(0.1\) differs from --weight-decay \(0.01\) with --weight-decay-incr-style constant"),
        ("--weight-decay-incr-style linear --end-weight-decay 0.1", 1,
         r"--weight-decay-incr-style linear needs --start-weight-decay and --end-weight-decay"),
        ("--weight-decay-incr-style cosine --start-weight-decay 0.2 --end-weight-decay 0.1", 1,
         r"--start-weight-decay \(0.2\) must not exceed --end-weight-decay \(0.1\)"),
        ("--manual-gc-interval 5", 1, r"--manual-gc-interval needs --manual-gc"),
        ("--manual-gc --manual-gc-interval -1", 1, r"--manual-gc-interval must be >= 0"),
        ("--no-position-embedding", 1, r"^--no-position-embedding asks for a model without a learned position table, "
         r"but --position-embedding-type is learned_absolute, .*add --position-embedding-type rope"),
        ("--tokenizer-type GPT2BPETokeniser", 1, r"^--tokenizer-type GPT2BPETokeniser is not one of NullTokenizer, "
         r"ByteLevelTokenizer, HuggingFaceTokenizer, GPT2BPETokenizer, TikTokenizer, SFTTokenizer, "
         r"SentencePieceTokenizer, GPTSentencePieceTokenizer, Llama2Tokenizer$"),
        ("--tokenizer-type GPTSentencePieceTokenizer", 1, r"^--tokenizer-type GPTSentencePieceTokenizer needs "
         r"--tokenizer-model \(the SentencePiece .model file\)$"),
        ("--weight-decay -0.1", 1, r"^--weight-decay must be >= 0, got -0.1$"),
        ("--lr -1 --min-lr -2", 1, r"^--lr must be >= 0, got -1.0$"),
        ("--min-lr=-1e-5", 1, r"^--min-lr must be >= 0, got -1e-05$"),
        ("--adam-beta2 1.0", 1, r"^--adam-beta2 must be in \[0, 1\), got 1.0$"),
        ("--optimizer sgd --sgd-momentum -0.5", 1, r"^--sgd-momentum must be in \[0, 1\), got -0.5$"),
        ("--adam-eps 0", 1, r"^--adam-eps must be positive, got 0.0$"),
        ("--seed 0", 1, r"^--seed must be a positive integer \(as upstream\), got 0$"),
        ("--seed -5", 1, r"^--seed must be a positive integer \(as upstream\), got -5$"),
        ("--fp16 --loss-scale 0", 1, r"^--loss-scale is a static loss scale and must be positive, got 0.0; leave it "
         r"out for dynamic loss scaling$"),
        ("--fp16 --min-loss-scale 8 --initial-loss-scale 4", 1,
         r"^need 0 < --min-loss-scale \(8.0\) <= --initial-loss-scale \(4.0\)$"),
        ("--fp16 --min-loss-scale 0", 1, r"^need 0 < --min-loss-scale \(0.0\)"),
        ("--fp16 --loss-scale-window 0", 1, r"^--loss-scale-window must be at least 1, got 0$"),
        ("--fp16 --hysteresis 0", 1, r"^--hysteresis must be at least 1, got 0$"),
        ("--kv-channels 0", 1, r"^--kv-channels must be positive, got 0; drop it for the default derived from "
         r"--hidden-size$"),
        ("--ffn-hidden-size -4", 1, r"^--ffn-hidden-size must be positive, got -4; drop it"),
        ("--hidden-size 16 --swiglu", 1, r"^--swiglu's default --ffn-hidden-size \(2/3 of 4 x --hidden-size, "
         r"rounded down to a multiple of 64\) is 0 for --hidden-size 16: pass --ffn-hidden-size$"),
        ("--tensor-model-parallel-size 2 --sequence-parallel --seq-length 33 --max-position-embeddings 40", 2,
         r"^--seq-length \(33\) must be divisible by --tensor-model-parallel-size \(2\) with --sequence-parallel: "
         r"each tensor-parallel rank holds an equal slice of the sequence"),
    ],
)
def test_rule_violations_name_the_flags(monkeypatch, extra, world_size, message):
    with pytest.raises(ValueError, match=message):
        validated(extra, world_size, monkeypatch)


@pytest.mark.parametrize("flag", ["--save", "--load"])
def test_checkpoint_directory_flags_refuse_a_file(tmp_path, flag):
    path = tmp_path / "model_optim_rng.pt"
    path.write_bytes(b"")
    with pytest.raises(ValueError, match=rf"^{flag} {path} is a file, not a directory: {flag} takes the "):
        validated(f"{flag} {path}")
    assert validated(f"{flag} {tmp_path}").save == (str(tmp_path) if flag == "--save" else None)


def test_required_flags_are_named():
    with pytest.raises(ValueError, match="--num-layers is required"):
        validate_args(parse_args(args="--hidden-size 8 --num-attention-heads 2 --seq-length 4".split()))
    with pytest.raises(ValueError, match="--tokenizer-type NullTokenizer needs --vocab-size"):
        validate_args(parse_args(args=BASE.replace("--vocab-size 128", "").split()))
    with pytest.raises(ValueError, match="give --data-path PREFIX"):
        validate_args(parse_args(args=BASE.replace("--mock-data", "").split()))


def test_unknown_flags_are_an_argparse_error(capsys):
    with pytest.raises(SystemExit):
        parse_args(args=(BASE + " --no-such-flag 3").split())
    error = capsys.readouterr().err
    assert "unrecognized arguments: --no-such-flag 3" in error and "docs/training_flags.md" in error
    known = parse_args(args=(BASE + " --no-such-flag 3").split(), ignore_unknown_args=True)
    assert known.num_layers == 2


@pytest.mark.parametrize("flag, script", [("--export-kd-teacher-load /ckpt", "examples/post_training/distill.py"),
                                          ("--export-quant-cfg fp8", "examples/post_training/quantize.py")])
def test_upstream_flags_of_another_script_name_that_script(capsys, flag, script):
    """Upstream's pretrain_gpt.py distils and quantizes with these flags; here other scripts do."""
    with pytest.raises(SystemExit):
        parse_args(args=(BASE + " " + flag).split())
    error = capsys.readouterr().err
    assert f"{flag.split()[0]} is a flag of {script}: run that script with the same flags instead" in error


def test_abbreviations_are_not_accepted():
    with pytest.raises(SystemExit):
        parse_args(args=(BASE + " --tensor-model 2").split())


def test_extra_args_provider_adds_flags():
    def provider(parser):
        parser.add_argument("--my-flag", type=int, default=7)
        return parser

    assert parse_args(provider, args=(BASE + " --my-flag 9").split()).my_flag == 9


@pytest.mark.parametrize(
    "extra, flag",
    [
        ("--fp4-format e2m1", "--fp4-format"),
    ],
)
def test_declared_but_unfinished_features_fail_clearly(extra, flag):
    with pytest.raises(ValueError, match=f"^{flag} is not supported: .*drop {flag}.* --fp8-format"):
        validated(extra)


def test_megatron_fsdp_turns_on_distributed_optimizer_and_overlaps():
    args = parse_args(args=(BASE + " --use-megatron-fsdp").split())
    from megatron.training.argument_groups import data_parallel

    args.data_parallel_size, args.context_parallel_size = 2, 1
    data_parallel.validate(args)
    assert args.use_distributed_optimizer and args.overlap_grad_reduce and args.overlap_param_gather


def test_use_custom_fsdp_is_the_deprecated_name_of_use_megatron_fsdp(capsys):
    args = validated("--use-custom-fsdp --bf16 --grad-reduce-in-bf16")
    assert args.use_megatron_fsdp and args.use_distributed_optimizer
    # validated as --use-megatron-fsdp from the first rule on: its gradient communication follows the bf16 opt-out
    assert args.megatron_fsdp_grad_comm_dtype == "bf16"
    assert "--use-custom-fsdp is deprecated; use --use-megatron-fsdp" in capsys.readouterr().out


def test_fsdp_rejects_serialised_cuda_connections(monkeypatch):
    from megatron.training.argument_groups import data_parallel

    monkeypatch.setattr(data_parallel, "_cuda_visible", lambda: True)
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    args = parse_args(args=(BASE + " --use-megatron-fsdp").split())
    args.data_parallel_size, args.context_parallel_size = 2, 1
    with pytest.raises(ValueError, match="CUDA_DEVICE_MAX_CONNECTIONS=1"):
        data_parallel.validate(args)


def test_sequence_parallel_is_dropped_without_tensor_parallelism():
    with pytest.warns(UserWarning, match="--sequence-parallel has no effect"):
        args = validated("--sequence-parallel")
    assert args.sequence_parallel is False


def test_sharding_strategy_without_megatron_fsdp_warns():
    with pytest.warns(UserWarning, match="^--data-parallel-sharding-strategy optim_grads has no effect without "
                                         "--use-megatron-fsdp"):
        args = validated("--data-parallel-sharding-strategy optim_grads --use-distributed-optimizer")
    assert args.use_megatron_fsdp is False and args.data_parallel_sharding_strategy == "optim_grads"
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="--data-parallel-sharding-strategy")
        assert validated("--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads").use_megatron_fsdp
        assert validated().data_parallel_sharding_strategy == "optim_grads_params"  # the default: no warning


# An upstream Megatron-FSDP / FSDP2 functional-test configuration, flags as upstream's scripts pass them.
UPSTREAM_FSDP2_SCRIPT = (
    "--use-mcore-models --transformer-impl local --use-torch-fsdp2 --untie-embeddings-and-output-weights "
    "--no-gradient-accumulation-fusion --deterministic-mode --attention-softmax-in-fp32 --attention-backend unfused "
    "--ckpt-format torch_dist --data-cache-path /tmp/cache --lr-warmup-fraction 0.25 --lr-decay-iters 8 "
    "--log-params-norm --log-num-zeros-in-grad --log-timers-to-tensorboard --log-validation-ppl-to-tensorboard "
    "--timing-log-level 0 --log-memory-to-tensorboard --use-checkpoint-opt_param-scheduler "
    "--dist-ckpt-strictness log_all --ckpt-fully-parallel-load "
    "--ckpt-assume-constant-structure --no-ckpt-fully-parallel-save --no-persist-layer-norm --no-rope-fusion "
    "--no-bias-swiglu-fusion --no-bias-gelu-fusion --no-bias-dropout-fusion --no-masked-softmax-fusion"
)
ACCEPTED_FOR_UPSTREAM_SCRIPTS = (
    "--use-mcore-models", "--attention-softmax-in-fp32",
    "--no-persist-layer-norm", "--no-rope-fusion",
    "--no-bias-swiglu-fusion", "--no-bias-gelu-fusion", "--no-bias-dropout-fusion", "--no-masked-softmax-fusion",
    "--no-one-logger", "--enable-one-logger", "--one-logger-project", "--one-logger-run-name", "--one-logger-async",
    "--app-tag-run-name", "--app-tag-run-version", "--config-logger-dir", "--legacy-tokenizer", "--onnx-safe",
    "--disable-tp-comm-overlap-ag", "--disable-tp-comm-overlap-rs", "--tp-comm-overlap-rs-dgrad",
    "--disable-tp-comm-bulk-dgrad", "--disable-tp-comm-bulk-wgrad", "--disable-tp-comm-split-ag",
    "--disable-tp-comm-split-rs",
)


def test_upstream_fsdp_scripts_parse_and_validate(monkeypatch):
    args = validated(UPSTREAM_FSDP2_SCRIPT, 2, monkeypatch)
    assert args.use_torch_fsdp2 and args.torch_fsdp2_reshard_after_forward
    assert args.gradient_accumulation_fusion is False and args.deterministic_mode
    assert args.lr_warmup_iters == 0.25 * 8  # a fraction of --lr-decay-iters
    assert args.use_checkpoint_opt_param_scheduler and not args.override_opt_param_scheduler
    assert args.dist_ckpt_strictness == "log_all" and args.ckpt_fully_parallel_save is False
    assert args.log_params_norm and args.timing_log_level == 0 and args.transformer_impl == "local"
    assert validated("--ckpt-format fsdp_dtensor").ckpt_format == "fsdp_dtensor"
    assert validated("--torch-fsdp2-no-reshard-after-forward").torch_fsdp2_reshard_after_forward is False


# Flags of a Llama-style upstream script (grouped-query attention, RoPE, RMSNorm, SwiGLU, no biases).
UPSTREAM_LLAMA_SCRIPT = (
    "--group-query-attention --num-query-groups 2 --swiglu --normalization RMSNorm --position-embedding-type rope "
    "--no-position-embedding --rotary-percent 0.5 --rotary-base 500000 --disable-bias-linear "
    "--untie-embeddings-and-output-weights "
    "--qk-layernorm --apply-layernorm-1p --manual-gc --manual-gc-interval 10 --no-manual-gc-eval "
    "--cross-entropy-loss-fusion --weight-decay-incr-style linear --start-weight-decay 0.01 --end-weight-decay 0.1"
)


def test_upstream_llama_script_flags_reach_the_model_config(monkeypatch):
    from megatron.training.model_config import core_transformer_config_from_args

    args = validated(UPSTREAM_LLAMA_SCRIPT, 2, monkeypatch)
    config = core_transformer_config_from_args(args)
    assert (config.num_attention_heads, config.num_query_groups) == (4, 2)
    assert config.qk_layernorm and config.layernorm_zero_centered_gamma and config.gated_linear_unit
    assert (args.rotary_percent, args.rotary_base, args.position_embedding_type) == (0.5, 500000, "rope")
    assert args.add_position_embedding is False
    assert (args.manual_gc, args.manual_gc_interval, args.manual_gc_eval) == (True, 10, False)
    assert (args.start_weight_decay, args.end_weight_decay, args.weight_decay_incr_style) == (0.01, 0.1, "linear")
    # Without --group-query-attention every head has its own key and value (the upstream default).
    with pytest.warns(UserWarning, match="^--num-query-groups 2 has no effect without --group-query-attention: "
                      "every one of the 4 attention heads gets its own key/value head"):
        args = validated("--num-query-groups 2")
    assert core_transformer_config_from_args(args).num_query_groups == 4
    assert validated("--use-rotary-position-embeddings").position_embedding_type == "rope"
    older_spelling = validated("--use-rotary-position-embeddings --no-position-embedding")
    assert (older_spelling.position_embedding_type, older_spelling.add_position_embedding) == ("rope", False)
    plain = validated()
    assert (plain.start_weight_decay, plain.end_weight_decay) == (0.01, 0.01)


def test_llama31_rope_scaling_flags():
    plain = validated("--position-embedding-type rope")
    assert (plain.use_rope_scaling, plain.rope_scaling_factor) == (False, 8.0)  # upstream's defaults
    llama32 = validated("--position-embedding-type rope --use-rope-scaling --rope-scaling-factor 32")
    assert (llama32.use_rope_scaling, llama32.rope_scaling_factor) == (True, 32.0)
    assert validated("--position-embedding-type rope --use-rope-scaling").rope_scaling_factor == 8.0
    with pytest.warns(UserWarning, match="^--rope-scaling-factor 32.0 has no effect without --use-rope-scaling"):
        assert not validated("--position-embedding-type rope --rope-scaling-factor 32").use_rope_scaling


def test_squared_relu_sets_the_activation():
    from megatron.core.activations import squared_relu
    from megatron.training.model_config import core_transformer_config_from_args

    assert core_transformer_config_from_args(validated("--squared-relu")).activation_func is squared_relu


def test_flags_accepted_for_upstream_scripts_say_what_they_do():
    from megatron.training.arguments import build_parser

    helps = {flag: action.help for action in build_parser()._actions for flag in action.option_strings}
    for flag in ACCEPTED_FOR_UPSTREAM_SCRIPTS:
        assert helps[flag].startswith("Accepted for upstream scripts: "), flag
        assert len(helps[flag]) > len("Accepted for upstream scripts: ") + 20, flag


def test_transformer_engine_impl_without_transformer_engine_names_local(monkeypatch):
    from megatron.core import optional_deps

    monkeypatch.setitem(optional_deps._GUARDS, "HAVE_TE", lambda: False)  # as on a machine without it
    with pytest.raises(ValueError, match="--transformer-impl transformer_engine needs transformer-engine.*"
                                         "use --transformer-impl local"):
        validated("--transformer-impl transformer_engine")


def test_deterministic_mode_turns_on_deterministic_algorithms(monkeypatch):
    import torch

    from megatron.training import initialize

    calls = []
    monkeypatch.setattr(torch, "use_deterministic_algorithms", lambda mode: calls.append(mode))
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    initialize.set_deterministic_mode()
    assert calls == [True]
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"


def test_weight_decay_schedule_flags_drive_the_scheduler():
    import torch

    from megatron.training.model_setup import build_scheduler

    args = validated("--weight-decay-incr-style linear --start-weight-decay 0.02 --end-weight-decay 0.1")
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=1.0)
    scheduler = build_scheduler(optimizer, args)
    weight_decays = [optimizer.param_groups[0]["weight_decay"]]
    for _ in range(args.train_iters):
        scheduler.step(increment=args.global_batch_size)
        weight_decays.append(optimizer.param_groups[0]["weight_decay"])
    # Linear from 0.02 at iteration 0 to 0.1 at --train-iters (10).
    assert weight_decays == pytest.approx([0.02 + 0.008 * i for i in range(11)], abs=1e-12)


def test_fp16_with_dynamic_loss_scaling_leaves_overflows_to_the_loss_scaler():
    with pytest.warns(UserWarning, match="dynamic loss scaling"):
        args = validated("--fp16")
    assert args.check_for_nan_in_loss_and_grad is False
    assert validated("--fp16 --loss-scale 1024").check_for_nan_in_loss_and_grad is True  # static: still checked
    assert validated("--bf16").check_for_nan_in_loss_and_grad is True
    assert validated("").check_for_nan_in_loss_and_grad is True


def test_nan_check_flag_can_be_spelled_out_and_turned_off():
    assert validated("--check-for-nan-in-loss-and-grad").check_for_nan_in_loss_and_grad is True
    assert validated("--no-check-for-nan-in-loss-and-grad").check_for_nan_in_loss_and_grad is False
    # The last of the two wins, as argparse does for any pair of flags sharing a destination.
    assert validated("--check-for-nan-in-loss-and-grad --no-check-for-nan-in-loss-and-grad")\
        .check_for_nan_in_loss_and_grad is False
