"""All seven of modelopt's Megatron plugin modules import against this megatron.core, and modelopt's plugin
loader prints no warning about them. The pruning plugin (`mcore_minitron`, through modelopt's NAS plugin)
imports transformer_engine unconditionally: without it modelopt skips the plugin silently, and this test
checks exactly that."""

import pytest

from megatron.core.optional_deps import HAVE_TE, modelopt_installed
from tests.unit_tests.multiprocess_harness import run_on_ranks
from tests.unit_tests.post_training.modelopt_plugins import PLUGIN_MODULES, import_modelopt_plugins

pytestmark = pytest.mark.skipif(
    not modelopt_installed(), reason="nvidia-modelopt is not installed (pip install -e '.[modelopt]')"
)

PRUNING_PLUGIN = "modelopt.torch.prune.plugins.mcore_minitron"
PLUGIN_WARNING_MARKERS = ("plugin", "megatron", "EAGLE", "Fail")


def test_every_megatron_plugin_imports_without_a_warning():
    # A rank of the 2-rank pool the other post-training tests share: modelopt is imported once per process.
    record = run_on_ranks(2, import_modelopt_plugins)[0]
    assert set(record["outcomes"]) == set(PLUGIN_MODULES)
    for name, outcome in record["outcomes"].items():
        if name == PRUNING_PLUGIN and not HAVE_TE:
            assert outcome == "needs transformer_engine", outcome
        else:
            assert outcome == "imported", (name, outcome)
    if record["fresh"]:
        plugin_warnings = [message for message in record["warnings"]
                           if any(marker in message for marker in PLUGIN_WARNING_MARKERS)]
        assert plugin_warnings == []
