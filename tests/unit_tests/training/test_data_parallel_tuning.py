"""--ddp-num-buckets, --suggested-communication-unit-size, --disable-strict-fsdp-dtensor-load,
--dist-ckpt-optim-fully-reshardable (and --distrib-optim-fully-reshardable-mem-efficient) and the two Megatron-FSDP
switches that stop with a message."""

import pytest
import torch

from megatron.training.arguments import parse_args, validate_args
from tests.unit_tests.multiprocess_harness import run_on_ranks

BASE = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --micro-batch-size 2 "
        "--train-iters 10 --lr 1e-3 --mock-data --vocab-size 128 --make-vocab-size-divisible-by 64")


def validated(extra):
    return validate_args(parse_args(args=(BASE + " " + extra).split()))


@pytest.fixture(autouse=True)
def two_rank_env(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")


def _tiny_gpt(args):
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.training.model_config import core_transformer_config_from_args

    return GPTModel(core_transformer_config_from_args(args), vocab_size=128, max_sequence_length=16,
                    share_embeddings_and_output_weights=True)


def _ddp_buckets(bucket_counts):
    import os

    from megatron.core import parallel_state
    from megatron.training.argument_groups.data_parallel_tuning import bucket_size_for
    from megatron.training.model_setup import wrap_model_chunk

    os.environ["WORLD_SIZE"], os.environ["RANK"] = "2", str(torch.distributed.get_rank())
    parallel_state.initialize_model_parallel()
    results = []
    try:
        for num_buckets in bucket_counts:
            args = validated(f"--ddp-num-buckets {num_buckets}")
            args.device = torch.device("cpu")
            model = _tiny_gpt(args)
            total = sum(param.numel() for param in model.parameters())
            bucket_size = bucket_size_for(args, [model])
            chunk = wrap_model_chunk(model, args, bucket_size)
            results.append((total, bucket_size, [bucket.numel for buffer in chunk.buffers for bucket in buffer.buckets]))
    finally:
        parallel_state.destroy_model_parallel()
    return results


def test_ddp_num_buckets_sets_the_bucket_size_from_the_parameter_count():
    (total, bucket_size, sizes), (_, whole, one) = run_on_ranks(2, _ddp_buckets, (3, 1))[0]
    assert bucket_size == total // 3 and whole == total
    # Buckets close once they reach the size: 3 buckets holding every parameter, the last one the remainder.
    assert len(sizes) == 3 and sum(sizes) == total and min(sizes[:-1]) >= bucket_size
    assert one == [total]


def test_suggested_communication_unit_size_caps_megatron_fsdp_groups_outside_units():
    from megatron.core.distributed.fsdp.mcore_fsdp_adapter import _package_ddp_config
    from megatron.core.distributed.fsdp.src.megatron_fsdp.grouping import plan_groups
    from megatron.core.transformer.transformer_layer import TransformerLayer
    from megatron.training.model_config import ddp_config_from_args

    args = validated("--use-megatron-fsdp --suggested-communication-unit-size 2000")
    package_config = _package_ddp_config(ddp_config_from_args(args))
    assert package_config.bucket_size == 2000
    model = _tiny_gpt(args)
    _, default_plans = plan_groups(model, (TransformerLayer,), None, False)
    _, plans = plan_groups(model, (TransformerLayer,), package_config.bucket_size, False)
    root = [sum(p.numel() for p in plan.params) for plan in plans if plan.unit_index is None]
    assert len(root) > len([plan for plan in default_plans if plan.unit_index is None]) == 1
    # Groups stay under the unit, except a single parameter larger than it (the 128 x 32 embedding).
    assert all(size <= 2000 or len(plan.params) == 1 for plan, size in
               zip([plan for plan in plans if plan.unit_index is None], root))


def test_disable_strict_fsdp_dtensor_load_tolerates_missing_keys():
    from megatron.core.dist_checkpointing.strictness import KeyMismatch, apply_strictness

    args = validated("--ckpt-format fsdp_dtensor --disable-strict-fsdp-dtensor-load")
    assert args.dist_ckpt_strictness == "log_all"
    mismatch = KeyMismatch(missing=["model.decoder.final_layernorm.weight"], unexpected=["model.extra"])
    logged = []
    apply_strictness(args.dist_ckpt_strictness, mismatch, "ckpt", logged.append)
    assert logged  # both lists reported, no error
    with pytest.raises(Exception, match="final_layernorm"):
        apply_strictness(validated("--ckpt-format fsdp_dtensor").dist_ckpt_strictness, mismatch, "ckpt", print)


def test_fully_reshardable_optimizer_checkpoint_needs_a_logical_format():
    assert validated("--dist-ckpt-optim-fully-reshardable").dist_ckpt_optim_fully_reshardable


def test_mem_efficient_fully_reshardable_flag_is_accepted_and_needs_fully_reshardable():
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        args = validated("--dist-ckpt-optim-fully-reshardable --distrib-optim-fully-reshardable-mem-efficient")
    assert args.distrib_optim_fully_reshardable_mem_efficient and args.dist_ckpt_optim_fully_reshardable
    assert not [w for w in caught if "mem-efficient" in str(w.message)]
    with pytest.warns(UserWarning, match="--distrib-optim-fully-reshardable-mem-efficient has effect only with "
                                         "--dist-ckpt-optim-fully-reshardable"):
        alone = validated("--distrib-optim-fully-reshardable-mem-efficient")
    assert alone.distrib_optim_fully_reshardable_mem_efficient and not alone.dist_ckpt_optim_fully_reshardable
    assert not validated("").distrib_optim_fully_reshardable_mem_efficient


@pytest.mark.parametrize("extra, message", [
    ("--ddp-num-buckets 2 --ddp-bucket-size 100", "--ddp-num-buckets and --ddp-bucket-size are exclusive"),
    ("--ddp-num-buckets 0", "--ddp-num-buckets must be positive"),
    ("--ddp-num-buckets 2 --use-torch-fsdp2 --untie-embeddings-and-output-weights", "has none: drop it"),
    ("--suggested-communication-unit-size 100", "--suggested-communication-unit-size needs --use-megatron-fsdp"),
    ("--use-megatron-fsdp --suggested-communication-unit-size 100 --ddp-bucket-size 10", "drop --ddp-bucket-size"),
    ("--create-all-gather-group", "--create-all-gather-group is not implemented"),
    ("--megatron-fsdp-enable-fine-grained-param-gather", "--megatron-fsdp-enable-fine-grained-param-gather is not"),
    ("--disable-strict-fsdp-dtensor-load", "--disable-strict-fsdp-dtensor-load needs --ckpt-format fsdp_dtensor"),
    ("--ckpt-format fsdp_dtensor --disable-strict-fsdp-dtensor-load --dist-ckpt-strictness raise_all",
     "drop --dist-ckpt-strictness raise_all"),
    ("--dist-ckpt-optim-fully-reshardable --ckpt-format torch", "--dist-ckpt-optim-fully-reshardable needs"),
])
def test_rules(extra, message):
    with pytest.raises(ValueError) as error:
        validated(extra)
    assert message in str(error.value)
