"""The memory monitor: host RSS read from /proc, TensorBoard scalars, the PNG plot, the peak summary."""

from __future__ import annotations

import json

import pytest
import torch
from PIL import Image

from leantune.memory.monitor import MemoryMonitor, MemorySample, host_rss

GiB = 2**30


def test_host_rss_follows_a_real_allocation():
    """RSS grows by a 64 MiB block written so its pages are resident. The block is a fresh anonymous
    mapping (not the allocator's, which may hand back pages a previous test freed and left
    resident). The process's other threads (a previous test's writer or lane) may free memory in
    the same instant, so the growth is looked for over a few blocks kept alive, not in one reading."""
    import mmap

    blocks, grown = [], []
    for _ in range(3):
        before, _ = host_rss()
        block = mmap.mmap(-1, 64 * 2**20)
        block.write(b"\x01" * len(block))          # every page touched: resident
        blocks.append(block)
        after, peak = host_rss()
        assert peak >= after
        grown.append(after - before)
        if grown[-1] >= 48 * 2**20:
            break
    assert max(grown) >= 48 * 2**20, grown
    for block in blocks:
        block.close()


def test_record_on_cpu_logs_rss_and_tensorboard_scalars(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(tmp_path / "tb"))
    monitor = MemoryMonitor(tmp_path, predicted_peak_bytes=3 * GiB)
    lines = [monitor.record(step, writer) for step in (1, 2, 3)]
    writer.close()
    assert all(line.startswith("rss ") and line.endswith(" GiB") for line in lines)
    assert [s.step for s in monitor.samples] == [1, 2, 3]
    assert all(s.allocated is None and s.rss > 0 for s in monitor.samples)     # no GPU: VRAM columns absent
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    rss = events.Scalars("memory/host_rss_gib")
    assert [e.step for e in rss] == [1, 2, 3]
    assert rss[0].value == pytest.approx(monitor.samples[0].rss / GiB, rel=1e-6)
    assert "memory/vram_allocated_gib" not in events.Tags()["scalars"]


def _gpu_like_monitor(tmp_path, predicted):
    """A monitor holding samples as a CUDA run records them (values chosen, not measured)."""
    monitor = MemoryMonitor(tmp_path, predicted_peak_bytes=predicted)
    for step, alloc in enumerate((4.0, 4.4, 4.2), start=1):
        monitor.samples.append(MemorySample(step=step, rss=int(9 * GiB), rss_peak=int(10 * GiB),
                                            allocated=int(alloc * GiB), reserved=int((alloc + 0.5) * GiB),
                                            peak_allocated=int((alloc + 1.0) * GiB),
                                            peak_reserved=int((alloc + 1.5) * GiB)))
    return monitor


def test_summary_reports_peaks_and_the_prediction_error(tmp_path):
    monitor = _gpu_like_monitor(tmp_path, predicted=5 * GiB)
    text = monitor.summary()
    assert "peak VRAM allocated 5.40 GiB, reserved 5.90 GiB" in text
    assert "predicted 5.00 GiB (+8.0%)" in text
    assert "peak host RSS 10.00 GiB" in text and text.startswith("memory over 3 steps")
    assert MemoryMonitor(tmp_path).summary() == "memory: no step recorded"
    line = MemoryMonitor.describe(monitor.samples[1])
    assert line == "vram 4.40/4.90 GiB (peak 5.40) rss 9.0 GiB"


@pytest.mark.parametrize("gpu_samples,predicted,height", [(False, None, 350), (False, 2 * GiB, 600),
                                                           (True, 5 * GiB, 600)])
def test_plot_is_a_real_png(tmp_path, gpu_samples, predicted, height):
    if gpu_samples:
        monitor = _gpu_like_monitor(tmp_path, predicted)
    else:
        monitor = MemoryMonitor(tmp_path, predicted_peak_bytes=predicted)
        for step in range(1, 5):
            monitor.record(step)
    path = monitor.plot(tmp_path / "plots" / "memory.png")
    with Image.open(path) as img:
        assert img.format == "PNG"
        assert img.size == (800, height)            # two panels (VRAM with the predicted line, RSS) or one
        assert len(set(img.convert("L").getdata())) > 10   # something was drawn
    assert not list((tmp_path / "plots").glob(".*.tmp"))   # written atomically: no leftover temporary


def test_save_round_trips_the_samples(tmp_path):
    monitor = _gpu_like_monitor(tmp_path, predicted=5 * GiB)
    data = json.loads(monitor.save().read_text())
    assert data["predicted_peak_bytes"] == 5 * GiB
    assert data["peaks"]["peak_allocated"] == int(5.4 * GiB)
    assert [MemorySample(**s) for s in data["samples"]] == monitor.samples


@pytest.mark.gpu
def test_record_on_cuda_reports_per_step_peaks(tmp_path):
    monitor = MemoryMonitor(tmp_path)
    monitor.record(0)
    x = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")
    del x
    monitor.record(1)
    monitor.record(2)
    _, s1, s2 = monitor.samples
    assert s1.peak_allocated - s1.allocated >= 256 * 2**20       # the freed tensor shows in step 1's peak
    assert s2.peak_allocated < s1.peak_allocated                 # and not in step 2's: peaks are reset
