"""The machine as the page's header shows it: host RAM always, GPU memory and utilisation where
a GPU exists (read with nvidia-smi, so this server never initialises CUDA and takes GPU memory)."""

from __future__ import annotations

import shutil
import subprocess


def host() -> dict:
    from ..host import host_ram

    total, available = host_ram()
    return {"total": total, "available": available}


def gpus() -> list[dict]:
    """[{name, used, total, utilization}] (bytes, percent) per GPU; [] without nvidia-smi."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return []
    try:
        out = subprocess.run([exe, "--query-gpu=name,memory.used,memory.total,utilization.gpu",
                              "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=5).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    found = []
    for line in out.strip().splitlines():
        parts = [p.strip() for p in line.split(",")]
        try:
            found.append({"name": parts[0], "used": int(float(parts[1])) * 2**20, "total": int(float(parts[2])) * 2**20,
                          "utilization": float(parts[3])})
        except (IndexError, ValueError):
            continue
    return found


def snapshot() -> dict:
    return {"host": host(), "gpus": gpus()}
