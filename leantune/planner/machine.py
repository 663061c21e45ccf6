"""What the machine can do: free VRAM, host-to-device bandwidth, compute speed, host RAM.

The planner predicts a step time from compute versus exposed transfer, so it needs three rates:
how fast weights cross PCIe (pinned and pageable), how fast the GPU computes a transformer block,
and how fast device memory is (fp8 dequantisation and copy/compute contention cost HBM traffic).
With a GPU they are measured by a short probe (about a second: a few 256 MiB copies and a few bf16
matmuls); without one the planner uses assumed values for a typical consumer card on PCIe Gen4
(RTX 4090 class, about 25 GB/s pinned) and says so in its report, so `leantune plan` works on a
laptop with no GPU. Host RAM is read from /proc/meminfo (no psutil dependency). torch is imported
only to probe a GPU, so that a repeated `leantune plan` without one can answer without it.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from ..host import host_ram

if TYPE_CHECKING:
    import torch

GiB = 2**30

# Assumed rates without a GPU to measure. PCIe Gen4 x16 measures 24-27 GB/s pinned; pageable copies
# are 1.2-1.5x slower for large buffers. 70 TFLOP/s is the sustained bf16 rate a 4090 reaches in a
# Flux training step (about 42% of its 165 TFLOP/s dense peak); HBM ~1 TB/s.
ASSUMED = dict(
    h2d_pinned=25e9,
    h2d_pageable=18e9,
    d2h=25e9,
    flops=70e12,
    hbm=1.0e12,
)
# A measured 8192^3 bf16 GEMM is the best case; a transformer step (attention, norms, small
# LoRA matmuls, launch gaps) sustains a fraction of it. Calibration corrects the rest.
STEP_EFFICIENCY = 0.6


@dataclass(frozen=True)
class Machine:
    """Rates in bytes/s and FLOP/s; sizes in bytes. `measured` is False for assumed values."""

    name: str
    vram_total: int | None          # None: no GPU here (plan for a budget given by the user)
    vram_free: int | None
    h2d_pinned: float
    h2d_pageable: float
    d2h: float
    flops: float                    # sustained bf16 FLOP/s of a transformer training step
    hbm: float                      # device memory bandwidth
    host_ram_total: int
    host_ram_available: int
    measured: bool
    workspace: int = 64 * 2**20     # cuBLAS(Lt)/cuDNN workspaces the first kernels allocate on the device
    # The disk tier ([memory] disk_dir): bytes/s its disk reads at (planner/disk_rate.py), and what
    # was measured; None: no disk tier, every streamed block stays in host RAM.
    disk_read: float | None = None
    disk: str | None = None
    # Where assumed rates come from (measured machines: unused): the one assumed card, or a named
    # card's spec sheet (planner/cards.py, `leantune plan --gpu`).
    assumed_from: str = "no GPU to measure"

    def to_dict(self) -> dict:
        return asdict(self)

    def describe(self) -> str:
        src = "measured" if self.measured else f"assumed ({self.assumed_from})"
        vram = (f"{self.vram_free / GiB:.1f}/{self.vram_total / GiB:.1f} GiB free"
                if self.vram_total else "VRAM unknown")
        return (f"{self.name}: {vram}, H2D {self.h2d_pinned / 1e9:.1f} GB/s pinned / "
                f"{self.h2d_pageable / 1e9:.1f} GB/s pageable, {self.flops / 1e12:.0f} TFLOP/s sustained, "
                f"HBM {self.hbm / 1e12:.2f} TB/s, host RAM {self.host_ram_available / GiB:.1f}/"
                f"{self.host_ram_total / GiB:.1f} GiB available [{src}]"
                + (f"; disk tier: {self.disk}" if self.disk_read else ""))


def assumed_machine(vram_total: int | None = None) -> Machine:
    """A machine with the assumed rates; VRAM as given (the user's budget) or unknown."""
    total, avail = host_ram()
    return Machine(name="assumed GPU (PCIe Gen4 x16)", vram_total=vram_total, vram_free=vram_total,
                   host_ram_total=total, host_ram_available=avail, measured=False, **ASSUMED)


def probe_machine(device: str | torch.device | None = None, quick: bool = True) -> Machine:
    """Measure the machine when a CUDA device is present, else return assumed rates.

    `quick` keeps the probe near one second; the long form averages more repetitions.
    """
    import torch

    if not torch.cuda.is_available():
        return assumed_machine()
    dev = torch.device(device or "cuda")
    if dev.type != "cuda":
        return assumed_machine()
    reps = 3 if quick else 10
    free, total = torch.cuda.mem_get_info(dev)
    ram_total, ram_avail = host_ram()
    with torch.cuda.device(dev):
        h2d_pinned, h2d_pageable, d2h, hbm = _copy_rates(dev, reps)
        gemm = _gemm_rate(dev, reps * 3)
        torch.cuda.empty_cache()
    return Machine(name=torch.cuda.get_device_name(dev), vram_total=total, vram_free=free, h2d_pinned=h2d_pinned,
                   h2d_pageable=h2d_pageable, d2h=d2h, flops=gemm * STEP_EFFICIENCY, hbm=hbm,
                   host_ram_total=ram_total, host_ram_available=ram_avail, measured=True)


def _copy_rates(dev: torch.device, reps: int, size: int = 256 * 2**20) -> tuple[float, float, float, float]:
    """Bytes/s of pinned H2D, pageable H2D, pinned D2H and device-to-device (read + write) copies."""
    import torch

    dst = torch.empty(size, dtype=torch.uint8, device=dev)
    other = torch.empty_like(dst)
    pinned = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    pageable = torch.empty(size, dtype=torch.uint8)
    return (size / _time_cuda(lambda: dst.copy_(pinned, non_blocking=True), reps),
            size / _time_cuda(lambda: dst.copy_(pageable), reps),
            size / _time_cuda(lambda: pinned.copy_(dst, non_blocking=True), reps),
            2 * size / _time_cuda(lambda: other.copy_(dst), reps))


def _gemm_rate(dev: torch.device, reps: int, n: int = 4096) -> float:
    """FLOP/s of an n^3 bf16 matmul."""
    import torch

    a = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    return 2 * n**3 / _time_cuda(lambda: a @ b, reps)


def _time_cuda(fn, reps: int) -> float:
    """Median seconds of `fn` on the current stream, timed with CUDA events after one warm-up."""
    import torch

    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1000.0)
    times.sort()
    return max(times[len(times) // 2], 1e-9)


def gpu_device_visible() -> bool:
    """Whether a GPU could be visible to this process, judged without importing torch: NVIDIA's or
    AMD's device nodes exist and CUDA_VISIBLE_DEVICES does not hide every device. False means
    `probe_machine` would return the assumed machine; True says nothing (probe to know)."""
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) in ("", "-1"):
        return False
    dev = Path("/dev")
    return any(dev.glob("nvidia[0-9]*")) or (dev / "kfd").exists()


def with_disk(machine: Machine, read: float, what: str) -> Machine:
    """The same machine with a disk tier reading at `read` bytes/s (`what`: how it is known)."""
    return replace(machine, disk_read=float(read), disk=what)


def with_vram(machine: Machine, vram_total: int) -> Machine:
    """The same machine with a given VRAM size (planning for a budget on another card)."""
    return replace(machine, vram_total=vram_total, vram_free=vram_total)


