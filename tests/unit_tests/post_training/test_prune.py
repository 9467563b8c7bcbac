"""examples/post_training/prune.py: Minitron pruning needs transformer-engine (modelopt's NAS plugin imports it
unconditionally); without it the example stops with a message saying so and what runs on CPUs instead."""

import pytest

from megatron.core.optional_deps import HAVE_TE, modelopt_installed


@pytest.mark.skipif(HAVE_TE or not modelopt_installed(),
                    reason="checks the message given where modelopt is installed and transformer-engine is not")
def test_pruning_without_transformer_engine_says_what_it_needs(monkeypatch):
    from examples.post_training import prune
    from megatron.core import optional_deps

    monkeypatch.setattr(optional_deps, "have_modelopt", lambda: True)  # no need to import modelopt for the check
    with pytest.raises(RuntimeError, match="needs transformer-engine.*does not run on CPUs"):
        prune.check_pruning_available()
