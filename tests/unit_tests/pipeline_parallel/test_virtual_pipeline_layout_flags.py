"""`--num-layers-per-virtual-pipeline-stage` given beside `--pipeline-model-parallel-layout`: the layout sets the
virtual stages, so a count that cannot describe them is reported as a disagreement with the layout (not as an
uneven --num-layers, which the layout is there to allow); a count that agrees is accepted."""

import pytest

from megatron.training.arguments import parse_args, validate_args

BASE = ("--hidden-size 32 --num-attention-heads 4 --seq-length 16 --micro-batch-size 1 --global-batch-size 4 "
        "--train-iters 2 --lr 1e-3 --mock-data --vocab-size 128 --pipeline-model-parallel-size 2")


def _validated(extra, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    return validate_args(parse_args(args=f"{BASE} {extra}".split()))


def test_layers_per_stage_that_cannot_split_an_uneven_layout_names_the_layout(monkeypatch):
    with pytest.raises(ValueError) as error:
        _validated("--num-layers 5 --pipeline-model-parallel-layout Et|(tt|)*2L "
                   "--num-layers-per-virtual-pipeline-stage 1", monkeypatch)
    message = str(error.value)
    assert message.startswith("--pipeline-model-parallel-layout 'Et|(tt|)*2L' gives 2 virtual stages per pipeline "
                              "rank"), message
    assert "--num-layers-per-virtual-pipeline-stage 1 does not split the 5 layers" in message
    assert "drop the flag (the layout sets it)" in message
    assert "must be divisible by --pipeline-model-parallel-size" not in message


def test_layers_per_stage_that_agrees_with_the_layout_is_accepted(monkeypatch):
    args = _validated("--num-layers 4 --pipeline-model-parallel-layout Et|tt|t|L "
                      "--num-layers-per-virtual-pipeline-stage 1", monkeypatch)
    assert args.virtual_pipeline_model_parallel_size == 2
    assert args.virtual_stage_layer_counts == (1, 2, 1, 0)
