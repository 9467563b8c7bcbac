"""`GPTInferenceWrapper`, upstream's wrapper of a GPT model for the inference engine."""
