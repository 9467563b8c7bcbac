"""Expert-parallel runs checkpoint in the logical format only: the torch format's per-tensor/pipeline-rank files
would hold one expert-parallel rank's experts."""

import pytest

from tests.unit_tests.training.test_arguments import validated

MOE = "--num-experts 4 --expert-model-parallel-size 2"


def test_torch_format_with_expert_parallelism_is_refused_naming_the_flags(monkeypatch):
    with pytest.raises(ValueError, match=r"--expert-model-parallel-size 2 checkpoints need --ckpt-format torch_dist"):
        validated(f"{MOE} --ckpt-format torch --save /tmp/unused", 2, monkeypatch)


def test_torch_dist_with_expert_parallelism_and_torch_format_without_are_accepted(monkeypatch):
    assert validated(f"{MOE} --ckpt-format torch_dist --save /tmp/unused", 2, monkeypatch).ckpt_format == "torch_dist"
    assert validated("--num-experts 4 --ckpt-format torch --save /tmp/unused", 2, monkeypatch).ckpt_format == "torch"
