"""`SimpleTextGenerationController`: upstream's older name of `TextGenerationController`."""

from megatron.core.inference.text_generation_controllers.text_generation_controller import (
    TextGenerationController,
)


class SimpleTextGenerationController(TextGenerationController):
    """The same controller under its older name."""
