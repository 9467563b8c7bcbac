"""--non-persistent-save-interval saves are reported as upstream: the `save-checkpoint-non-persistent` timer and a
"successfully saved" line naming the non-persistent directory, on the rank that prints checkpoint lines."""

import contextlib
import io
import os

from tests.unit_tests.multiprocess_harness import run_on_ranks

TINY_GPT = (
    "--num-layers 1 --hidden-size 32 --num-attention-heads 2 --seq-length 16 --micro-batch-size 2 "
    "--global-batch-size 8 --lr 1e-3 --mock-data --vocab-size 127 --make-vocab-size-divisible-by 64 "
    "--hidden-dropout 0 --attention-dropout 0 --num-workers 0 --log-interval 1 --eval-iters 0 "
    "--train-iters 3 --save-interval 3 --non-persistent-save-interval 2 --timing-log-option max"
)


def _pretrain_output(workdir):
    import pretrain_gpt
    from megatron.core.enums import ModelType
    from megatron.training.training import pretrain

    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        pretrain(pretrain_gpt.train_valid_test_datasets_provider, pretrain_gpt.model_provider,
                 ModelType.encoder_or_decoder, pretrain_gpt.forward_step, argv=f"{TINY_GPT} --save {workdir}".split())
    return stdout.getvalue()


def test_non_persistent_save_is_timed_and_reported(tmp_path):
    first_rank, last_rank = run_on_ranks(2, _pretrain_output, str(tmp_path))
    saved = f"  successfully saved non-persistent checkpoint from iteration       2 to {tmp_path}/non_persistent"
    assert first_rank.splitlines().count(saved) == 1 and saved not in last_rank
    assert last_rank.count("    save-checkpoint-non-persistent .") == 1  # printed by the last rank, as all timers
    assert sorted(os.listdir(tmp_path / "non_persistent")) == ["iter_0000002", "latest_checkpointed_iteration.txt"]
