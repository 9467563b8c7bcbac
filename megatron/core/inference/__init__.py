"""Static-batch text generation: the key/value cache (`contexts`), what decoding supports (`model_checks`), the
sampling rules (`sampling_params`, `sampling`), a step through pipeline stages (`pipeline_decoding`), the
broadcasts of the sampled tokens (`communication`) and the generation loop (`static_generation`); upstream's API over
that loop: `engines.StaticInferenceEngine`, `text_generation_controllers`, `model_inference_wrappers` and
`inference_request`."""
