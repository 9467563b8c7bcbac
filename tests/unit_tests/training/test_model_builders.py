"""Upstream flags for other model builders (legacy models, specs other than the hybrid stack's, TE export) parse
and stop at validation with a message naming the flag and what to do."""

import pytest

from tests.unit_tests.training.argument_checks import validated


@pytest.mark.parametrize("extra, message", [
    ("--use-legacy-models", "only the Megatron-Core GPT model, built from the command-line flags: drop "
                            "--use-legacy-models"),
    ("--spec my.module my_spec", "drop --spec"),
    ("--export-te", "drop --export-te"),
])
def test_other_model_builders_stop(extra, message):
    with pytest.raises(ValueError) as error:
        validated(extra)
    flag = extra.split()[0]
    assert str(error.value).startswith(f"{flag} is not supported") and message in str(error.value)
