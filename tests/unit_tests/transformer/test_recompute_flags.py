"""The recompute flags' rules, checked when the flags are validated (before any process group exists), with
messages that name the flags: upstream's rules, and the stage bound of `--recompute-method block`."""

import pytest

from megatron.training.model_config import core_transformer_config_from_args
from tests.unit_tests.training.argument_checks import validated

FULL = "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1"


@pytest.mark.parametrize(
    "extra, world_size, message",
    [
        # Upstream: "can distribute recomputed activations only across tensor model parallel groups".
        (f"{FULL} --distribute-saved-activations", 1,
         r"--distribute-saved-activations .* needs --tensor-model-parallel-size > 1 \(got 1\)"),
        ("--tensor-model-parallel-size 2 --distribute-saved-activations", 2,
         r"--distribute-saved-activations .* needs --recompute-granularity full"),
        (f"{FULL} --tensor-model-parallel-size 2 --sequence-parallel --distribute-saved-activations", 2,
         r"--distribute-saved-activations does not work with --sequence-parallel"),
        ("--recompute-granularity selective --recompute-method uniform --recompute-num-layers 1", 1,
         r"--recompute-method needs --recompute-granularity full"),
        ("--recompute-granularity full --recompute-method block", 1,
         r"--recompute-method needs --recompute-num-layers"),
        ("--recompute-granularity full --recompute-num-layers 1", 1,
         r"--recompute-granularity full needs --recompute-method"),
    ],
)
def test_recompute_flag_rules_name_the_flags(extra, world_size, message):
    with pytest.raises(ValueError, match=message):
        validated(extra, world_size)


def test_distributed_saved_activations_with_tensor_parallelism_reach_the_config():
    config = core_transformer_config_from_args(validated(f"{FULL} --tensor-model-parallel-size 2 "
                                                         "--distribute-saved-activations", world_size=2))
    assert config.distribute_saved_activations and config.tensor_model_parallel_size == 2


def test_block_recompute_counts_the_layers_of_one_pipeline_stage():
    stage = "--num-layers 4 --pipeline-model-parallel-size 2 --recompute-granularity full --recompute-method block"
    config = core_transformer_config_from_args(validated(f"{stage} --recompute-num-layers 2", world_size=2))
    assert (config.recompute_method, config.recompute_num_layers) == ("block", 2)
    with pytest.raises(ValueError, match=r"--recompute-num-layers \(3\) with --recompute-method block cannot exceed "
                                         r"the layers of one pipeline stage \(2"):
        core_transformer_config_from_args(validated(f"{stage} --recompute-num-layers 3", world_size=2))
