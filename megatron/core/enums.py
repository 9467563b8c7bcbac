"""Enumerations shared by the core library and the training driver."""

import enum


class ModelType(enum.Enum):
    """What kind of model `pretrain()` trains; decoder-only (GPT) and encoder-only models are
    `encoder_or_decoder`."""

    encoder_or_decoder = 1


class Fp8Recipe(str, enum.Enum):
    """The FP8 scaling recipes (`--fp8-recipe`, `TransformerConfig.fp8_recipe`). Members are strings, so
    `TransformerConfig(fp8_recipe=Fp8Recipe.tensorwise)` and `fp8_recipe="tensorwise"` are the same setting.
    `delayed` and `tensorwise` run on any device; `mxfp8` and `blockwise` need Transformer Engine on a GPU;
    `custom` (a user quantizer factory) is not supported here."""

    delayed = "delayed"
    tensorwise = "tensorwise"
    mxfp8 = "mxfp8"
    blockwise = "blockwise"
    custom = "custom"

    def __str__(self):
        return self.value
