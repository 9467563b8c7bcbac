"""NCCL user-buffer flags: parsed; on gloo each stops at validation saying it needs NCCL on GPUs and what to
drop; on NCCL their dependencies are checked, then they are rejected as not implemented yet."""

import pytest

from megatron.training.argument_groups.nccl_buffers import NCCL_BUFFER_FLAGS
from megatron.training.arguments import parse_args
from tests.unit_tests.training.test_arguments import BASE, validated

FLAGS = [flag for flag, _ in NCCL_BUFFER_FLAGS.values()]


def test_flags_parse_and_default_off():
    args = parse_args(args=(BASE + " " + " ".join(FLAGS)).split())
    assert all(getattr(args, dest) for dest in NCCL_BUFFER_FLAGS)
    defaults = validated()
    assert not any(getattr(defaults, dest) for dest in NCCL_BUFFER_FLAGS)


@pytest.mark.parametrize("flag", FLAGS)
def test_each_flag_needs_nccl_on_gloo(flag):
    with pytest.raises(ValueError, match=rf"^{flag}: NCCL user buffers need NCCL on GPUs \(--distributed-backend "
                                         rf"nccl\); this run uses gloo: drop {flag}$"):
        validated(f"--distributed-backend gloo --use-megatron-fsdp --fsdp-double-buffer {flag}")


def test_all_flags_named_on_gloo():
    with pytest.raises(ValueError, match="drop " + " ".join(FLAGS) + "$"):
        validated("--distributed-backend gloo " + " ".join(FLAGS))


@pytest.mark.parametrize(
    "extra, message",
    [
        ("--fsdp-manual-registration --use-megatron-fsdp", r"^--fsdp-manual-registration needs --use-nccl-ub$"),
        ("--disable-symmetric-registration", r"^--disable-symmetric-registration needs --use-nccl-ub$"),
        ("--use-nccl-ub --fsdp-manual-registration", r"^--fsdp-manual-registration needs --use-megatron-fsdp$"),
        ("--megatron-fsdp-max-pool-double-buffer --use-megatron-fsdp",
         r"^--megatron-fsdp-max-pool-double-buffer needs --fsdp-double-buffer"),
        ("--fsdp-db-use-persist-buf-on-alloc-fail",
         r"^--fsdp-db-use-persist-buf-on-alloc-fail needs --fsdp-double-buffer"),
        ("--use-nccl-ub", r"^not implemented yet: --use-nccl-ub$"),
        ("--use-megatron-fsdp --use-nccl-ub --fsdp-manual-registration --disable-symmetric-registration "
         "--fsdp-double-buffer --megatron-fsdp-max-pool-double-buffer --fsdp-db-use-persist-buf-on-alloc-fail",
         r"^not implemented yet: --use-nccl-ub$"),
    ],
)
def test_rules_on_nccl(extra, message):
    with pytest.raises(ValueError, match=message):
        validated("--distributed-backend nccl " + extra)
