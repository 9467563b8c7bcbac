"""`--optimizer muon` and the `--muon-*` flags: upstream's defaults, what reaches OptimizerConfig, every
data-parallel wrapper accepted."""

from functools import partial

import pytest

from megatron.training.model_config import optimizer_config_from_args
from tests.unit_tests.training import argument_checks

validated = partial(argument_checks.validated, base=f"{argument_checks.BASE} --optimizer muon")


def test_upstream_defaults_reach_the_optimizer_config():
    config = optimizer_config_from_args(validated())
    assert config.optimizer == "muon"
    assert (config.muon_momentum, config.muon_use_nesterov, config.muon_num_ns_steps) == (0.95, False, 5)
    assert (config.muon_scale_mode, config.muon_extra_scale_factor, config.muon_split_qkv) == ("spectral", 1.0, True)
    assert (config.muon_fp32_matmul_prec, config.muon_tp_mode) == ("medium", "blockwise")


def test_flags_reach_the_optimizer_config():
    config = optimizer_config_from_args(validated(
        "--muon-momentum 0.9 --muon-use-nesterov --muon-num-ns-steps 3 --muon-scale-mode unit_rms_norm "
        "--muon-extra-scale-factor 0.2 --muon-no-split-qkv --muon-fp32-matmul-prec high --muon-tp-mode duplicated"))
    assert (config.muon_momentum, config.muon_use_nesterov, config.muon_num_ns_steps) == (0.9, True, 3)
    assert (config.muon_scale_mode, config.muon_extra_scale_factor, config.muon_split_qkv) == ("unit_rms_norm", 0.2,
                                                                                               False)
    assert (config.muon_fp32_matmul_prec, config.muon_tp_mode) == ("high", "duplicated")
    assert validated("--muon-no-split-qkv --muon-split-qkv").muon_split_qkv is True


@pytest.mark.parametrize("flags,dest", [("--use-distributed-optimizer", "use_distributed_optimizer"),
                                        ("--use-megatron-fsdp", "use_megatron_fsdp"),
                                        ("--use-torch-fsdp2 --ckpt-format torch_dist "
                                         "--untie-embeddings-and-output-weights", "use_torch_fsdp2")])
def test_sharded_data_parallel_is_accepted(flags, dest):
    args = validated(flags)
    assert args.optimizer == "muon" and getattr(args, dest) is True


@pytest.mark.parametrize("flags,message", [("--muon-momentum 1.0", "--muon-momentum"),
                                           ("--muon-num-ns-steps 0", "--muon-num-ns-steps"),
                                           ("--muon-extra-scale-factor -1", "--muon-extra-scale-factor")])
def test_bad_values_are_refused(flags, message):
    with pytest.raises(ValueError, match=message):
        validated(flags)


@pytest.mark.parametrize("flags", ["--muon-scale-mode rms", "--muon-tp-mode sharded",
                                   "--muon-fp32-matmul-prec highest"])
def test_unknown_choices_stop_the_parser(flags, capsys):
    with pytest.raises(SystemExit):
        validated(flags)
    assert "invalid choice" in capsys.readouterr().err


def test_precision_aware_optimizer_stays_adam_only():
    with pytest.raises(ValueError, match="--use-precision-aware-optimizer steps Adam only"):
        validated("--use-precision-aware-optimizer")


@pytest.mark.parametrize("saved,current", [("adam", "muon"), ("muon", "adam"), ("adam", "sgd"), ("sgd", "adam")])
def test_resuming_another_optimizers_state_says_what_to_do(saved, current):
    """A torch-format checkpoint's optimizer check (torch_dist calls the same one before loading the state)."""
    from argparse import Namespace

    from megatron.core.dist_checkpointing.serialization import CheckpointError
    from megatron.training.checkpointing import _why_optimizer_not_loaded

    saved_args = Namespace(optimizer=saved, use_distributed_optimizer=False)
    args = Namespace(optimizer=current, use_distributed_optimizer=False, finetune=False, no_load_optim=False)
    with pytest.raises(CheckpointError, match=f"saved with --optimizer {saved}.*--no-load-optim.*--optimizer {saved}"):
        _why_optimizer_not_loaded({"optimizer": {}}, saved_args, args, "ckpt")
    saved_args.optimizer = current
    assert _why_optimizer_not_loaded({"optimizer": {}}, saved_args, args, "ckpt") is None
    saved_args.optimizer, args.no_load_optim = saved, True
    assert _why_optimizer_not_loaded({"optimizer": {}}, saved_args, args, "ckpt") == "--no-load-optim"
