"""The `tools` fixture of the Hugging Face conversion tests (test files that define their own `tools` use theirs)."""

import sys

import pytest

from tests.unit_tests.tools.hf_conversion_helpers import TOOLS


@pytest.fixture(scope="module")
def tools():
    """(convert_checkpoint, hf_mapping), imported from the tools' own directory."""
    sys.path.insert(0, TOOLS)
    import convert_checkpoint
    import hf_mapping

    yield convert_checkpoint, hf_mapping
    sys.path.remove(TOOLS)
