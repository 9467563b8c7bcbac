"""Serving a trained GPT checkpoint: loading it for generation (`launch`), the requests of the text-generation
server (`generation_request`), running one on every rank (`text_generation`) and the HTTP endpoint
(`text_generation_server`). The decoding itself (cache, sampling, loop) is `megatron.core.inference`."""
