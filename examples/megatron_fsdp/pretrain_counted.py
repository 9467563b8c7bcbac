"""One rank of `pretrain_gpt.py` with its collective traffic counted (started by `pretrain_benchmark.py`).

    torchrun --nproc-per-node 2 examples/megatron_fsdp/pretrain_counted.py <pretrain_gpt.py flags>

The counter (`comm_counter.install()`) wraps torch.distributed's collectives before the training code is
imported, then counts only inside `train_step` calls after the first `COUNT_AFTER_ITERATIONS` (warm-up, setup
broadcasts and evaluation stay out). At exit every rank writes its counts to
`$PRETRAIN_COUNTS_DIR/rank<R>.json`: per-kind payload bytes, wire bytes and the number of counted steps.
"""

import json
import os
import runpy
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

from examples.megatron_fsdp import comm_counter  # noqa: E402

COUNTER = comm_counter.install()
COUNT_AFTER_ITERATIONS = int(os.environ.get("PRETRAIN_COUNT_AFTER", "1"))


def _count_train_steps():
    """Wrap `megatron.training.training.train_step` so that steps after the warm-up are counted."""
    from megatron.training import training

    original = training.train_step
    calls = {"seen": 0, "counted": 0}

    def counted_train_step(*args, **kwargs):
        calls["seen"] += 1
        if calls["seen"] <= COUNT_AFTER_ITERATIONS:
            return original(*args, **kwargs)
        calls["counted"] += 1
        with COUNTER.counting():
            return original(*args, **kwargs)

    training.train_step = counted_train_step
    return calls


def _write_counts(calls):
    directory = os.environ.get("PRETRAIN_COUNTS_DIR")
    if not directory:
        return
    os.makedirs(directory, exist_ok=True)
    record = {"counted_steps": calls["counted"], **COUNTER.snapshot()}
    with open(os.path.join(directory, f"rank{os.environ.get('RANK', '0')}.json"), "w") as stream:
        json.dump(record, stream)


def main():
    calls = _count_train_steps()
    sys.argv = [os.path.join(REPO_ROOT, "pretrain_gpt.py")] + sys.argv[1:]
    try:
        runpy.run_path(sys.argv[0], run_name="__main__")
    finally:
        _write_counts(calls)


if __name__ == "__main__":
    main()
