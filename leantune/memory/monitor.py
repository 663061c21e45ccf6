"""Memory over a run: VRAM allocated/reserved and host RSS per step, a plot, a peak summary.

The planner predicts a peak; this module records what really happened, so the two can be compared
in the log ("vram 5.21/5.62 GiB (peak 5.40) rss 11.3 GiB" on every step line), in TensorBoard
(memory/* scalars), in a PNG of memory over the run with the predicted peak drawn as a line, and
in one summary line at the end. Per-step peaks come from torch.cuda.max_memory_allocated/reserved,
reset after each reading so every step reports its own peak. Host RSS is read from /proc (the
resident set now and its high-water mark), so no extra dependency is needed. Without CUDA the VRAM
columns are absent and only host RSS is recorded.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import torch

GiB = 2**30


@dataclass(frozen=True)
class MemorySample:
    step: int
    rss: int                        # host resident set now, bytes
    rss_peak: int                   # host high-water mark since the process started
    allocated: int | None = None    # VRAM held by tensors now
    reserved: int | None = None     # VRAM held by the caching allocator now
    peak_allocated: int | None = None   # highest allocated during this step
    peak_reserved: int | None = None


def host_rss() -> tuple[int, int]:
    """(VmRSS, VmHWM) of this process in bytes, from /proc/self/status; (0, 0) where unavailable."""
    rss = hwm = 0
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    rss = int(line.split()[1]) * 1024
                elif line.startswith("VmHWM:"):
                    hwm = int(line.split()[1]) * 1024
    except OSError:
        pass
    return rss, max(hwm, rss)


def _cuda_in_use() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_initialized()


class MemoryMonitor:
    """Records memory once per step. `record` returns the short text for the step's log line."""

    def __init__(self, log_dir: str | Path, predicted_peak_bytes: int | None = None):
        self.log_dir = Path(log_dir)
        self.predicted = predicted_peak_bytes
        self.samples: list[MemorySample] = []

    def record(self, step: int, writer=None) -> str:
        rss, hwm = host_rss()
        sample = MemorySample(step=step, rss=rss, rss_peak=hwm)
        if _cuda_in_use():
            sample = MemorySample(step=step, rss=rss, rss_peak=hwm, allocated=torch.cuda.memory_allocated(),
                                  reserved=torch.cuda.memory_reserved(),
                                  peak_allocated=torch.cuda.max_memory_allocated(),
                                  peak_reserved=torch.cuda.max_memory_reserved())
            torch.cuda.reset_peak_memory_stats()      # the next step reports its own peak
        self.samples.append(sample)
        if writer is not None:
            writer.add_scalar("memory/host_rss_gib", rss / GiB, step)
            if sample.allocated is not None:
                writer.add_scalar("memory/vram_allocated_gib", sample.allocated / GiB, step)
                writer.add_scalar("memory/vram_reserved_gib", sample.reserved / GiB, step)
                writer.add_scalar("memory/vram_peak_allocated_gib", sample.peak_allocated / GiB, step)
                writer.add_scalar("memory/vram_peak_reserved_gib", sample.peak_reserved / GiB, step)
        return self.describe(sample)

    @staticmethod
    def describe(sample: MemorySample) -> str:
        host = f"rss {sample.rss / GiB:.1f} GiB"
        if sample.allocated is None:
            return host
        return (f"vram {sample.allocated / GiB:.2f}/{sample.reserved / GiB:.2f} GiB "
                f"(peak {sample.peak_allocated / GiB:.2f}) {host}")

    # -- results -----------------------------------------------------------------------------------
    def peaks(self) -> dict[str, int | None]:
        """Highest values over the run (None where nothing was measured)."""
        def top(attr):
            values = [getattr(s, attr) for s in self.samples if getattr(s, attr) is not None]
            return max(values) if values else None

        return {"peak_allocated": top("peak_allocated"), "peak_reserved": top("peak_reserved"),
                "rss": top("rss"), "rss_peak": top("rss_peak")}

    def summary(self) -> str:
        if not self.samples:
            return "memory: no step recorded"
        p = self.peaks()
        parts = []
        if p["peak_allocated"] is not None:
            parts.append(f"peak VRAM allocated {p['peak_allocated'] / GiB:.2f} GiB, reserved "
                         f"{p['peak_reserved'] / GiB:.2f} GiB")
            if self.predicted:
                err = (p["peak_allocated"] - self.predicted) / self.predicted * 100
                parts.append(f"predicted {self.predicted / GiB:.2f} GiB ({err:+.1f}%)")
        elif self.predicted:
            parts.append(f"no VRAM measured (CPU); predicted peak {self.predicted / GiB:.2f} GiB")
        parts.append(f"peak host RSS {p['rss_peak'] / GiB:.2f} GiB")
        return f"memory over {len(self.samples)} steps: " + ", ".join(parts)

    def save(self, path: str | Path | None = None) -> Path:
        """The samples and peaks as JSON (atomic), for comparing runs and calibrating plans."""
        from ..io import atomic_write_json

        path = Path(path) if path is not None else self.log_dir / "memory.json"
        return atomic_write_json(path, {"predicted_peak_bytes": self.predicted, "peaks": self.peaks(),
                                        "samples": [asdict(s) for s in self.samples]})

    def plot(self, path: str | Path) -> Path:
        """PNG of memory over the run: VRAM (allocated, reserved, per-step peak) with the predicted
        peak as a horizontal line, and host RSS below. Written atomically."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        from ..io import atomic_write

        path = Path(path)
        steps = [s.step for s in self.samples]
        has_vram = any(s.allocated is not None for s in self.samples)
        two = has_vram or bool(self.predicted)
        fig, axes = plt.subplots(2 if two else 1, 1, figsize=(8, 6 if two else 3.5), dpi=100,
                                 sharex=True, squeeze=False)
        ax_host = axes[-1][0]
        if two:
            ax = axes[0][0]
            if has_vram:
                for attr, label in (("allocated", "allocated"), ("reserved", "reserved"),
                                    ("peak_allocated", "peak allocated in step")):
                    ax.plot(steps, [(getattr(s, attr) or 0) / GiB for s in self.samples], label=label)
            else:
                ax.text(0.5, 0.5, "no GPU: VRAM not measured", transform=ax.transAxes, ha="center", va="center")
            if self.predicted:
                ax.axhline(self.predicted / GiB, color="tab:red", linestyle="--",
                           label=f"predicted peak {self.predicted / GiB:.2f} GiB")
            ax.set_ylabel("VRAM (GiB)")
        ax_host.plot(steps, [s.rss / GiB for s in self.samples], color="tab:green", label="host RSS")
        ax_host.set_ylabel("host RSS (GiB)")
        ax_host.set_xlabel("step")
        for row in axes:
            row[0].legend(loc="best", fontsize=8)
            row[0].grid(alpha=0.3)
        fig.suptitle("memory over the run")
        fig.tight_layout()
        atomic_write(path, lambda tmp: fig.savefig(tmp, format="png"))
        plt.close(fig)
        return path
