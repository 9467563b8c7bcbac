"""Upstream's text generation controllers: `TextGenerationController` (and its older name
`SimpleTextGenerationController`)."""
