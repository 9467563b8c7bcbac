"""--overlap-param-gather under FSDP2: refused naming FSDP2 (not pointing at the distributed optimizer, which FSDP2
excludes); --overlap-grad-reduce is accepted (FSDP2 reduce-scatters each unit's gradients during backward)."""

from functools import partial

import pytest

from tests.unit_tests.training import argument_checks

FSDP2 = "--use-torch-fsdp2 --untie-embeddings-and-output-weights"
validated = partial(argument_checks.validated, world_size=2, base=f"{argument_checks.BASE} {FSDP2}")


@pytest.mark.parametrize("extra", ["--overlap-param-gather", "--overlap-grad-reduce --overlap-param-gather"])
def test_overlap_param_gather_under_fsdp2_is_refused_naming_fsdp2(extra):
    with pytest.raises(ValueError, match=r"^--overlap-param-gather does not work with --use-torch-fsdp2 .*: drop it$"):
        validated(extra)


def test_overlap_grad_reduce_under_fsdp2_validates():
    args = validated("--overlap-grad-reduce")
    assert args.use_torch_fsdp2 and args.overlap_grad_reduce and not args.overlap_param_gather
