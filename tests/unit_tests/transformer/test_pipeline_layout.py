"""Uneven pipeline splits without processes: the layout language's parser, the (offset, count) of every
(pipeline rank, model chunk) under each way of splitting against hand-written tables, and the config's errors."""

import dataclasses

import pytest

from megatron.core import parallel_state
from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout, parse_layout_stages
from megatron.core.transformer.pipeline_split import (
    layers_per_pipeline_rank,
    stage_layer_range,
    stages_without_parameters,
    virtual_stage_layer_counts,
)
from megatron.core.transformer.transformer_block import TransformerBlock, pipeline_stage_layer_range
from megatron.core.transformer.transformer_config import TransformerConfig


# ---------------------------------------------------------------------------------------------------------
# The layout language
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, stages",
    [
        ("Ett|ttL", ["Ett", "ttL"]),
        ("E|t*4L", ["E", "ttttL"]),
        ("Et|(tt|)*2tL", ["Et", "tt", "tt", "tL"]),
        ("E((t)*2|)*2L", ["Ett", "tt", "L"]),  # nested groups expand from the inside
        (" E t , t |\tt t L ", ["Ett", "ttL"]),  # whitespace and commas are ignored
        ("Et*0|t*3L", ["E", "tttL"]),
        ("Ett||tt|L", ["Ett", "", "tt", "L"]),  # an empty stage
        ("t * 2", ["tt"]),
        ("Et*3|(tt|)*29,m|L", ["Ettt"] + ["tt"] * 29 + ["m", "L"]),  # upstream's DeepSeek-V3 example parses
    ],
)
def test_layout_parses_to_stages(text, stages):
    assert parse_layout_stages(text) == tuple(tuple(stage) for stage in stages)
    assert PipelineParallelLayerLayout.get_num_stages_from_str(text) == len(stages)


@pytest.mark.parametrize(
    "text, message",
    [
        ("Et|x", r"unknown symbol 'x' .* at character 4"),
        ("E(t|L", r"'\(' without a matching '\)'"),
        ("Et)|L", r"'\)' without a matching '\('"),
        ("*3Et|L", r"'\*N' must follow a symbol or a parenthesised group"),
        ("Et*|L", r"'\*' must be followed by a repetition count"),
        ("Et*2*3|L", r"repetition of a repetition"),
    ],
)
def test_layout_syntax_errors_point_at_the_character(text, message):
    with pytest.raises(ValueError, match=r"--pipeline-model-parallel-layout .*" + message):
        parse_layout_stages(text)


@pytest.mark.parametrize(
    "text, pipeline_size, num_layers, message",
    [
        ("Ett|tt|L", 2, 4, r"has 3 stages, not a multiple of --pipeline-model-parallel-size \(2\)"),
        ("Ett|ttL", 2, 5, r"places 4 transformer layers \('t'\) but --num-layers is 5"),
        ("tEt|ttL", 2, 4, r"embedding \('E'\) must appear once, as the first symbol of the first stage"),
        ("Ett|tt", 2, 4, r"loss \('L'\) must appear once, as the last symbol of the last stage \(found 0\)"),
        ("EtLt|ttL", 2, 4, r"loss \('L'\) must appear once.*\(found 2\)"),
        ("Ett|ttL|", 3, 4, r"loss \('L'\) must appear once.*\(found in stage 1 of stages 0-2, and stage 2 is empty\)"),
        ("tEt|ttL", 2, 4, r"embedding \('E'\) must appear once.*\(found in stage 0 of stages 0-1\)"),
        ("Etm|ttL", 2, 3, r"multi-token-prediction depths \('m'\) must all sit in the last stage"),
    ],
)
def test_layout_validation_names_the_flag(text, pipeline_size, num_layers, message):
    with pytest.raises(ValueError, match=message):
        PipelineParallelLayerLayout(text, pipeline_size).validate_layer_layout(num_layers)


def test_layout_from_lists_equals_layout_from_text():
    from_text = PipelineParallelLayerLayout("Et|(tt|)*2tL", 2)
    from_lists = PipelineParallelLayerLayout([["E", "t"], ["t", "t"], "tt", ["t", "L"]], 2)
    assert from_text == from_lists and hash(from_text) == hash(from_lists)
    assert from_text.virtual_pipeline_model_parallel_size == 2
    assert from_lists.text == "Et|tt|tt|tL"


# ---------------------------------------------------------------------------------------------------------
# Placement: (offset, count) per pipeline rank, per model chunk
# ---------------------------------------------------------------------------------------------------------


def _table(counts, pipeline_size, virtual_stages=1):
    """[[(offset, count) of chunk c] for each pipeline rank]."""
    return [[stage_layer_range(counts, pipeline_size, rank, chunk) for chunk in range(virtual_stages)]
            for rank in range(pipeline_size)]


PLACEMENTS = {
    # name: (num_layers, pp, vpp, split kwargs, expected [[(offset, count) per chunk] per rank])
    "even": (8, 4, None, {}, [[(0, 2)], [(2, 2)], [(4, 2)], [(6, 2)]]),
    "even_vpp": (8, 2, 2, {}, [[(0, 2), (4, 2)], [(2, 2), (6, 2)]]),
    "first_1_of_4": (4, 2, None, dict(first_stage_layers=1), [[(0, 1)], [(1, 3)]]),
    "last_3_of_4": (4, 2, None, dict(last_stage_layers=3), [[(0, 1)], [(1, 3)]]),
    "first_0": (4, 2, None, dict(first_stage_layers=0), [[(0, 0)], [(0, 4)]]),
    "first_and_last": (10, 4, None, dict(first_stage_layers=1, last_stage_layers=3),
                       [[(0, 1)], [(1, 3)], [(4, 3)], [(7, 3)]]),
    "last_only_pp3": (7, 3, None, dict(last_stage_layers=1), [[(0, 3)], [(3, 3)], [(6, 1)]]),
    # rank 0 holds 4 layers (2 per chunk), rank 1 holds 8 (4 per chunk); chunks run in virtual-stage order.
    "first_last_vpp": (12, 2, 2, dict(first_stage_layers=4, last_stage_layers=8),
                       [[(0, 2), (6, 2)], [(2, 4), (8, 4)]]),
    "embedding": (7, 4, None, dict(account_for_embedding=True), [[(0, 1)], [(1, 2)], [(3, 2)], [(5, 2)]]),
    "embedding_and_loss": (6, 4, None, dict(account_for_embedding=True, account_for_loss=True),
                           [[(0, 1)], [(1, 2)], [(3, 2)], [(5, 1)]]),
    "embedding_and_loss_vpp": (6, 2, 2, dict(account_for_embedding=True, account_for_loss=True),
                               [[(0, 1), (3, 2)], [(1, 2), (5, 1)]]),
    "loss_vpp": (7, 2, 2, dict(account_for_loss=True), [[(0, 2), (4, 2)], [(2, 2), (6, 1)]]),
    "layout_empty_first": (4, 2, None, dict(layout="E|t*4L"), [[(0, 0)], [(0, 4)]]),
    "layout_vpp": (6, 2, 2, dict(layout="Et|(tt|)*2tL"), [[(0, 1), (3, 2)], [(1, 2), (5, 1)]]),
    "layout_empty_middle_vpp": (4, 2, 2, dict(layout="Ett||tt|L"), [[(0, 2), (2, 2)], [(2, 0), (4, 0)]]),
    "layout_pp3": (5, 3, None, dict(layout="E|ttt|ttL"), [[(0, 0)], [(0, 3)], [(3, 2)]]),
}


@pytest.mark.parametrize("name", sorted(PLACEMENTS))
def test_placement_table(name):
    num_layers, pp, vpp, kwargs, expected = PLACEMENTS[name]
    if "layout" in kwargs:
        kwargs = dict(kwargs, layout=PipelineParallelLayerLayout(kwargs["layout"], pp))
    counts = virtual_stage_layer_counts(num_layers, pp, vpp, **kwargs)
    assert _table(counts, pp, vpp or 1) == expected
    assert sum(counts) == num_layers
    # Consecutive in virtual-stage order: every global layer has exactly one owner.
    owners = sorted(offset + i for rank in expected for offset, count in rank for i in range(count))
    assert owners == list(range(num_layers))


def test_accounting_equals_the_layout_that_spells_it_out():
    accounted = virtual_stage_layer_counts(6, 2, 2, account_for_embedding=True, account_for_loss=True)
    assert accounted == virtual_stage_layer_counts(6, 2, 2, layout=PipelineParallelLayerLayout("Et|tt|tt|tL", 2))


def test_stages_without_parameters_are_the_empty_middle_ones():
    counts = virtual_stage_layer_counts(4, 2, 2, layout=PipelineParallelLayerLayout("E|tt||ttL", 2))
    assert counts == (0, 2, 0, 2)
    assert stages_without_parameters(counts) == (2,)  # stage 0 holds the embedding
    assert layers_per_pipeline_rank(counts, 2) == (0, 4)


# ---------------------------------------------------------------------------------------------------------
# The config: its fields drive pipeline_stage_layer_range and the blocks built from it
# ---------------------------------------------------------------------------------------------------------

BASE = dict(num_layers=4, hidden_size=32, num_attention_heads=4)


@pytest.fixture
def pipeline_position(monkeypatch):
    """Pretend to be pipeline rank `rank` of `size` (no process group needed)."""

    def place(size, rank):
        monkeypatch.setattr(parallel_state, "get_pipeline_model_parallel_world_size", lambda: size)
        monkeypatch.setattr(parallel_state, "get_pipeline_model_parallel_rank", lambda: rank)

    return place


# (rank, chunk): ((offset, count), 1-based layer numbers) for layout Et|tt|t|L
PLACEMENTS_FOR_BLOCKS = {(0, 0): ((0, 1), [1]), (1, 0): ((1, 2), [2, 3]), (0, 1): ((3, 1), [4]),
                         (1, 1): ((4, 0), [])}


def test_blocks_hold_the_global_layers_of_their_stage(pipeline_position):
    config = TransformerConfig(**BASE, pipeline_model_parallel_size=2, pipeline_model_parallel_layout="Et|tt|t|L")
    assert config.virtual_pipeline_model_parallel_size == 2
    numbers = {}
    for rank in range(2):
        pipeline_position(2, rank)
        for chunk in range(2):
            assert pipeline_stage_layer_range(config, chunk) == PLACEMENTS_FOR_BLOCKS[(rank, chunk)][0]
            block = TransformerBlock(config, pre_process=(rank, chunk) == (0, 0),
                                     post_process=(rank, chunk) == (1, 1), vp_stage=chunk)
            numbers[(rank, chunk)] = [layer.layer_number for layer in block.layers]
            assert block.layer_offset == PLACEMENTS_FOR_BLOCKS[(rank, chunk)][0][0]
    assert numbers == {key: value[1] for key, value in PLACEMENTS_FOR_BLOCKS.items()}



def test_first_last_flags_place_layers_through_the_config(pipeline_position):
    config = TransformerConfig(**BASE, pipeline_model_parallel_size=2, num_layers_in_first_pipeline_stage=1)
    pipeline_position(2, 0)
    assert pipeline_stage_layer_range(config) == (0, 1)
    pipeline_position(2, 1)
    assert pipeline_stage_layer_range(config) == (1, 3)


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(num_layers=3, pipeline_model_parallel_size=2),
         r"--num-layers \(3\) must be divisible by --pipeline-model-parallel-size \(2\).*"
         r"--decoder-first-pipeline-num-layers"),
        (dict(num_layers_in_first_pipeline_stage=1), r"--decoder-first-pipeline-num-layers / "
         r"--decoder-last-pipeline-num-layers need --pipeline-model-parallel-size > 1"),
        (dict(pipeline_model_parallel_size=2, num_layers_in_first_pipeline_stage=-1),
         r"--decoder-first-pipeline-num-layers must be an integer in \[0, --num-layers=4\], got -1"),
        (dict(pipeline_model_parallel_size=2, num_layers_in_last_pipeline_stage=5),
         r"--decoder-last-pipeline-num-layers must be an integer in \[0, --num-layers=4\], got 5"),
        (dict(pipeline_model_parallel_size=2, num_layers_in_first_pipeline_stage=1,
              num_layers_in_last_pipeline_stage=2),
         r"--decoder-first-pipeline-num-layers \(1\) \+ --decoder-last-pipeline-num-layers \(2\) must equal "
         r"--num-layers \(4\)"),
        (dict(num_layers=8, pipeline_model_parallel_size=4, num_layers_in_first_pipeline_stage=1),
         r"the 7 layers left by --decoder-first-pipeline-num-layers \(1\) .* divisible by the 3 other pipeline "
         r"stages"),
        (dict(num_layers=8, pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2,
              num_layers_in_first_pipeline_stage=3),
         r"the first pipeline stage \(--decoder-first-pipeline-num-layers\) holds 3 layers, not divisible by its 2 "
         r"virtual stages"),
        (dict(pipeline_model_parallel_size=2, num_layers_in_first_pipeline_stage=1,
              account_for_embedding_in_pipeline_split=True), r"are exclusive \(as upstream\)"),
        (dict(pipeline_model_parallel_size=2, account_for_embedding_in_pipeline_split=True),
         r"--num-layers \(4\) \+ 1 for each of --account-for-embedding-in-pipeline-split \(5\) must be divisible by "
         r"--pipeline-model-parallel-size \(2\)"),
        (dict(num_layers=7, pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=3,
              account_for_loss_in_pipeline_split=True),
         r"the 4 layers of a pipeline stage \(\(--num-layers 7 \+ 1 accounted\) .* divisible by "
         r"--num-virtual-stages-per-pipeline-rank \(3\)"),
        (dict(pipeline_model_parallel_size=2, pipeline_model_parallel_layout="Ett|ttL",
              account_for_loss_in_pipeline_split=True),
         r"--pipeline-model-parallel-layout places every layer itself: drop"),
        (dict(pipeline_model_parallel_size=2, pipeline_model_parallel_layout="Et|t|t|tL",
              virtual_pipeline_model_parallel_size=4), r"gives 2 virtual stages per pipeline rank but "
         r"virtual_pipeline_model_parallel_size is 4"),
        (dict(pipeline_model_parallel_size=2, pipeline_model_parallel_layout="Ett|tt"), r"loss \('L'\)"),
        (dict(pipeline_model_parallel_size=2, num_layers_in_first_pipeline_stage=1,
              recompute_granularity="full", recompute_method="block", recompute_num_layers=4),
         r"--recompute-num-layers \(4\) with --recompute-method block cannot exceed the layers of one pipeline "
         r"stage \(3, the most any stage holds\)"),
    ],
)
def test_config_rejects_impossible_splits(fields, message):
    with pytest.raises(ValueError, match=message):
        TransformerConfig(**{**BASE, **fields})


def test_config_accepts_uneven_splits_and_keeps_them_through_replace():
    config = TransformerConfig(**{**BASE, "num_layers": 3}, pipeline_model_parallel_size=2,
                               num_layers_in_last_pipeline_stage=2, recompute_granularity="full",
                               recompute_method="block", recompute_num_layers=2)
    assert config.num_layers_in_last_pipeline_stage == 2
    layout_config = TransformerConfig(**BASE, pipeline_model_parallel_size=2, pipeline_model_parallel_layout="E|t*4L")
    assert isinstance(layout_config.pipeline_model_parallel_layout, PipelineParallelLayerLayout)
    assert layout_config.virtual_pipeline_model_parallel_size is None  # two stages over two ranks: no chunks
    replaced = dataclasses.replace(layout_config, hidden_size=64)
    assert replaced.pipeline_model_parallel_layout == layout_config.pipeline_model_parallel_layout
