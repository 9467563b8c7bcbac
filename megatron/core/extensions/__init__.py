"""Integrations with optional NVIDIA libraries: Transformer Engine layers (`transformer_engine.py`) and
nvidia-modelopt quantization (`modelopt.py`). Each module imports its library only when used."""
