"""As upstream, `initialize_megatron()` sets up the globals a script reads next (`get_tokenizer()` with
`args.padded_vocab_size`, `get_num_microbatches()`, `get_current_global_batch_size()`, `get_timers()`), and
`pretrain()` uses them without building them again."""

import os
import signal
from unittest import mock

import pytest

from megatron.core import num_microbatches_calculator
from megatron.core.timers import Timers
from megatron.training import global_vars, training
from megatron.training.initialize import initialize_megatron, tokenizer_set_up_for
from tests.unit_tests.training.argument_checks import BASE

LAUNCH_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
PADDED_LINE = " > padded vocab (size: 129) with 127 dummy tokens (new size: 256)\n"  # NullTokenizer 128 + EOD


def _launcher_free(**environment):
    kept = {key: value for key, value in os.environ.items() if key not in LAUNCH_VARIABLES}
    return mock.patch.dict(os.environ, dict(kept, **environment), clear=True)


def _add_script_flag(parser):
    parser.add_argument("--answer", type=int, default=0)
    return parser


def test_a_script_reads_the_tokenizer_and_microbatches_after_initialize_megatron(capsys):
    """Upstream's tool pattern: initialize_megatron(extra_args_provider=...), then get_tokenizer() and
    get_num_microbatches(); here for rank 0 of two data-parallel ranks."""
    argv = f"{BASE} --global-batch-size 8 --answer 42".split()
    with _launcher_free(RANK="0", WORLD_SIZE="2"):
        args = initialize_megatron(extra_args_provider=_add_script_flag, args=argv, skip_mpu_initialization=True)
    try:
        assert args.answer == 42 and global_vars.get_args() is args
        tokenizer = global_vars.get_tokenizer()
        assert (tokenizer.vocab_size, tokenizer.eod, args.padded_vocab_size) == (129, 128, 256)
        assert num_microbatches_calculator.get_num_microbatches() == 2  # 8 / (micro batch 2 x 2 data-parallel)
        assert num_microbatches_calculator.get_current_global_batch_size() == 8
        assert isinstance(global_vars.get_timers(), Timers)
        printed = capsys.readouterr().out
        assert PADDED_LINE in printed and printed.count(" > padded vocab") == 1
        assert tokenizer_set_up_for(args) is tokenizer

        # Called again (a script setting up a second configuration), it replaces the globals.
        with _launcher_free(RANK="0", WORLD_SIZE="1"):
            by_samples = BASE.replace("--train-iters 10", "--train-samples 100")
            again = initialize_megatron(args=f"{by_samples} --global-batch-size 6 --rampup-batch-size 2 2 16".split(),
                                        skip_mpu_initialization=True)
        assert num_microbatches_calculator.get_num_microbatches() == 1  # the ramp-up's first global batch: 2
        assert num_microbatches_calculator.get_current_global_batch_size() == 2
        assert global_vars.get_tokenizer() is not tokenizer and tokenizer_set_up_for(args) is None
        assert PADDED_LINE in capsys.readouterr().out
        assert again.padded_vocab_size == 256
    finally:
        global_vars.unset_global_variables()


def test_a_tokenizer_that_cannot_be_built_leaves_no_globals_behind(tmp_path):
    before = signal.getsignal(signal.SIGUSR1)
    argv = (f"{BASE} --global-batch-size 4 --tokenizer-type GPT2BPETokenizer --vocab-file {tmp_path}/vocab.json "
            f"--merge-file {tmp_path}/merges.txt --exit-signal-handler --exit-signal SIGUSR1").split()
    with _launcher_free(RANK="0", WORLD_SIZE="1"), pytest.raises((FileNotFoundError, ValueError), match="vocab"):
        initialize_megatron(args=argv, skip_mpu_initialization=True)
    assert signal.getsignal(signal.SIGUSR1) is before
    for getter in (global_vars.get_tokenizer, num_microbatches_calculator.get_num_microbatches):
        with pytest.raises(RuntimeError):
            getter()
    global_vars.unset_global_variables()


class _StopBeforeTheModel(Exception):
    pass


def test_pretrain_uses_what_initialize_megatron_set_up_and_prints_the_padding_once(capsys):
    seen = {}

    def set_up_model(model_provider, args):  # what pretrain() holds when it comes to build the model
        seen.update(tokenizer=global_vars.get_tokenizer(), rows=args.padded_vocab_size,
                    microbatches=num_microbatches_calculator.get_num_microbatches())
        raise _StopBeforeTheModel

    from megatron.training import tokenizer as tokenizer_module

    builds = []

    def counted_build(args):
        builds.append(args)
        return build(args)

    build = tokenizer_module.build_tokenizer_from_args
    with _launcher_free(RANK="0", WORLD_SIZE="1"), \
            mock.patch.object(tokenizer_module, "build_tokenizer_from_args", counted_build), \
            mock.patch.object(training, "setup_model_and_optimizer", set_up_model), \
            pytest.raises(_StopBeforeTheModel):
        training.pretrain(None, None, "encoder_or_decoder", None,
                          argv=f"{BASE} --global-batch-size 8".split())
    assert len(builds) == 1  # initialize_megatron()'s, which pretrain() reuses
    assert (seen["tokenizer"].vocab_size, seen["rows"], seen["microbatches"]) == (129, 256, 4)
    printed = capsys.readouterr().out
    assert PADDED_LINE in printed and printed.count(" > padded vocab") == 1
    global_vars.unset_global_variables()


def test_use_checkpoint_args_pads_the_tokenizer_to_the_checkpoints_rows(monkeypatch, capsys):
    """--use-checkpoint-args: the tokenizer initialize_megatron() builds keeps the checkpoint's embedding rows (384
    here, where --make-vocab-size-divisible-by 128 would give 256), and the padded-vocab line says so."""
    from types import SimpleNamespace

    from megatron.training import checkpoint_sources

    saved = SimpleNamespace(hidden_size=64, tokenizer_type="NullTokenizer", vocab_size=128, padded_vocab_size=384)
    monkeypatch.setattr(checkpoint_sources, "checkpoint_to_load", lambda args: SimpleNamespace(directory=args.load))
    monkeypatch.setattr(checkpoint_sources, "saved_args", lambda source: saved)
    with _launcher_free(RANK="0", WORLD_SIZE="1"):
        args = initialize_megatron(args=f"{BASE} --global-batch-size 2 --use-checkpoint-args --load /ckpt".split(),
                                   skip_mpu_initialization=True)
    try:
        assert args.padded_vocab_size == 384 and global_vars.get_tokenizer().vocab_size == 129
        printed = capsys.readouterr().out
        assert " > padded vocab (size: 129) with 255 dummy tokens (new size: 384)\n" in printed
        assert printed.count(" > padded vocab") == 1
    finally:
        global_vars.unset_global_variables()
