"""GPT generation examples (`gpt_static_inference.py`)."""
