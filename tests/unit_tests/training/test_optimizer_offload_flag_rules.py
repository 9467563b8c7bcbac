"""Optimizer CPU offload and the precision-aware optimizer under FSDP2: the refusal names FSDP2 and its own
offload flag instead of pointing at the distributed optimizer, which FSDP2 excludes."""

import pytest

from megatron.training.arguments import parse_args, validate_args

BASE = (
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --micro-batch-size 2 "
    "--train-iters 10 --lr 1e-3 --mock-data --vocab-size 128 --use-torch-fsdp2 --untie-embeddings-and-output-weights"
)


@pytest.fixture(autouse=True)
def two_rank_env(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")


def validated(extra):
    return validate_args(parse_args(args=(BASE + " " + extra).split()))


@pytest.mark.parametrize("extra", [
    "--optimizer-cpu-offload",
    "--use-precision-aware-optimizer --optimizer-cpu-offload",
    "--use-precision-aware-optimizer --optimizer-cpu-offload --optimizer-offload-fraction 0.5",
])
def test_optimizer_cpu_offload_under_fsdp2_points_at_fsdp2_offload(extra):
    with pytest.raises(ValueError, match=r"^--optimizer-cpu-offload does not work with --use-torch-fsdp2 .*: use "
                                         r"--torch-fsdp2-cpu-offload"):
        validated(extra)


def test_precision_aware_optimizer_under_fsdp2_is_refused_naming_fsdp2():
    with pytest.raises(ValueError, match=r"^--use-precision-aware-optimizer does not work with --use-torch-fsdp2"):
        validated("--use-precision-aware-optimizer --exp-avg-dtype bf16")


def test_fsdp2_cpu_offload_still_validates():
    args = validated("--torch-fsdp2-cpu-offload")
    assert args.use_torch_fsdp2 and args.torch_fsdp2_cpu_offload and not args.optimizer_cpu_offload
