"""FP8 scaling without host synchronisation: a GPT forward and backward in FP8 makes no host-sync call beyond
what the same model makes without FP8, and the FP8 linear layers make none at all, under both torch-native
recipes; delayed scaling reduces every layer's amaxes in one collective per step (`reduce_fp8_amaxes`), which
itself makes no host-sync call, and ranks end with identical histories."""

import contextlib

import pytest
import torch

from tests.unit_tests.multiprocess_harness import run_on_ranks

# Tensor methods that copy device data to the host and wait for it.
HOST_SYNC_METHODS = ("item", "cpu", "tolist", "numpy", "__float__", "__int__", "__bool__", "__index__")


@contextlib.contextmanager
def counting_host_syncs():
    """Counts calls of the host-sync tensor methods while active: yields a dict name -> count."""
    counts = {name: 0 for name in HOST_SYNC_METHODS}
    originals = {name: getattr(torch.Tensor, name) for name in HOST_SYNC_METHODS}

    def counting(name):
        original = originals[name]

        def wrapper(self, *args, **kwargs):
            counts[name] += 1
            return original(self, *args, **kwargs)

        return wrapper

    for name in HOST_SYNC_METHODS:
        setattr(torch.Tensor, name, counting(name))
    try:
        yield counts
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)


def _config(recipe, **overrides):
    from tests.unit_tests.models.gpt.gpt_test_utils import tiny_config

    fp8 = {} if recipe is None else {"fp8": "hybrid", "fp8_recipe": recipe, "fp8_amax_history_len": 4}
    return tiny_config(num_layers=3, **fp8, **overrides)


def _syncs_and_collectives(recipe, microbatches=2):
    """Host-sync calls of `microbatches` GPT forward+backward passes (in FP8 under `recipe`), then of
    `reduce_fp8_amaxes`, and the all-reduces each made; also the delayed histories after the step."""
    import torch.distributed as dist

    from megatron.core import parallel_state
    from megatron.core.fp8_utils import reduce_fp8_amaxes
    from tests.unit_tests.models.gpt.gpt_test_utils import fixed_batch, seeded_model

    parallel_state.initialize_model_parallel()
    model = seeded_model(_config(recipe))
    tokens, labels, position_ids = fixed_batch(seed=7 + dist.get_rank())  # different data on each DP rank
    all_reduces = []
    original_all_reduce = dist.all_reduce

    def counting_all_reduce(*args, **kwargs):
        all_reduces.append(1)
        return original_all_reduce(*args, **kwargs)

    dist.all_reduce = counting_all_reduce
    try:
        model(tokens, position_ids, labels=labels).sum().backward()  # warm-up: lazily built state, first scales
        reduce_fp8_amaxes([model])
        all_reduces.clear()
        with counting_host_syncs() as step_syncs:
            for _ in range(microbatches):
                model(tokens, position_ids, labels=labels).sum().backward()
        step_collectives = len(all_reduces)
        with counting_host_syncs() as reduce_syncs:
            reduce_fp8_amaxes([model])
        reduce_collectives = len(all_reduces) - step_collectives
    finally:
        dist.all_reduce = original_all_reduce
    histories = [m.fp8_amax_history.tolist() for m in model.modules() if hasattr(m, "fp8_amax_history")]
    parallel_state.destroy_model_parallel()
    return step_syncs, step_collectives, reduce_syncs, reduce_collectives, histories


def _compare_recipes():
    return {recipe: _syncs_and_collectives(recipe) for recipe in (None, "tensorwise", "delayed")}


def test_fp8_gpt_adds_no_host_syncs_and_delayed_amaxes_take_one_collective_per_step():
    results = run_on_ranks(2, _compare_recipes)
    for rank_results in results:
        baseline_syncs = rank_results[None][0]
        for recipe in ("tensorwise", "delayed"):
            step_syncs, step_collectives, reduce_syncs, reduce_collectives, histories = rank_results[recipe]
            assert step_syncs == baseline_syncs, (recipe, step_syncs, baseline_syncs)
            assert sum(reduce_syncs.values()) == 0, (recipe, reduce_syncs)
            assert step_collectives == 0, recipe  # DP=2, TP=1: no amax reduction inside the passes
            if recipe == "delayed":
                assert reduce_collectives == 1  # 3 layers x 4 linears x 3 roles, one all-reduce
                assert len(histories) == 12  # only the transformer layers' linears (no output layer)
                assert all(row[0] > 0 for history in histories for row in history)
            else:
                assert reduce_collectives == 0 and histories == []
    # Both DP ranks saw different data, and agree on every recorded amax.
    assert results[0]["delayed"][4] == results[1]["delayed"][4]


@pytest.mark.parametrize("recipe", ["tensorwise", "delayed"])
def test_fp8_linear_layers_make_no_host_sync_call(recipe):
    """A stack of FP8 linear layers (column, row, column, row) forward and backward over three microbatches, the
    step's amax reduction, then a step with recorded histories: zero host-sync calls."""
    from megatron.core import fp8_utils
    from megatron.core.extensions.transformer_engine import layer_classes
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2, fp8="hybrid", fp8_recipe=recipe,
                               fp8_amax_history_len=4, add_bias_linear=True)
    column, row = layer_classes(config)
    torch.manual_seed(0)
    init = torch.nn.init.normal_
    layers = torch.nn.ModuleList([
        column(16, 32, config=config, init_method=init, bias=True),
        row(32, 16, config=config, init_method=init, bias=True, input_is_parallel=True),
        column(16, 24, config=config, init_method=init, bias=False),
        row(24, 16, config=config, init_method=init, bias=False, input_is_parallel=True),
    ])
    x = torch.randn(6, 2, 16, requires_grad=True)
    with counting_host_syncs() as syncs:
        for _ in range(2):  # two steps: the second scales from recorded histories
            for _ in range(3):
                with fp8_utils.get_fp8_context(config, layer_no=0):
                    hidden = x
                    for layer in layers:
                        hidden, _ = layer(hidden)
                hidden.sum().backward()
            fp8_utils.reduce_fp8_amaxes([layers])
    assert sum(syncs.values()) == 0, syncs
    assert x.grad is not None and torch.isfinite(x.grad).all()
    if recipe == "delayed":
        assert [layer.fp8_amax_recorded_count.tolist() for layer in layers] == [[2, 2, 2]] * 4
