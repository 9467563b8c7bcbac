"""Errors of reading a checkpoint, shared by the serialization and the checkpoint-directory code."""


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be read as asked: the message names the file or tensor and what to do."""


class CheckpointShapeError(CheckpointError):
    pass
