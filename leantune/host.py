"""This machine's host RAM, read from /proc without importing torch (so `leantune plan` stays fast).

At the bottom of the package: the planner prices plans against it and a full fine-tune checks its
host-RAM need against it (train/full_host_ram.py), neither importing the other.
"""

from __future__ import annotations

import os


def host_ram() -> tuple[int, int]:
    """(total, available) host RAM in bytes from /proc/meminfo; MemAvailable counts reclaimable cache."""
    total = avail = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key == "MemTotal":
                    total = int(rest.split()[0]) * 1024
                elif key == "MemAvailable":
                    avail = int(rest.split()[0]) * 1024
    except OSError:
        pass
    if total is None:  # not Linux: fall back to POSIX sysconf
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return total, avail if avail is not None else total
