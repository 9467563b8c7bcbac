"""Data-parallel flags across argument groups: upstream's `--use-custom-fsdp` name, and Megatron-FSDP settings
passed without `--use-megatron-fsdp`."""

import warnings

import pytest

from tests.unit_tests.training.argument_checks import validated


@pytest.mark.parametrize("flags", [
    "--use-precision-aware-optimizer",
    "--use-precision-aware-optimizer --exp-avg-dtype bf16",
    "--megatron-fsdp-param-offload",
])
def test_use_custom_fsdp_is_use_megatron_fsdp_for_every_argument_group(flags):
    # The memory flags are validated before the data-parallel ones; they must see Megatron-FSDP too.
    for name in ("--use-megatron-fsdp", "--use-custom-fsdp"):
        args = validated(f"{name} {flags}")
        assert args.use_megatron_fsdp and args.use_distributed_optimizer


def test_use_custom_fsdp_keeps_the_megatron_fsdp_checkpoint_rules(tmp_path):
    for name in ("--use-megatron-fsdp", "--use-custom-fsdp"):
        with pytest.raises(ValueError, match="^--use-megatron-fsdp checkpoints need --ckpt-format torch_dist"):
            validated(f"{name} --ckpt-format torch --save {tmp_path}")


def test_use_custom_fsdp_main_params_dtype_points_at_the_megatron_fsdp_flag():
    with pytest.raises(ValueError, match="^--main-params-dtype is for the distributed optimizer; with "
                                         "--use-megatron-fsdp use --megatron-fsdp-main-params-dtype"):
        validated("--use-custom-fsdp --use-precision-aware-optimizer --main-params-dtype fp16")


@pytest.mark.parametrize("flag, value, world_size, extra", [
    ("--outer-dp-sharding-strategy", "optim", 2, "--num-distributed-optimizer-instances 2"),
    ("--megatron-fsdp-main-params-dtype", "bf16", 1, ""),
    ("--megatron-fsdp-main-grads-dtype", "fp32", 1, ""),
    ("--megatron-fsdp-grad-comm-dtype", "bf16", 1, ""),
])
def test_megatron_fsdp_settings_without_megatron_fsdp_warn(flag, value, world_size, extra):
    with pytest.warns(UserWarning, match=f"^{flag} {value} has no effect without --use-megatron-fsdp"):
        args = validated(f"--use-distributed-optimizer --bf16 {extra} {flag} {value}", world_size)
    assert args.use_megatron_fsdp is False and getattr(args, flag[2:].replace("-", "_")) == value
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=flag)
        assert validated(f"--use-megatron-fsdp --bf16 {extra} {flag} {value}", world_size).use_megatron_fsdp


@pytest.mark.parametrize("flags, message", [
    ("--grad-reduce-in-bf16 --megatron-fsdp-grad-comm-dtype fp32",
     "--grad-reduce-in-bf16 and --megatron-fsdp-grad-comm-dtype fp32 contradict each other"),
    ("--accumulate-allreduce-grads-in-fp32 --megatron-fsdp-main-grads-dtype bf16",
     "--accumulate-allreduce-grads-in-fp32 and --megatron-fsdp-main-grads-dtype bf16 contradict each other"),
    ("--accumulate-allreduce-grads-in-fp32 --megatron-fsdp-grad-comm-dtype bf16",
     "--accumulate-allreduce-grads-in-fp32 and --megatron-fsdp-grad-comm-dtype bf16 contradict each other"),
])
def test_megatron_fsdp_dtypes_contradicting_the_gradient_precision_flags_are_rejected(flags, message):
    with pytest.raises(ValueError, match=f"^{message}: drop one"):
        validated(f"--use-megatron-fsdp --bf16 {flags}")


def test_megatron_fsdp_dtypes_agreeing_with_the_gradient_precision_flags_are_kept():
    args = validated("--use-megatron-fsdp --bf16 --grad-reduce-in-bf16 --megatron-fsdp-grad-comm-dtype bf16")
    assert args.megatron_fsdp_grad_comm_dtype == "bf16" and not args.accumulate_allreduce_grads_in_fp32
    # --bf16 turns fp32 accumulation on by itself; an explicit bf16 main-grads dtype still applies then
    args = validated("--use-megatron-fsdp --bf16 --megatron-fsdp-main-grads-dtype bf16")
    assert args.megatron_fsdp_main_grads_dtype == "bf16" and args.accumulate_allreduce_grads_in_fp32


def test_keep_fp8_transpose_cache_without_fp8_warns():
    with pytest.warns(UserWarning, match="^--keep-fp8-transpose-cache has no effect without --fp8-format"):
        validated("--use-megatron-fsdp --keep-fp8-transpose-cache")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        validated("--use-megatron-fsdp --keep-fp8-transpose-cache --fp8-format e4m3 --fp8-recipe tensorwise")


@pytest.mark.parametrize("comm", ["bf16", "fp16"])
def test_explicit_half_gradient_reduction_keeps_fp32_accumulation_under_bf16(comm):
    import types

    import torch

    from megatron.core.distributed.fsdp.mcore_fsdp_adapter import _mixed_precision_policy
    from megatron.training.model_config import ddp_config_from_args

    bf16_model = types.SimpleNamespace(params_dtype=torch.bfloat16)

    def policy(flags):
        args = validated(f"--use-megatron-fsdp --bf16 {flags}")
        return _mixed_precision_policy(bf16_model, ddp_config_from_args(args))

    comm_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[comm]
    explicit = policy(f"--megatron-fsdp-grad-comm-dtype {comm}")
    assert (explicit.main_grads_dtype, explicit.grad_comm_dtype) == (torch.float32, comm_dtype)
    # --grad-reduce-in-bf16 opts out of fp32 accumulation, as under DDP; an explicit main-grads dtype is kept.
    assert policy("--grad-reduce-in-bf16").main_grads_dtype == torch.bfloat16
    assert policy(f"--megatron-fsdp-grad-comm-dtype {comm} --megatron-fsdp-main-grads-dtype bf16"
                  ).main_grads_dtype == torch.bfloat16


@pytest.mark.parametrize("sharding, warns", [("--use-megatron-fsdp", True), ("--use-torch-fsdp2 "
                                             "--untie-embeddings-and-output-weights", True),
                                             ("--use-megatron-fsdp --data-parallel-sharding-strategy optim", False),
                                             ("--use-distributed-optimizer", False)])
def test_weight_hash_check_over_fully_sharded_weights_warns_that_it_compares_nothing(sharding, warns):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        validated(f"{sharding} --check-weight-hash-across-dp-replicas-interval 2", world_size=2)
    said = [str(w.message) for w in caught if "there are no replicas to compare" in str(w.message)]
    assert len(said) == (1 if warns else 0)
