"""NCCL user-buffer flags: parsed; on gloo each stops at validation saying it needs NCCL on GPUs and what to
drop; on NCCL their dependencies are checked and they reach DistributedDataParallelConfig, which checks the same
rules for callers that build it themselves."""

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
        ("--use-nccl-ub --fsdp-manual-registration", r"^--use-nccl-ub registers Megatron-FSDP's buffers with NCCL: "
         r"add --use-megatron-fsdp \(Megatron DDP's buffers are not allocated from NCCL's pool\), or drop "
         r"--use-nccl-ub$"),
        ("--megatron-fsdp-max-pool-double-buffer --use-megatron-fsdp",
         r"^--megatron-fsdp-max-pool-double-buffer needs --fsdp-double-buffer"),
        ("--fsdp-db-use-persist-buf-on-alloc-fail",
         r"^--fsdp-db-use-persist-buf-on-alloc-fail needs --fsdp-double-buffer"),
    ],
)
def test_rules_on_nccl(extra, message):
    with pytest.raises(ValueError, match=message):
        validated("--distributed-backend nccl " + extra)


ALL_ON = ("--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params --use-nccl-ub "
          "--fsdp-manual-registration --disable-symmetric-registration --fsdp-double-buffer "
          "--megatron-fsdp-max-pool-double-buffer --fsdp-db-use-persist-buf-on-alloc-fail")


@pytest.mark.parametrize("extra, fields", [
    ("--use-megatron-fsdp --use-nccl-ub", dict(nccl_ub=True, fsdp_manual_registration=False,
                                              disable_symmetric_registration=False,
                                              fsdp_db_use_persist_buf_on_alloc_fail=False)),
    (ALL_ON, dict(nccl_ub=True, fsdp_manual_registration=True, disable_symmetric_registration=True,
                  fsdp_db_use_persist_buf_on_alloc_fail=True, fsdp_double_buffer=True)),
])
def test_valid_flags_reach_the_ddp_config(extra, fields):
    from megatron.training.model_config import ddp_config_from_args

    config = ddp_config_from_args(validated("--distributed-backend nccl " + extra))
    assert {name: getattr(config, name) for name in fields} == fields


@pytest.mark.parametrize("fields, message", [
    (dict(nccl_ub=True), r"nccl_ub \(--use-nccl-ub\) registers Megatron-FSDP's buffers with NCCL: it needs "
                         r"use_megatron_fsdp=True \(--use-megatron-fsdp\)\.$"),
    (dict(use_megatron_fsdp=True, fsdp_manual_registration=True),
     r"fsdp_manual_registration \(--fsdp-manual-registration\) needs nccl_ub=True \(--use-nccl-ub\)\.$"),
    (dict(use_megatron_fsdp=True, disable_symmetric_registration=True),
     r"disable_symmetric_registration \(--disable-symmetric-registration\) needs nccl_ub=True"),
    (dict(use_megatron_fsdp=True, fsdp_db_use_persist_buf_on_alloc_fail=True),
     r"is the fallback of fsdp_double_buffer=True \(--fsdp-double-buffer\): set both or neither\.$"),
])
def test_ddp_config_rules(fields, message):
    from megatron.core.distributed import DistributedDataParallelConfig

    with pytest.raises(ValueError, match=message):
        DistributedDataParallelConfig(**fields)


def test_adapter_options():
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.distributed.fsdp.mcore_fsdp_adapter import _nccl_user_buffers
    from megatron_fsdp.nccl_allocator import NcclUserBuffers

    assert _nccl_user_buffers(DistributedDataParallelConfig(use_megatron_fsdp=True)) is None
    config = DistributedDataParallelConfig(use_megatron_fsdp=True, nccl_ub=True, disable_symmetric_registration=True)
    assert _nccl_user_buffers(config) == NcclUserBuffers(manual_registration=False, symmetric=False)
