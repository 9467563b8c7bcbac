"""The tiny model the argument tests start from, and `validated`: its flags plus a test's own, parsed and
validated as pretrain_gpt.py does, on the rank and world size a launcher would give."""

import os
from unittest import mock

from megatron.training.arguments import parse_args, validate_args

BASE = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --micro-batch-size 2 "
        "--train-iters 10 --lr 1e-3 --mock-data --vocab-size 128")


def validated(extra="", world_size=1, rank=0, *, base=BASE):
    """`validate_args(parse_args(base + extra))` with WORLD_SIZE / RANK set for the call (validation reads them)
    and restored after it. A later flag wins over an earlier one, so `extra` may also change a value of `base`."""
    with mock.patch.dict(os.environ, {"WORLD_SIZE": str(world_size), "RANK": str(rank)}):
        return validate_args(parse_args(args=f"{base} {extra}".split()))
