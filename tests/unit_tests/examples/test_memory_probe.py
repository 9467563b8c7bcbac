"""The benchmark's per-arm peak RSS: the kernel's high-water mark where it can be reset, a sampling thread elsewhere."""

import threading
import time

import pytest
import torch

from examples.megatron_fsdp import memory_probe

MIB = 2**20
SPIKE_BYTES = 256 * MIB


def _touch_and_free(hold_s: float = 0.0):
    spike = torch.ones(SPIKE_BYTES // 4, dtype=torch.float32)  # every page written, so resident
    time.sleep(hold_s)
    del spike


@pytest.mark.skipif(not memory_probe.reset_kernel_peak_rss(), reason="the kernel's RSS high-water mark cannot be "
                    "reset here (not Linux >= 4.0, or /proc/self/clear_refs not writable)")
def test_kernel_peak_sees_a_freed_spike_without_a_sampling_thread():
    threads_before = threading.active_count()
    sampler = memory_probe.RssSampler().start()
    assert sampler.uses_kernel_peak
    assert threading.active_count() == threads_before  # nothing runs beside the arm
    _touch_and_free()
    peak = sampler.stop()
    # The spike was freed before stop(): only a high-water mark sees it, and it sees all of it.
    assert peak - sampler.baseline >= SPIKE_BYTES - 8 * MIB
    assert memory_probe.current_rss_bytes() < peak - 200 * MIB
    assert sampler.lifetime_peak_at_start > 0


def test_sampling_thread_where_the_kernel_peak_cannot_be_reset(monkeypatch):
    monkeypatch.setattr(memory_probe, "reset_kernel_peak_rss", lambda: False)
    threads_before = threading.active_count()
    sampler = memory_probe.RssSampler(period_s=0.001).start()
    assert not sampler.uses_kernel_peak
    assert threading.active_count() == threads_before + 1
    _touch_and_free(hold_s=0.2)  # held for 200 sampling periods
    peak = sampler.stop()
    assert threading.active_count() == threads_before
    assert peak - sampler.baseline >= SPIKE_BYTES - 8 * MIB


def test_kernel_peak_reads_vmhwm_in_bytes():
    peak = memory_probe.kernel_peak_rss_bytes()
    if peak == 0:
        pytest.skip("no VmHWM in /proc/self/status on this system")
    assert peak >= memory_probe.current_rss_bytes() - 4 * MIB  # the high-water mark is never below the RSS
    assert peak % 1024 == 0
