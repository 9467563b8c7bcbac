"""`--tp-only-amax-red` (upstream's `TransformerConfig.tp_only_amax_red`): delayed-scaling amaxes are reduced over
the tensor-parallel group only, so data-parallel replicas keep the amaxes of their own data; by default every rank
of the pipeline stage agrees on them."""

import pytest

from tests.unit_tests.multiprocess_harness import run_on_ranks


def _input_histories_at_dp2():
    import torch
    import torch.distributed as dist

    from megatron.core import fp8_utils, parallel_state
    from megatron.core.extensions.transformer_engine import layer_classes
    from megatron.core.transformer.transformer_config import TransformerConfig

    parallel_state.initialize_model_parallel()
    histories = {}
    for tp_only in (False, True):
        config = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2, fp8="hybrid",
                                   fp8_recipe="delayed", fp8_amax_history_len=2, tp_only_amax_red=tp_only)
        torch.manual_seed(0)
        layer = layer_classes(config)[0](16, 16, config=config, init_method=torch.nn.init.normal_, bias=False)
        chunk = torch.nn.Module()
        chunk.layer, chunk.config = layer, config
        x = torch.full((4, 1, 16), 1.0 + dist.get_rank(), requires_grad=True)  # input amax 1 on rank 0, 2 on 1
        with fp8_utils.get_fp8_context(config, layer_no=0):
            out, _ = layer(x)
        out.sum().backward()
        fp8_utils.reduce_fp8_amaxes([chunk])
        histories[tp_only] = layer.fp8_amax_history[0].tolist()
    parallel_state.destroy_model_parallel()
    return histories


def test_tp_only_amax_reduction_leaves_data_parallel_replicas_their_own_amaxes():
    results = run_on_ranks(2, _input_histories_at_dp2)
    assert [result[False] for result in results] == [[2.0, 0.0], [2.0, 0.0]]
    assert [result[True] for result in results] == [[1.0, 0.0], [2.0, 0.0]]


@pytest.mark.parametrize("extra, expected", [("", False), ("--tp-only-amax-red", True)])
def test_tp_only_amax_red_flag_reaches_the_config(extra, expected):
    from megatron.training.model_config import core_transformer_config_from_args
    from tests.unit_tests.training.argument_checks import validated

    args = validated(f"--fp8-format hybrid {extra}")
    assert core_transformer_config_from_args(args).tp_only_amax_red is expected
