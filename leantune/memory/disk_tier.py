"""The disk as the third memory tier: streamed units whose packed bytes live in a file, not in host RAM.

Why: host RAM is the wall before VRAM for the largest bases (a FLUX.2-dev transformer streamed
from host RAM needs its ~64 GB there); an NVMe drive reads a 300-600 MB block in well under the
time its forward and backward take on a consumer GPU, so a frozen block can come from the disk
each time it is needed and host RAM holds only the blocks the budget keeps.

What is on disk: the unit's packed bytes exactly as the host buffer held them (the engine's own
layout, fp8 or not: memory/streaming_units.py), one file per engine, each unit at an offset
aligned to the page size, written once at apply time (atomically: a temporary name, then a rename)
and unlinked as soon as it is open for reading (the open descriptor keeps it: no name another
program could write to, and nothing left behind when the process ends, however it ends). Reading
the model's own safetensors file instead would need its
tensors in the engine's dtype and layout; the packed file has them by construction, which is why
streamed-from-disk equals streamed-from-RAM bit for bit.

How it is read: `DiskExtent.read_into` fills a pinned staging buffer with large sequential
`preadv` calls on the staging worker (memory/host_buffers.Stager), ahead of the copy stream, and
tells the kernel to drop the pages it read (`posix_fadvise(DONTNEED)`; readahead is off, each read
being large already, or the pages it fetched past a read would stay): otherwise the page cache
would keep every block read, and the host RAM the budget saved would fill with cached file pages
(the process's RSS would not show it, the machine's free memory would). The file is opened once;
its size, modification time and inode are checked at every read (fstat of the descriptor), and a
file changed during the run is an error naming it.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from .spread import even_spread

PAGE = 4096
READ_CHUNK = 8 * 2**20          # bytes per preadv call: large sequential reads


class DiskTierError(RuntimeError):
    """The disk tier's file cannot be written, or was changed on disk during the run."""


def _aligned(n: int) -> int:
    return -(-n // PAGE) * PAGE


def temp_file(folder: Path, prefix: str, what: str) -> tuple[int, Path]:
    """(fd, path) of a new file in the disk tier's `folder` (made if missing); a folder that cannot
    take it is a DiskTierError naming it and `what` the file is for."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=prefix, suffix=".part", dir=folder)
    except OSError as e:
        raise DiskTierError(f"the disk tier's folder {folder}: cannot write {what} there "
                            f"({e.strerror or e})") from None
    return fd, Path(tmp)


class DiskTierFile:
    """One engine's file of packed units. `add` appends a unit's bytes (at a page-aligned offset)
    while the file is being written; `seal` renames it into place and opens it for reading."""

    def __init__(self, folder: str | Path):
        folder = Path(folder)
        fd, tmp = temp_file(folder, ".units-", "the disk tier's file")
        self.folder, self._tmp, self._wfd = folder, tmp, fd
        self.path: Path | None = None
        self.fd: int | None = None
        self._size = 0
        self._stamp = None

    def add(self, data: torch.Tensor) -> "DiskExtent":
        """Write `data` (a contiguous uint8 host tensor) at the next page boundary."""
        offset = _aligned(self._size)
        view = memoryview(data.numpy()).cast("B")
        try:
            written = 0
            while written < len(view):
                written += os.pwrite(self._wfd, view[written:written + READ_CHUNK], offset + written)
        except OSError as e:
            raise DiskTierError(f"{self._tmp}: writing the disk tier failed ({e.strerror or e}); the disk "
                                f"needs room for the streamed blocks it holds") from None
        self._size = offset + len(view)
        return DiskExtent(self, offset, len(view))

    def seal(self) -> None:
        """fsync, rename into place, reopen read-only and unlink (module docstring)."""
        os.fsync(self._wfd)
        os.close(self._wfd)
        self._wfd = None
        self.path = self._tmp.with_name(self._tmp.name[1:].replace(".part", ".bin"))
        os.replace(self._tmp, self.path)
        self.fd = os.open(self.path, os.O_RDONLY)
        self._stamp = _stamp(os.fstat(self.fd))
        _advise(self.fd, 0, 0, "POSIX_FADV_RANDOM")   # no readahead past a read: it would stay cached
        _drop_cache(self.fd, 0, 0)                    # what writing left in the page cache
        os.unlink(self.path)

    def check(self) -> None:
        """A file changed during the run (its size, modification time or inode) is an error."""
        if self.fd is None or _stamp(os.fstat(self.fd)) != self._stamp:
            raise DiskTierError(f"{self.path}: the disk tier's file was changed or replaced during the run; the "
                                f"streamed blocks it holds can no longer be trusted (stop other programs writing "
                                f"to the disk tier's folder and start the run again)")

    def close(self) -> None:
        """Close the file, which frees its disk space (it is unlinked once sealed; a file never
        sealed is deleted here)."""
        if self._wfd is not None:
            os.close(self._wfd)
            self._wfd = None
            self._tmp.unlink(missing_ok=True)
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


@dataclass(eq=False)
class DiskExtent:
    """Where one unit's packed bytes lie in its engine's file."""

    file: DiskTierFile
    offset: int
    nbytes: int

    def read_into(self, dst: torch.Tensor, start: int = 0) -> None:
        """Read bytes [start, start + dst.numel()) of the unit into `dst` (contiguous uint8, host),
        then drop those pages from the page cache."""
        self.file.check()
        fd, n = self.file.fd, dst.numel()
        view = memoryview(dst.numpy()).cast("B")
        pos, done = self.offset + start, 0
        while done < n:
            got = os.preadv(fd, [view[done:done + READ_CHUNK]], pos + done)
            if got <= 0:
                raise DiskTierError(f"{self.file.path}: the disk tier's file ended early (read {done} of {n} "
                                    f"bytes at offset {pos})")
            done += got
        lo = pos - pos % PAGE                         # whole pages: a partial one would stay cached
        _drop_cache(fd, lo, _aligned(pos + n) - lo)

    def read(self) -> torch.Tensor:
        """The unit's bytes in a new host tensor (restoring a model from its streamed state)."""
        out = torch.empty(self.nbytes, dtype=torch.uint8)
        self.read_into(out)
        return out


def _stamp(st: os.stat_result) -> tuple:
    return (st.st_size, st.st_mtime_ns, st.st_ino, st.st_dev)


def _drop_cache(fd: int, offset: int, length: int) -> None:
    _advise(fd, offset, length, "POSIX_FADV_DONTNEED")


def _advise(fd: int, offset: int, length: int, advice: str) -> None:
    advise = getattr(os, "posix_fadvise", None)
    if advise is not None:
        try:
            advise(fd, offset, length, getattr(os, advice))
        except OSError:                               # a filesystem that takes no advice: pages stay cached
            pass


def cached_pages(fd: int) -> int:
    """How many of the open file's pages are in the page cache now (mincore over a read-only
    mapping of it): what the disk tier leaves there, measured rather than assumed."""
    import ctypes
    import mmap

    size = os.fstat(fd).st_size
    what = f"file descriptor {fd}"
    if size == 0:
        return 0
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]
    pages = -(-size // mmap.PAGESIZE)
    vec = (ctypes.c_ubyte * pages)()
    addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
    if addr in (None, ctypes.c_void_p(-1).value):
        raise OSError(ctypes.get_errno(), f"{what}: mmap failed")
    try:
        if libc.mincore(addr, size, vec) != 0:
            raise OSError(ctypes.get_errno(), f"{what}: mincore failed")
    finally:
        libc.munmap(addr, size)
    return sum(v & 1 for v in vec)


def disk_split(units: list[tuple[str, int]], room: int) -> tuple[str, ...]:
    """Which of the streamed blocks `units` ((name, packed bytes), the engine's packing order) go
    to disk so that the others' host buffers fit in `room` bytes: the fewest that do, spread evenly
    through the list (a block read from disk then sits between blocks copied from RAM, whose copies
    give the reader its time), in the list's order. () when everything fits; all of them when even
    one does not. The engine (an explicit [memory] ram_budget) and the planner (its priced host
    RAM) both decide with this function, so the planner's tiers are the ones the engine makes."""
    total = sum(n for _, n in units)
    if total <= room:
        return ()
    names = [name for name, _ in units]
    size = dict(units)
    for count in range(1, len(units) + 1):
        chosen = even_spread(names, count)
        if total - sum(size[n] for n in chosen) <= room:
            return tuple(chosen)
    return tuple(names)


def room_split(sizes: list[tuple[str, int]], streamed, room: int) -> tuple[str, ...]:
    """disk_split for a host budget of `room` bytes over the engine's units `sizes` ((name, packed
    bytes), packing order, the non-block group among them): the non-block group stays in RAM and
    takes its share of the room; the streamed blocks beyond the rest go to disk. The engine
    (apply_streaming, on the real units) and the loader (disk_load.blocks_for_room, on the
    meta-built model, before any weight is read) decide with it."""
    streamed = set(streamed)
    room -= sum(n for name, n in sizes if name not in streamed)
    return disk_split([(n, b) for n, b in sizes if n in streamed], room)
