"""The disk tier's read rate, measured by a short probe and kept per disk.

Why: the planner prices a streamed block read from disk ([memory] disk_dir, memory/disk_tier.py)
against the step's compute, so it needs the rate at which that disk gives bytes to the engine's
reader, not the rate of the page cache: an NVMe drive reads 2-7 GB/s, a SATA SSD about 0.5, a
network or overlay filesystem anything. One probe (a file of `PROBE_BYTES` written in the folder,
fsynced, its pages dropped, then read back in the engine's 8 MiB reads) takes well under a second
on NVMe; it is done once per disk and kept in `$LEANTUNE_CACHE/disk-rates.json`, keyed by the
block device the folder is on (major:minor, with its model name where /sys says it), like the
other rates the planner keeps of this machine.

How it reads: with O_DIRECT where the filesystem takes it (no page cache at all), else the way
the engine reads (`preadv`, readahead off, pages dropped after each read). Pages the kernel kept
anyway (a filesystem that ignores the advice) would make the rate the page cache's: the probe
counts them (mincore) and says "cached" in its result rather than trusting such a number.
"""

from __future__ import annotations

import logging
import mmap
import os
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

log = logging.getLogger("leantune")

PROBE_BYTES = 128 * 2**20      # enough to leave the drive's own cache behind, short on NVMe
READ_CHUNK = 8 * 2**20         # the engine's read size (memory/disk_tier.READ_CHUNK)
RATES_FILE = "disk-rates.json"


@dataclass(frozen=True)
class DiskRate:
    """What the probe measured of one disk."""

    read: float                # bytes/s, the engine's large sequential reads
    device: str                # the key it is kept under ("dev 259:2 Samsung SSD 990 PRO 2TB")
    method: str                # "O_DIRECT" or "pages dropped"
    probe_bytes: int
    cached: bool = False       # pages stayed in the page cache: the rate is not the disk's

    def describe(self) -> str:
        warn = " (pages stayed cached: the page cache's rate, not the disk's)" if self.cached else ""
        return f"disk {self.read / 1e9:.2f} GB/s read, {self.device}, measured {self.method}{warn}"


def device_key(folder: str | Path) -> str:
    """The disk `folder` is on: its device numbers and, where /sys knows it, the drive's model."""
    st = os.stat(folder)
    major, minor = os.major(st.st_dev), os.minor(st.st_dev)
    key = f"dev {major}:{minor}"
    sys_dev = Path(f"/sys/dev/block/{major}:{minor}")
    for model in (sys_dev / "device" / "model", sys_dev / ".." / "device" / "model"):
        try:
            name = model.read_text().strip()
        except OSError:
            continue
        if name:
            return f"{key} {name}"
    return key


def measure_disk_read(folder: str | Path, nbytes: int = PROBE_BYTES) -> DiskRate:
    """Write `nbytes` in `folder`, drop them from the page cache, time reading them back."""
    from ..memory.disk_tier import _advise, _drop_cache, cached_pages

    folder = Path(folder)
    fd, tmp = tempfile.mkstemp(prefix=".disk-probe-", dir=folder)
    try:
        chunk = os.urandom(min(READ_CHUNK, nbytes))          # incompressible: a compressing filesystem reads it all
        written = 0
        while written < nbytes:
            written += os.write(fd, chunk[:nbytes - written])
        os.fsync(fd)                                           # dirty pages cannot be dropped
        _drop_cache(fd, 0, 0)
        os.close(fd)
        fd = -1
        rate, method = _timed_read(tmp, nbytes)
        probe = os.open(tmp, os.O_RDONLY)
        try:
            _advise(probe, 0, 0, "POSIX_FADV_RANDOM")
            cached = cached_pages(probe) > 0 if method != "O_DIRECT" else False
        finally:
            os.close(probe)
        return DiskRate(read=rate, device=device_key(folder), method=method, probe_bytes=nbytes, cached=cached)
    finally:
        if fd >= 0:
            os.close(fd)
        os.unlink(tmp)


def _timed_read(path: str, nbytes: int) -> tuple[float, str]:
    """Bytes/s of reading `path` in READ_CHUNK reads: O_DIRECT into a page-aligned buffer where the
    filesystem allows it, else the engine's way (readahead off, pages dropped after each read)."""
    from ..memory.disk_tier import _advise, _drop_cache

    buf = mmap.mmap(-1, READ_CHUNK)                            # page-aligned, as O_DIRECT needs
    view = memoryview(buf)
    try:
        direct = getattr(os, "O_DIRECT", 0)
        fd, method = -1, "pages dropped"
        if direct:
            try:
                fd, method = os.open(path, os.O_RDONLY | direct), "O_DIRECT"
                os.preadv(fd, [view[:4096]], 0)                # tmpfs and some others refuse it here
            except OSError:
                if fd >= 0:
                    os.close(fd)
                fd, method = -1, "pages dropped"
        if fd < 0:
            fd = os.open(path, os.O_RDONLY)
            _advise(fd, 0, 0, "POSIX_FADV_RANDOM")
            _drop_cache(fd, 0, 0)
        try:
            t0 = time.perf_counter()
            pos = 0
            while pos < nbytes:
                got = os.preadv(fd, [view[:min(READ_CHUNK, nbytes - pos)]], pos)
                if got <= 0:
                    break
                if method != "O_DIRECT":
                    _drop_cache(fd, pos, got)
                pos += got
            seconds = time.perf_counter() - t0
        finally:
            os.close(fd)
    finally:
        view.release()
        buf.close()
    return pos / max(seconds, 1e-9), method


def _rates_path() -> Path:
    base = os.environ.get("LEANTUNE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "leantune")
    return Path(base) / RATES_FILE


def disk_read_rate(folder: str | Path, nbytes: int = PROBE_BYTES, remeasure: bool = False) -> DiskRate:
    """The read rate of the disk `folder` is on: kept from an earlier probe of that disk, else
    measured now and kept (module docstring). An unreadable kept file is ignored and replaced."""
    from ..io import atomic_write_json
    from ..native import make_private_folders
    from .kept_files import read_kept_object

    key = device_key(folder)
    path = _rates_path()
    kept = read_kept_object(path, "disk rates")
    entry = kept.get(key)
    if not remeasure and isinstance(entry, dict):
        try:
            rate = DiskRate(**entry)
            if rate.read > 0 and not rate.cached:
                return rate
        except TypeError:
            pass
    rate = measure_disk_read(folder, nbytes)
    if not rate.cached:                                        # a page-cache number is not kept
        kept[key] = asdict(rate)
        make_private_folders(path.parent)
        atomic_write_json(path, kept)
    return rate
