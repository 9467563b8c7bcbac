"""The TensorBoard writer built from the logging flags."""

import argparse

import pytest

from megatron.training import arguments, scalar_writers


def test_tensorboard_queue_size_reaches_the_writer(tmp_path):
    pytest.importorskip("tensorboard", reason="TensorBoard is an optional dependency")
    args = argparse.Namespace(tensorboard_dir=str(tmp_path), tensorboard_queue_size=7, wandb_project="")
    writers = scalar_writers.build_scalar_writers(args)
    try:
        (writer,) = writers.writers
        # tensorboard's event writer bounds its queue of serialized events by max_queue.
        assert writer._get_file_writer().event_writer._async_writer._byte_queue.maxsize == 7
    finally:
        writers.close()


def test_tensorboard_queue_size_defaults_to_upstreams_and_must_be_positive():
    base = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
            "--micro-batch-size", "2", "--train-iters", "2", "--lr", "1e-3", "--mock-data", "--vocab-size", "128"]
    assert arguments.parse_args(args=base).tensorboard_queue_size == 1000
    args = arguments.parse_args(args=base + ["--tensorboard-queue-size", "0"])
    with pytest.raises(ValueError, match=r"^--tensorboard-queue-size must be positive, got 0$"):
        arguments.validate_args(args)


def test_missing_tensorboard_is_reported_and_the_run_goes_on(tmp_path, monkeypatch, capsys):
    """As upstream, --tensorboard-dir without TensorBoard installed writes no scalars instead of stopping the run;
    a message names the flag and the package."""
    import sys

    monkeypatch.setitem(sys.modules, "tensorboard", None)  # `import tensorboard` raises ImportError
    monkeypatch.delitem(sys.modules, "torch.utils.tensorboard", raising=False)
    args = argparse.Namespace(tensorboard_dir=str(tmp_path / "tb"), tensorboard_queue_size=7, wandb_project="")
    assert scalar_writers.build_scalar_writers(args) is None
    message = capsys.readouterr().out
    assert message.startswith(f"--tensorboard-dir {tmp_path / 'tb'}: no TensorBoard scalars are written")
    assert "pip install tensorboard" in message
