"""What a launched process loads at start-up: `import pretrain_gpt` (every torchrun rank and subprocess test pays
it) leaves torch.distributed.tensor and torch.distributed.checkpoint (about a second to import) to the code that
uses DTensors or writes checkpoints."""

import os
import subprocess
import sys

REPOSITORY = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir, os.pardir))
SLOW_MODULES = ("torch.distributed.tensor", "torch.distributed.checkpoint")


def test_import_pretrain_gpt_leaves_dtensor_and_checkpointing_unloaded():
    probe = f"import sys, pretrain_gpt\nprint(sorted(set({SLOW_MODULES!r}) & set(sys.modules)))"
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=REPOSITORY)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.splitlines()[-1] == "[]"
