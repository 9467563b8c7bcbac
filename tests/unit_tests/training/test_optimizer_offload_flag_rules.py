"""Optimizer CPU offload and the precision-aware optimizer under FSDP2: the refusal names FSDP2 and its own
offload flag instead of pointing at the distributed optimizer, which FSDP2 excludes."""

from functools import partial

import pytest

from tests.unit_tests.training import argument_checks

FSDP2 = "--use-torch-fsdp2 --untie-embeddings-and-output-weights"
validated = partial(argument_checks.validated, world_size=2, base=f"{argument_checks.BASE} {FSDP2}")


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
