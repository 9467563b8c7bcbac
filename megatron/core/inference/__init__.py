"""Static-batch text generation: the key/value cache (`contexts`), what decoding supports (`model_checks`), the
sampling rules (`sampling_params`, `sampling`), the tensor-parallel token broadcast (`communication`) and the
generation loop (`static_generation`)."""
