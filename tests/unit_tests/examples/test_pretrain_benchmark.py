"""The pretrain_gpt.py benchmark's summary, table and doc update (no training launched here)."""

import pytest

from examples.megatron_fsdp import pretrain_benchmark as bench

MIB = 1024 * 1024


def _run(times, losses, params, grads, optimizer, wire_bytes, steps=2):
    records = [{"iteration-time": t, "lm loss": loss, "params-bytes": params, "grads-bytes": grads,
                "optimizer-state-bytes": optimizer} for t, loss in zip(times, losses)]
    counts = [{"counted_steps": steps, "wire_bytes": wire_bytes}, {"counted_steps": steps, "wire_bytes": wire_bytes / 2}]
    return {"records": records, "counts": counts}


def test_summary_takes_medians_after_warmup_and_the_busiest_rank():
    runs = [_run([9.0, 1.0, 2.0, 3.0], [5, 4, 3, 2], 8 * MIB, 8 * MIB, 16 * MIB, 10 * MIB),
            _run([9.0, 4.0, 5.0, 6.0], [5, 4, 3, 2], 8 * MIB, 8 * MIB, 16 * MIB, 10 * MIB)]
    summary = bench.summarise_arm("ddp", runs, warmup=1, seq_length=128, global_batch=8)
    assert summary["step_spread"] == [2.0, 5.0]
    assert summary["step_s"] == pytest.approx(3.5)
    assert summary["tokens_per_s"] == pytest.approx(8 * 128 / 3.5)
    assert summary["sent_per_step"] == pytest.approx(5 * MIB)  # 10 MiB over 2 counted steps on rank 0


def test_failed_arm_reports_its_last_error_line():
    summary = bench.summarise_arm("fsdp2", [{"error": "trace\nValueError: bad flag"}], 1, 128, 8)
    assert summary == {"arm": "fsdp2", "error": "ValueError: bad flag"}


def test_table_compares_state_with_zero_theory_and_losses_with_ddp():
    param_bytes = 8 * MIB
    ddp = {"arm": "ddp", "step_s": 2.0, "step_spread": [2.0], "tokens_per_s": 512.0, "sent_per_step": 8 * MIB,
           "state": {"params": param_bytes, "grads": param_bytes, "optimizer": 2 * param_bytes},
           "losses": [5.0, 4.0]}
    # ZeRO-3 over 2 ranks: half of everything; a 1e-6 loss difference.
    zero3 = {"arm": "mfsdp3", "step_s": 2.2, "step_spread": [2.2], "tokens_per_s": 465.0, "sent_per_step": 12 * MIB,
             "state": {"params": param_bytes / 2, "grads": param_bytes / 2, "optimizer": param_bytes * 1.1},
             "losses": [5.0, 4.000001]}
    table = bench.render([ddp, zero3], {"model": "tiny", "iters": 4, "repeats": 1, "warmup": 1,
                                        "machine": "cpu", "date": "today"})
    rows = {line.split("|")[1].strip(): [cell.strip() for cell in line.split("|")[2:-1]]
            for line in table.splitlines() if line.startswith("| ") and not line.startswith("| arm")}
    assert rows["ddp"][1] == "1.00" and rows["ddp"][4] == "1.00" and rows["ddp"][6] == "0"
    step_vs_ddp, state, state_vs_theory, sent, dloss = (rows["mfsdp3"][i] for i in (1, 3, 4, 5, 6))
    assert step_vs_ddp == "1.10"  # 2.2 s / 2.0 s
    assert state == "4.0 / 4.0 / 8.8"
    assert state_vs_theory == "1.05"  # 16.8 MiB held / 16 MiB of ZeRO-3 theory (4 + 4 + 8)
    assert sent == "12.0"
    assert float(dloss) == pytest.approx(1e-6, rel=1e-3)


def test_doc_section_is_replaced_in_place(tmp_path):
    doc = tmp_path / "bench.md"
    doc.write_text("# Benchmarks\n\nintro\n")
    bench.update_doc(str(doc), f"{bench.SECTION_START}\nfirst\n{bench.SECTION_END}\n")
    doc.write_text(doc.read_text() + "\n## later section\n")
    bench.update_doc(str(doc), f"{bench.SECTION_START}\nsecond\n{bench.SECTION_END}\n")
    text = doc.read_text()
    assert "first" not in text and text.count("second") == 1
    assert text.index("intro") < text.index("second") < text.index("## later section")


def test_distributed_optimizer_theory_has_no_fp32_main_shard_copy():
    param_bytes = 8 * MIB
    assert bench.theory_bytes("distopt", param_bytes) == {"params": 8 * MIB, "grads": 8 * MIB,
                                                          "optimizer": 8 * MIB}
    assert bench.theory_bytes("mfsdp1", param_bytes)["optimizer"] == 8 * MIB
