"""The CPU rate of a LoRA's host optimizer step (train/lora_host_step.py), timed once per machine
and setting and kept in `$LEANTUNE_CACHE/lora-host-rates.json`.

Why kept: the rate is a few tens of milliseconds of timing on adapter-shaped tensors
(lora_host_step.measured_rate), and on a loaded machine one timing can be several times another.
Priced afresh by every process, the same budget could get a host-step plan in one `leantune plan`
and a device-step plan in the next; kept, a machine's plans are a function of the budget again
(as its disk rates are, disk_rate.py). The key holds the optimizer, the clipping, the CPU model, the
thread count and torch's version: another CPU or torch times again. Delete the file to re-time.
"""

from __future__ import annotations

import logging
import os
import platform
from pathlib import Path

log = logging.getLogger("leantune")

RATES_FILE = "lora-host-rates.json"


def _path() -> Path:
    base = os.environ.get("LEANTUNE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "leantune")
    return Path(base) / RATES_FILE


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def lora_host_rate(optimizer: str, clip: bool = True) -> float:
    """Adapter parameters per second the CPU steps: kept for this machine, else timed and kept."""
    import torch

    from ..io import atomic_write_json
    from ..native import make_private_folders
    from ..train.lora_host_step import measured_rate
    from .kept_files import read_kept_object

    key = f"{optimizer}|clip={int(clip)}|{_cpu()}|threads={torch.get_num_threads()}|torch={torch.__version__}"
    path = _path()
    kept = read_kept_object(path, "LoRA host-step rates")
    rate = kept.get(key)
    if isinstance(rate, (int, float)) and rate > 0:
        return float(rate)
    rate = measured_rate(optimizer, clip)
    kept[key] = rate
    try:
        make_private_folders(path.parent)
        atomic_write_json(path, kept)
    except OSError as e:                 # a read-only cache: the rate is used, not kept
        log.warning("planner: could not keep the LoRA host-step rate in %s (%s)", path, e)
    return rate
