"""Benchmark of Megatron-FSDP (ZeRO-0..3) against torch DDP and torch FSDP2 on one GPT-like model.

`benchmark.py` is the program; the other files are its parts: the model (`bench_model.py`), how each arm wraps
it (`bench_arms.py`), what one measurement does on a rank (`bench_worker.py`), the collective counter
(`comm_counter.py`), memory probes (`memory_probe.py`), and pure arithmetic and formatting (`bench_theory.py`,
`bench_report.py`).
"""
