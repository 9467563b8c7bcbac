"""Enumerations shared by the core library and the training driver."""

import enum


class ModelType(enum.Enum):
    """What kind of model `pretrain()` trains; decoder-only (GPT) and encoder-only models are
    `encoder_or_decoder`."""

    encoder_or_decoder = 1
