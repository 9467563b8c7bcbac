"""The error of a Hugging Face conversion that cannot be exact."""


class ConversionError(ValueError):
    """The model or the directory cannot be converted exactly; the message names the flag or tensor."""
