"""--ckpt-convert-format F --ckpt-convert-save DIR writes into DIR/F as upstream's setup_model_and_optimizer does,
prints upstream's "> converted checkpoint: <load format> -> <F>." line, and adds to a DIR/F that already holds
checkpoints as a --save there would."""

import contextlib
import io
import os

import pytest

from tests.unit_tests.multiprocess_harness import run_on_ranks

SCHEDULE = "--train-iters 2 --lr-decay-iters 2 --lr-warmup-iters 0 --global-batch-size 2 --num-layers 1"


def _pretrain(extra_args):
    """pretrain() with the tiny GPT and `extra_args`; returns (the iteration it returned, what rank 0 printed)."""
    import pretrain_gpt
    from megatron.core.enums import ModelType
    from megatron.training.training import pretrain
    from tests.unit_tests.dist_checkpointing.pretrain_helpers import tiny_gpt_argv

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        iteration = pretrain(pretrain_gpt.train_valid_test_datasets_provider, pretrain_gpt.model_provider,
                             ModelType.encoder_or_decoder, pretrain_gpt.forward_step,
                             argv=tiny_gpt_argv(f"{SCHEDULE} {extra_args}").split())
    return iteration, printed.getvalue()


def _convert_twice(workdir):
    """Save torch checkpoints of iterations 1 and 2, convert iteration 1 then 2 into the same DIR; returns what
    DIR and DIR/torch_dist hold, the tracker and both conversions' output."""
    from megatron.training.checkpointing import read_tracker

    legacy, converted = os.path.join(workdir, "legacy"), os.path.join(workdir, "converted")
    _pretrain(f"--ckpt-format torch --save {legacy} --save-interval 1")
    convert = f"--ckpt-format torch --load {legacy} --ckpt-convert-format torch_dist --ckpt-convert-save {converted}"
    first = _pretrain(f"{convert} --ckpt-step 1")
    second = _pretrain(convert)
    return (sorted(os.listdir(converted)), sorted(os.listdir(os.path.join(converted, "torch_dist"))),
            read_tracker(os.path.join(converted, "torch_dist")), first, second)


@pytest.mark.world_size(1)
def test_conversion_goes_into_the_format_subdirectory_and_adds_to_it(tmp_path):
    directory, subdirectory, tracker, first, second = run_on_ranks(1, _convert_twice, str(tmp_path))[0]
    assert directory == ["torch_dist"]
    assert subdirectory == ["iter_0000001", "iter_0000002", "latest_checkpointed_iteration.txt"] and tracker == 2
    for (iteration, printed), expected in zip((first, second), (1, 2)):
        assert iteration == expected
        assert "> converted checkpoint: torch -> torch_dist." in printed
        assert f"to {tmp_path / 'converted' / 'torch_dist'} (train from it with --load " in printed


def test_a_conversion_into_the_load_directory_is_refused_naming_the_flags(tmp_path):
    from megatron.training.arguments import parse_args, validate_args

    root = tmp_path / "root"
    argv = (f"--num-layers 1 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --max-position-embeddings 16 "
            f"--micro-batch-size 1 --train-iters 1 --lr 0 --mock-data --tokenizer-type NullTokenizer --vocab-size 8 "
            f"--load {root / 'torch_dist'} --ckpt-format torch --ckpt-convert-format torch_dist "
            f"--ckpt-convert-save {root}")
    with pytest.raises(ValueError, match=f"--ckpt-convert-save {root} writes into {root / 'torch_dist'}, which is "
                                         "--load: give another --ckpt-convert-save"):
        validate_args(parse_args(args=argv.split()))
