"""Upstream Megatron-LM flags pasted from launch scripts: the ones implemented here (Xavier init, the gpt-oss GLU
clamp and offset, DDP bucket padding, the --encoder-* aliases) with their values, and the others parsing as
documented no-ops, stopping with upstream's messages (removed flags), or naming the flag and saying what to do."""

import dataclasses
import math
from functools import partial

import pytest
import torch

from megatron.training.arguments import parse_args
from megatron.training.model_config import core_transformer_config_from_args, ddp_config_from_args
from tests.unit_tests.training import argument_checks

BASE = f"{argument_checks.BASE} --train-iters 4"
validated = partial(argument_checks.validated, base=BASE)


def test_encoder_aliases_set_num_layers_and_seq_length():
    args = validated("--encoder-num-layers 3 --encoder-seq-length 48",
                     base=BASE.replace("--num-layers 2 ", "").replace("--seq-length 32 ", ""))
    assert (args.num_layers, args.seq_length, args.max_position_embeddings) == (3, 48, 48)
    assert (args.encoder_num_layers, args.encoder_seq_length) == (3, 48)
    args = validated("")
    assert (args.encoder_num_layers, args.encoder_seq_length) == (2, 32)
    assert validated("--encoder-seq-length 32").seq_length == 32  # the same value twice is no conflict
    with pytest.raises(ValueError, match="--encoder-seq-length 16 and --seq-length 32 set the same value"):
        validated("--encoder-seq-length 16")
    with pytest.raises(ValueError, match="--encoder-num-layers 4 and --num-layers 2 set the same value"):
        validated("--encoder-num-layers 4")


@pytest.mark.parametrize("extra, message", [
    ("--batch-size 4", "--batch-size argument is no longer valid, use --micro-batch-size instead"),
    ("--warmup 10", "--warmup argument is no longer valid, use --lr-warmup-fraction instead"),
    ("--model-parallel-size 2", "--model-parallel-size is no longer valid, use --tensor-model-parallel-size instead"),
])
def test_removed_flags_stop_with_upstreams_messages(extra, message):
    with pytest.raises(ValueError) as error:
        validated(extra)
    assert str(error.value) == message


NO_OP_FLAGS = ("--no-one-logger --one-logger-project p --one-logger-run-name r --one-logger-async "
               "--app-tag-run-name a --app-tag-run-version 1.0 --legacy-tokenizer --onnx-safe True "
               "--lazy-mpu-init False --disable-tp-comm-overlap-ag --disable-tp-comm-overlap-rs "
               "--tp-comm-overlap-rs-dgrad --disable-tp-comm-bulk-dgrad --disable-tp-comm-bulk-wgrad "
               "--disable-tp-comm-split-ag --disable-tp-comm-split-rs")


def test_no_op_flags_parse_and_leave_the_model_and_wrapper_unchanged():
    plain, with_no_ops = validated(""), validated(NO_OP_FLAGS)
    assert (with_no_ops.enable_one_logger, with_no_ops.onnx_safe, with_no_ops.lazy_mpu_init) == (False, True, False)
    assert (with_no_ops.tp_comm_bulk_dgrad, with_no_ops.tp_comm_overlap_rs_dgrad) == (False, True)
    assert (plain.enable_one_logger, plain.tp_comm_bulk_dgrad, plain.app_tag_run_version) == (True, True, "0.0.0")
    assert validated("--enable-one-logger").enable_one_logger is True
    plain_config, no_op_config = (dataclasses.asdict(core_transformer_config_from_args(args))
                                  for args in (plain, with_no_ops))
    plain_config.pop("timers", None)
    no_op_config.pop("timers", None)
    assert no_op_config == plain_config
    assert ddp_config_from_args(with_no_ops) == ddp_config_from_args(plain)


@pytest.mark.parametrize("extra, message", [
    ("--async-tensor-model-parallel-allreduce", "--async-tensor-model-parallel-allreduce is deprecated upstream"),
    ("--no-async-tensor-model-parallel-allreduce", "--no-async-tensor-model-parallel-allreduce is deprecated"),
    ("--config-logger-dir /nonexistent/cfg", "nothing is written there"),
    ("--replication-factor 3", "no effect without --replication"),
])
def test_ignored_flags_warn(extra, message):
    with pytest.warns(UserWarning, match=message):
        validated(extra)


def test_boolean_flags_read_their_value(capsys):
    assert validated("--onnx-safe false").onnx_safe is False
    with pytest.raises(SystemExit):
        parse_args(args=f"{BASE} --lazy-mpu-init maybe".split())
    assert "argument --lazy-mpu-init: invalid boolean value: 'maybe'" in capsys.readouterr().err


@pytest.mark.parametrize("extra, what_to_do", [
    ("--lazy-mpu-init True", "pretrain_gpt.py sets up its process groups on its own: drop the flag"),
    ("--dist-ckpt-save-pre-mcore-014", "--dist-ckpt-save-pre-mcore-014 is not supported"),
    ("--replication", "--replication (copies of each rank's local checkpoint"),
    ("--export-te-mcore-model", "--export-te-mcore-model is not supported"),
])
def test_missing_features_stop_naming_the_flag(extra, what_to_do):
    with pytest.raises(ValueError, match=what_to_do.replace("(", r"\(")):
        validated(extra)


@pytest.mark.parametrize("extra", [
    "--decoder-seq-length 16", "--bert-no-binary-head", "--output-bert-embeddings", "--embedding-path /e",
    "--retro-project-dir /r",
    "--tokenizer-prompt-format llama3",
])
def test_other_model_families_stop_naming_the_flag(extra):
    flag = extra.split()[0]
    with pytest.raises(ValueError) as error:
        validated(extra)
    message = str(error.value)
    assert message.startswith(f"{flag} belongs to ")
    assert "this project trains GPT models with pretrain_gpt.py" in message and message.endswith(f"drop {flag}")


@pytest.mark.parametrize("extra, instead", [
    ("--inference-batch-times-seqlen-threshold 512", "--inference-max-requests"),
    ("--max-tokens-to-oom 100", "--inference-max-seq-length"),
])
def test_upstream_server_tuning_stops_naming_what_the_server_does_instead(extra, instead):
    flag = extra.split()[0]
    with pytest.raises(ValueError) as error:
        validated(extra)
    message = str(error.value)
    assert message.startswith(f"{flag} tunes upstream's text-generation server; tools/run_text_generation_server.py")
    assert instead in message and message.endswith(f"drop {flag}")


def test_xavier_uniform_init_draws_every_weight_matrix_from_its_bound():
    from megatron.core.models.gpt import GPTModel

    args = validated("--swiglu --untie-embeddings-and-output-weights --init-method-xavier-uniform")
    model = GPTModel(core_transformer_config_from_args(args), vocab_size=128, max_sequence_length=32,
                     share_embeddings_and_output_weights=False)
    matrices = {name: weight for name, weight in model.named_parameters() if weight.dim() == 2}
    assert len(matrices) == 3 + 4 * args.num_layers  # embeddings, output layer, qkv/proj/fc1/fc2 per layer
    for name, weight in matrices.items():
        fan_out, fan_in = weight.shape
        bound = math.sqrt(6.0 / (fan_in + fan_out))
        # U(-a, a): |w| <= a, reaching close to it, with std a / sqrt(3) (not depth-scaled for proj / fc2).
        assert weight.abs().max().item() <= bound, name
        assert weight.abs().max().item() > 0.98 * bound, name
        assert weight.std().item() == pytest.approx(bound / math.sqrt(3.0), rel=0.05), name
    default = GPTModel(core_transformer_config_from_args(validated("--swiglu")), vocab_size=128,
                       max_sequence_length=32, share_embeddings_and_output_weights=True)
    qkv = default.decoder.layers[0].self_attention.linear_qkv.weight
    assert qkv.std().item() == pytest.approx(0.02, rel=0.05)  # without the flag: normal(0, --init-method-std)


def _glu_reference(x, fc1, fc2, clamp_value, offset):
    hidden = x @ fc1.t()
    gate, up = hidden[..., 0::2], hidden[..., 1::2]  # fc1's rows interleave gate and up per unit
    gate = torch.minimum(gate, torch.tensor(clamp_value))
    up = torch.maximum(torch.minimum(up, torch.tensor(clamp_value)), torch.tensor(-clamp_value))
    return (gate * torch.sigmoid(gate) * (up + offset)) @ fc2.t()


def test_glu_clamp_and_offset_match_a_hand_written_mlp():
    from megatron.core.transformer.mlp import MLP
    from megatron.core.transformer.moe.experts import _activate

    args = validated("--swiglu --activation-func-clamp-value 0.5 --glu-linear-offset 1 --disable-bias-linear")
    config = core_transformer_config_from_args(args)
    assert (config.activation_func_clamp_value, config.glu_linear_offset) == (0.5, 1.0)
    mlp = MLP(config)
    with torch.no_grad():
        mlp.linear_fc1.weight.normal_(std=0.5)
        mlp.linear_fc2.weight.normal_(std=0.5)
    x = torch.randn(3, 2, 64)
    fc1, fc2 = mlp.linear_fc1.weight.detach(), mlp.linear_fc2.weight.detach()
    expected = _glu_reference(x, fc1, fc2, clamp_value=0.5, offset=1.0)
    output, bias = mlp(x)  # (output, None): --disable-bias-linear
    assert bias is None
    torch.testing.assert_close(output, expected, rtol=1e-5, atol=1e-5)
    hidden = x @ fc1.t()
    assert (hidden.abs() > 0.5).float().mean() > 0.5  # the clamp acts on most values
    unclamped = _glu_reference(x, fc1, fc2, clamp_value=1e9, offset=1.0)
    assert (unclamped - expected).abs().max() > 1.0
    # The experts' activation is the same function.
    torch.testing.assert_close(_activate(config, hidden) @ fc2.t(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("extra, message", [
    ("--activation-func-clamp-value 7", "--activation-func-clamp-value shapes the gated MLP"),
    ("--glu-linear-offset 1", "--glu-linear-offset shapes the gated MLP (act(gate) * up): it needs --swiglu"),
    ("--swiglu --activation-func-clamp-value 0", "--activation-func-clamp-value must be positive, got 0.0"),
])
def test_glu_flag_rules(extra, message):
    with pytest.raises(ValueError) as error:
        validated(extra)
    assert message in str(error.value)


def test_xavier_warns_that_init_method_std_is_unused():
    with pytest.warns(UserWarning, match="--init-method-std 0.01 has no effect with --init-method-xavier-uniform"):
        validated("--init-method-xavier-uniform --init-method-std 0.01")


def test_ddp_pad_buckets_for_high_nccl_busbw_pads_each_bucket():
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.model_parallel_config import ModelParallelConfig
    from tests.unit_tests.test_utilities import Utils

    assert ddp_config_from_args(validated("")).pad_buckets_for_high_nccl_busbw is False
    ddp_config = ddp_config_from_args(validated("--ddp-pad-buckets-for-high-nccl-busbw --use-distributed-optimizer"))
    assert ddp_config.pad_buckets_for_high_nccl_busbw is True
    Utils.initialize_model_parallel()
    try:
        model = torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.Linear(3, 2))  # 26 elements
        (buffer,) = DistributedDataParallel(ModelParallelConfig(), ddp_config, model).buffers
        multiple = math.lcm(Utils.world_size, 128, 2**16)  # upstream's divisor with the distributed optimizer
        assert [bucket.numel for bucket in buffer.buckets] == [multiple]
    finally:
        Utils.destroy_model_parallel()


def test_help_lists_the_upstream_flags(capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_args(args=["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--encoder-seq-length", "--init-method-xavier-uniform", "--ddp-pad-buckets-for-high-nccl-busbw",
                 "--no-one-logger", "--max-tokens-to-oom", "--glu-linear-offset"):
        assert flag in out


def test_kernel_and_gate_switches_leave_the_model_unchanged():
    moe = "--num-experts 2 --squared-relu"
    plain, given = validated(moe), validated(f"{moe} --use-te-activation-func --enable-experimental "
                                             "--use-fused-weighted-squared-relu")
    assert (given.use_te_activation_func, given.enable_experimental, given.use_fused_weighted_squared_relu) == (
        True, True, True)
    configs = [dataclasses.asdict(core_transformer_config_from_args(args)) for args in (plain, given)]
    for config in configs:
        config.pop("timers", None)
    assert configs[0] == configs[1]


@pytest.mark.parametrize("extra, message", [
    ("--inprocess-restart --inprocess-granularity rank", "--inprocess-restart (restarting training inside the "
     "running processes"),
    ("--use-fused-weighted-squared-relu --num-experts 2", "--use-fused-weighted-squared-relu fuses the experts' "
     "squared ReLU: it needs --squared-relu and --num-experts"),
    ("--use-fused-weighted-squared-relu --squared-relu", "it needs --squared-relu and --num-experts"),
])
def test_upstream_features_without_a_counterpart_stop_naming_the_flag(extra, message):
    with pytest.raises(ValueError) as error:
        validated(extra)
    assert message in str(error.value)


def test_inprocess_settings_alone_warn_and_parse_upstream_values():
    with pytest.warns(UserWarning, match="--inprocess-soft-timeout, --inprocess-granularity, "
                      "--inprocess-empty-cuda-cache have no effect without --inprocess-restart"):
        args = validated("--inprocess-soft-timeout 30 --inprocess-granularity rank --inprocess-empty-cuda-cache")
    assert (args.inprocess_soft_timeout, args.inprocess_granularity) == (30.0, "rank")
