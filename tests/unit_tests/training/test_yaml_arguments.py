"""`--yaml-cfg`: a file in upstream's layout parses into the namespace of the command line it stands for (every
field, before and after validation), flags given with it win and are reported, a faulty file stops with one error
naming it and each offending key, and the shipped example trains on the losses of its command line."""

import os
from unittest import mock

import pytest

from megatron.training.arguments import parse_args, validate_args
from tests.unit_tests.corpus_data import REPO_ROOT, write_corpus_prefix
from tests.unit_tests.dist_checkpointing.pretrain_helpers import pretrain_records
from tests.unit_tests.multiprocess_harness import run_on_ranks

EXAMPLE = os.path.join(REPO_ROOT, "examples", "gpt3", "gpt_config.yaml")

# examples/gpt/train_gpt_tiny_cpu.sh's command (Megatron-FSDP ZeRO-3), with the example's output paths.
EXAMPLE_COMMAND_LINE = (
    "--num-layers 4 --hidden-size 128 --num-attention-heads 4 --seq-length 128 --max-position-embeddings 128 "
    "--position-embedding-type rope --normalization RMSNorm --swiglu --hidden-dropout 0.0 --attention-dropout 0.0 "
    "--make-vocab-size-divisible-by 64 --micro-batch-size 8 --global-batch-size 16 --train-iters 200 --lr 3e-3 "
    "--min-lr 3e-4 --lr-decay-style cosine --lr-warmup-iters 20 --weight-decay 0.1 --clip-grad 1.0 --seed 1234 "
    "--tensor-model-parallel-size 1 --pipeline-model-parallel-size 1 --distributed-backend gloo "
    "--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params "
    "--data-path runs/tiny_gpt/stdlib_docs_text_document --split 98,2,0 --tokenizer-type ByteLevelTokenizer "
    "--data-cache-path runs/tiny_gpt/index_cache --num-workers 0 --log-interval 10 --log-throughput "
    "--eval-interval 100 --eval-iters 4 --tensorboard-dir runs/tiny_gpt/yaml_run/tensorboard "
    "--metrics-file runs/tiny_gpt/yaml_run/metrics.jsonl --save runs/tiny_gpt/yaml_run/checkpoints "
    "--save-interval 100 --ckpt-format torch_dist"
)

# Every kind of key: renamed, negated and combined fields, switches both ways, nargs lists, a custom action,
# ${VAR}, nulls (also of keys this build does not have) and accepted no-ops.
CONFIG = """
language_model:
  num_layers: 2
  hidden_size: 64
  num_attention_heads: 4
  num_query_groups: 2
  layernorm_epsilon: 1.e-6
  layernorm_zero_centered_gamma: true
  add_bias_linear: false
  activation_func: swiglu
  gated_linear_unit: false
  masked_softmax_fusion: false
  bias_dropout_fusion: true
  memory_efficient_layer_norm: true
  init_method_std: ${INIT_STD}
  recompute_granularity: full
  recompute_method: uniform
  recompute_num_layers: 1
  fp8: null
  output_layer_init_method: null
model_parallel:
  tensor_model_parallel_size: 1
  sequence_parallel: false
  params_dtype: fp32
  gradient_accumulation_fusion: false
  timers: null
  grad_scale_func: null
  batch_p2p_comm: true
seq_length: 32
max_position_embeddings: 32
position_embedding_type: rope
untie_embeddings_and_output_weights: true
group_query_attention: false
swiglu: false
micro_batch_size: 2
global_batch_size: 4
train_iters: 10
lr: 1e-3
lr_decay_style: cosine
weight_decay: 0.1
adam_beta2: 0.95
data_path:
  - 0.3
  - ${DATA_DIR}/a_text_document
  - 0.7
  - "${DATA_DIR}/b_text_document"
split: 98,2,0
tokenizer_type: NullTokenizer
vocab_size: 128
use_megatron_fsdp: true
data_parallel_sharding_strategy: optim_grads
check_for_nan_in_loss_and_grad: false
log_loss_scale_to_tensorboard: true
profile_ranks: [0]
bert_binary_head: true
onnx_safe: null
sample_rate: 1.0
adlr_autoresume: false
encoder_num_layers: null
"""

COMMAND_LINE = (
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --group-query-attention --num-query-groups 2 "
    "--norm-epsilon 1e-6 "
    "--apply-layernorm-1p --disable-bias-linear --swiglu --no-masked-softmax-fusion --init-method-std 0.01 "
    "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1 "
    "--tensor-model-parallel-size 1 --no-gradient-accumulation-fusion --seq-length 32 --max-position-embeddings 32 "
    "--position-embedding-type rope --untie-embeddings-and-output-weights --micro-batch-size 2 "
    "--global-batch-size 4 --train-iters 10 --lr 1e-3 --lr-decay-style cosine --weight-decay 0.1 --adam-beta2 0.95 "
    "--data-path 0.3 /data/a_text_document 0.7 /data/b_text_document --split 98,2,0 --tokenizer-type NullTokenizer "
    "--vocab-size 128 --use-megatron-fsdp --data-parallel-sharding-strategy optim_grads "
    "--no-check-for-nan-in-loss-and-grad"
)
ENVIRONMENT = {"INIT_STD": "0.01", "DATA_DIR": "/data", "WORLD_SIZE": "1", "RANK": "0"}


def _write(tmp_path, text, name="run.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def _fields(argv, validate=False):
    """Every field of the namespace `argv` parses into (validated as pretrain_gpt.py does when asked), without
    --yaml-cfg's own."""
    with mock.patch.dict(os.environ, ENVIRONMENT):
        args = parse_args(args=argv)
        if validate:
            validate_args(args)
    fields = vars(args)
    fields.pop("yaml_cfg")
    return fields


def _launch_error(argv, capsys, environment=ENVIRONMENT):
    with mock.patch.dict(os.environ, environment), pytest.raises(SystemExit) as stop:
        parse_args(args=argv)
    assert stop.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("validate", [False, True])
def test_file_gives_the_namespace_of_its_command_line(tmp_path, validate):
    path = _write(tmp_path, CONFIG)
    assert _fields(["--yaml-cfg", path], validate) == _fields(COMMAND_LINE.split(), validate)
    assert _fields([f"--yaml-cfg={path}"], validate) == _fields(COMMAND_LINE.split(), validate)


def test_command_line_overrides_the_file_and_rank_0_says_which_keys(tmp_path, capsys):
    path = _write(tmp_path, CONFIG)
    overrides = ["--num-layers", "4", "--lr", "2e-3"]
    given = _fields(["--yaml-cfg", path, *overrides, "--no-bias-dropout-fusion"])
    assert given == _fields(COMMAND_LINE.split() + overrides + ["--no-bias-dropout-fusion"])
    assert given["num_layers"] == 4 and given["lr"] == 2e-3 and given["no_bias_dropout_fusion"]
    assert capsys.readouterr().out == (f"--yaml-cfg {path}: the command line overrides lr (--lr), "
                                       "language_model.num_layers (--num-layers), language_model.bias_dropout_fusion "
                                       "(--no-bias-dropout-fusion)\n")
    with mock.patch.dict(os.environ, {**ENVIRONMENT, "RANK": "1"}):
        parse_args(args=["--yaml-cfg", path, "--lr", "2e-3"])
    assert capsys.readouterr().out == ""


def test_unknown_keys_stop_in_one_error_with_the_closest_keys(tmp_path, capsys):
    path = _write(tmp_path, CONFIG + "seq_lenght: 32\nfrobnicate: 3\nlanguage_model_typo: {}\n"
                  + "no_such_key: null\n")
    error = _launch_error(["--yaml-cfg", path], capsys)
    section_typo = CONFIG.replace("  num_layers: 2\n", "  num_layers: 2\n  hiden_size: 64\n  rotary_base: 10000\n"
                                  "  grad_sync_func: hook\n")
    error += _launch_error(["--yaml-cfg", _write(tmp_path, section_typo, "sections.yaml")], capsys)
    assert f"--yaml-cfg {path}:\n  keys this build does not take: seq_lenght (did you mean seq_length?), " \
           "frobnicate, language_model_typo (did you mean language_model?) (drop them, or set them to null" in error
    assert "language_model.hiden_size (did you mean language_model.hidden_size?), " \
           "language_model.grad_sync_func (drop them" in error
    assert "no_such_key" not in error and "rotary_base" not in error  # null, and a flag's destination
    assert error.count("usage:") == 2  # one error a launch


@pytest.mark.parametrize("change, message", [
    (("  num_layers: 2\n", "  num_layers: two\n"),
     "language_model.num_layers: argument --num-layers: invalid int value: 'two'"),
    (("position_embedding_type: rope\n", "position_embedding_type: alibi\n"),
     "position_embedding_type: argument --position-embedding-type: invalid choice: 'alibi'"),
    (("lr: 1e-3\n", "lr: [1e-3, 2e-3]\n"), "lr: --lr takes one value, not a list"),
    (("use_megatron_fsdp: true\n", "use_megatron_fsdp: maybe\n"),
     "use_megatron_fsdp: --use-megatron-fsdp is a switch: the value must be true or false, got 'maybe'"),
    (("  params_dtype: fp32\n", "  params_dtype: bf16\n  bf16: false\n"),
     "model_parallel.params_dtype and model_parallel.bf16 disagree: they set bf16 to True and False"),
])
def test_wrong_values_stop_naming_the_key(tmp_path, capsys, change, message):
    error = _launch_error(["--yaml-cfg", _write(tmp_path, CONFIG.replace(*change))], capsys)
    assert message in error


def test_config_fields_win_over_top_level_defaults_only(tmp_path, capsys):
    """Upstream's files list every top-level key: one at its default yields to the config field that sets its
    destination (CONFIG: `swiglu: false` beside `activation_func: swiglu`), one set otherwise disagrees."""
    gelu = CONFIG.replace("  activation_func: swiglu\n", "  activation_func: gelu\n").replace(
        "\nswiglu: false\n", "\nswiglu: true\n")
    error = _launch_error(["--yaml-cfg", _write(tmp_path, gelu)], capsys)
    assert "swiglu and language_model.activation_func disagree: they set swiglu to True and False" in error


def test_unset_environment_variable_stops_naming_it_and_the_key(tmp_path, capsys):
    environment = {key: value for key, value in ENVIRONMENT.items() if key != "DATA_DIR"}
    with mock.patch.dict(os.environ):
        os.environ.pop("DATA_DIR", None)
        error = _launch_error(["--yaml-cfg", _write(tmp_path, CONFIG)], capsys, environment)
    assert "environment variables that are not set: DATA_DIR (in data_path), DATA_DIR (in data_path)" in error


@pytest.mark.parametrize("validate", [False, True])
def test_shipped_example_is_the_readme_command(validate):
    example = _fields(["--yaml-cfg", EXAMPLE], validate)
    assert example == _fields(EXAMPLE_COMMAND_LINE.split(), validate)


def _example_losses(workdir, prefix):
    """Losses of 4 iterations of the example's run (and of its command line) on the first documents of the
    bundled corpus, each written to its own directory."""
    def overrides(name):
        return (f"--train-iters 4 --lr-warmup-iters 1 --log-interval 1 --eval-iters 0 --data-path {prefix} "
                f"--data-cache-path {workdir}/cache_{name} --save {workdir}/{name}/checkpoints "
                f"--tensorboard-dir {workdir}/{name}/tensorboard")

    from_file = pretrain_records(f"{workdir}/yaml", f"--yaml-cfg {EXAMPLE} {overrides('yaml')}")
    from_flags = pretrain_records(f"{workdir}/flags", f"{EXAMPLE_COMMAND_LINE} {overrides('flags')}")
    return [[record["lm loss"] for record in records] for records in (from_file, from_flags)]


def test_shipped_example_trains_on_the_losses_of_its_command_line(tmp_path):
    prefix = write_corpus_prefix(tmp_path, 200)
    from_file, from_flags = run_on_ranks(2, _example_losses, str(tmp_path), prefix)[0]
    assert len(from_file) == 4
    assert from_file == from_flags
