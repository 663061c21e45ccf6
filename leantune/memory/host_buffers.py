"""Host buffers for weight streaming: page-aligned allocation, pinning by cudaHostRegister, the
staged copy of a pageable buffer, and handing freed host pages back to the OS.

Each streamed unit's frozen tensors live in one contiguous host buffer of exactly the unit's size,
pinned where possible, so its copy to the device is one asynchronous DMA. A pageable buffer
(pinning off or refused) is copied through a small pinned staging pool by a worker thread
(`Stager`), so the main thread still never waits on a copy.

Pinning registers a page-aligned allocation of our own rather than using torch's pinned caching
allocator, which rounds every request up to a power of two (up to half again the host RAM for
block-sized buffers); see `alloc_host` for how a refused pin is handled.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import threading
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from .copy_streams import CopyBackend
from .streaming_stats import StreamStats

log = logging.getLogger("leantune.memory")

STAGING_CHUNK = 32 * 2**20   # bytes per pinned staging buffer for pageable units

PAGE = 4096                  # host page size; cudaHostRegister pins whole pages


def _cudart():
    """The CUDA runtime bindings (a seam: tests give a recording stand-in)."""
    return torch.cuda.cudart()


def page_aligned(nbytes: int, device: torch.device | str = "cpu") -> tuple[torch.Tensor, int, int]:
    """A (nbytes,) uint8 host buffer that starts on a page boundary and owns every page it touches.

    Returns (buffer, start address, length in bytes rounded up to whole pages). The allocation is
    one page larger than needed and the buffer is a view at its first page boundary, so the pinned
    range [start, start + length) lies inside this allocation alone: no other tensor shares its
    pages. (Small buffers from the ordinary allocator share pages with their neighbours, and a
    second registration of an already registered page fails with cudaErrorHostMemoryAlreadyRegistered.)
    """
    length = -(-nbytes // PAGE) * PAGE
    raw = torch.empty(length + PAGE, dtype=torch.uint8, device=device)
    skip = (-raw.data_ptr()) % PAGE
    return raw[skip:skip + nbytes], raw.data_ptr() + skip, length


def alloc_host(nbytes: int, pin: bool, t: torch.Tensor | None = None,
               device: torch.device | str = "cpu", cuda_device: torch.device | None = None) -> tuple[torch.Tensor, object]:
    """A (nbytes,) uint8 host buffer, pinned if asked and the driver agrees.

    Pinned by registering a page-aligned allocation of our own (cudaHostRegister): torch's pinned
    caching allocator rounds every request up to a power of two, which would cost up to half again
    the host RAM for block-sized buffers. A refused registration leaves a sticky error in the CUDA
    runtime that a later, unrelated launch would report, so it is cleared at once
    (cudaGetLastError) and the buffer stays pageable. Returns the buffer and, when pinned, a
    callable that undoes the registration (also called if the buffer is garbage-collected first).
    `t`: an existing buffer to pin instead (a shared-memory mapping, see memory/shared_host.py,
    page-aligned by mmap). `cuda_device`: the GPU the buffer is pinned for; the unregistration runs
    with it as the current device, whichever thread the buffer dies on (the autograd thread, a
    worker), so it never opens a context on GPU 0 or unregisters in the wrong one.
    """
    if t is None:
        if not pin:
            return torch.empty(nbytes, dtype=torch.uint8, device=device), None
        t, ptr, length = page_aligned(nbytes, device)
    else:
        ptr, length = t.data_ptr(), nbytes
        if not pin:
            return t, None
    rt = _cudart()
    rc = int(rt.cudaHostRegister(ptr, length, 0))
    if rc == 0:
        return t, weakref.finalize(t.untyped_storage(), _unregister, ptr, cuda_device)
    clear_cuda_error(rt)                        # the refusal left a sticky error: clear it now
    log.warning("streaming: could not pin %.1f MB of host memory (cudaError %d); using a pageable buffer "
                "copied through the staging pool", nbytes / 2**20, rc)
    return t, None


def clear_cuda_error(rt) -> None:
    """cudaGetLastError(): reset the runtime's last error. torch's cudart bindings do not export
    it, so it is called in the loaded libcudart through ctypes (same process, same library)."""
    fn = getattr(rt, "cudaGetLastError", None)
    if fn is None:
        for name in ("libcudart.so.12", "libcudart.so.13", "libcudart.so.11.0", "libcudart.so"):
            try:
                fn = ctypes.CDLL(name).cudaGetLastError
                break
            except (OSError, AttributeError):
                continue
    if fn is None:
        log.warning("streaming: cannot reach cudaGetLastError; a refused pin may surface as a later CUDA error")
        return
    fn()


def _unregister(ptr: int, cuda_device: torch.device | None = None) -> None:
    """cudaHostUnregister, with the buffer's GPU current (see alloc_host); a refusal would leave the
    same sticky error a refused pin does (reported by the next kernel launch of this thread, e.g.
    the autograd thread when a buffer dies there)."""
    rt = _cudart()
    with torch.cuda.device(cuda_device) if cuda_device is not None else contextlib.nullcontext():
        if int(rt.cudaHostUnregister(ptr)) != 0:
            clear_cuda_error(rt)


def _libc_trim():
    try:
        return ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):          # not glibc: nothing to call
        return None


_MALLOC_TRIM = _libc_trim()


def return_freed_host_memory() -> None:
    """Hand the pages of freed host tensors back to the OS.

    Why: glibc serves allocations below its mmap threshold (which rises to 32 MiB once a large block
    has been freed, so most block weights qualify) from its heap, and free() keeps those pages
    mapped. Without this, the original weights of a packed unit would stay resident and host RAM
    would still hold the streamed blocks twice. `malloc_trim(0)` releases every whole free page of
    the heap; a no-op where glibc is absent.
    """
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


# -- the staged copier for pageable host buffers ----------------------------------------------------

class Stager:
    """Copies a pageable host buffer into a slot through two pinned staging buffers, on a worker
    thread so the main thread keeps issuing compute. On CPU it runs the same chunked path."""

    def __init__(self, backend: CopyBackend, stats: StreamStats, chunk: int = STAGING_CHUNK):
        self.backend, self.stats, self.chunk = backend, stats, chunk
        self.bufs = [torch.empty(chunk, dtype=torch.uint8, pin_memory=backend.cuda) for _ in range(2)]
        self.events: list = [None, None]
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="leantune-stage")

    def submit(self, src: torch.Tensor, dst: torch.Tensor, free_event) -> Future:
        return self.pool.submit(self._run, lambda stage, off: stage.copy_(src[off:off + stage.numel()]),
                                src.numel(), dst, free_event)

    def submit_read(self, extent, dst: torch.Tensor, free_event) -> Future:
        """Copy a unit on disk (memory/disk_tier.DiskExtent) into `dst`: each chunk read from the
        file into a pinned staging buffer on this worker, ahead of the copy stream."""
        return self.pool.submit(self._run, lambda stage, off: extent.read_into(stage, off), extent.nbytes, dst,
                                free_event)

    def _run(self, fill, n: int, dst: torch.Tensor, free_event):
        """`fill(stage, offset)` puts bytes [offset, offset + stage.numel()) of the source in a
        staging buffer; each filled buffer is copied to `dst` at that offset."""
        be, c = self.backend, self.chunk
        t0 = time.perf_counter()
        if not be.cuda:
            for k, off in enumerate(range(0, n, c)):
                m = min(c, n - off)
                stage = self.bufs[k % 2][:m]
                fill(stage, off)
                dst[off:off + m].copy_(stage)
            with self.stats.lock:
                self.stats.copy_s += time.perf_counter() - t0
            return None
        cs = be.copy_stream
        with torch.cuda.device(be.device), torch.cuda.stream(cs):
            if free_event is not None:
                cs.wait_event(free_event)
            start = be.event(timing=True)
            start.record(cs)
            for k, off in enumerate(range(0, n, c)):
                i, m = k % 2, min(c, n - off)
                if self.events[i] is not None:
                    self.events[i].synchronize()     # this staging buffer's previous copy is done
                fill(self.bufs[i][:m], off)
                dst[off:off + m].copy_(self.bufs[i][:m], non_blocking=True)
                ev = be.event()
                ev.record(cs)
                self.events[i] = ev
            end = be.event(timing=True)
            end.record(cs)
        self.stats.add("pending_copy", start, end)
        return end

    def close(self) -> None:
        self.pool.shutdown(wait=True)


# -- the slab stack for offloaded activations ---------------------------------------------------------

OFFLOAD_SLAB = 64 * 2**20    # bytes per slab of the offloaded-activation stack (HostSlabs)
OFFLOAD_ALIGN = 512          # each offloaded input starts on this boundary inside the stack


def offload_extent(nbytes: int) -> int:
    """Bytes of the stack an offloaded input of `nbytes` takes (its start aligned to OFFLOAD_ALIGN)."""
    return -(-max(int(nbytes), 0) // OFFLOAD_ALIGN) * OFFLOAD_ALIGN


def offload_host_bytes(sizes, slab: int | None = None) -> int:
    """Host bytes HostSlabs holds for inputs of these sizes alive at once (a step's forward): their
    aligned extents stacked over whole slabs of `slab` bytes, each of which serves `slab - PAGE`
    (the page a pinned slab gives up to start on a page boundary). The planner prices offload with it."""
    slab = slab or OFFLOAD_SLAB
    top = sum(offload_extent(n) for n in sizes)
    return -(-top // (slab - PAGE)) * slab


class HostSlabs:
    """Host memory for offloaded block inputs: a stack over fixed-size slabs, each allocated (and
    pinned, cudaHostRegister on its exact size) once and kept for the next steps.

    Why: torch's caching host allocator rounds each pinned tensor up to a power of two (a 0.31 GiB
    Wan block input reserves 0.5 GiB), so 40 inputs cost 20 GiB for 12.5 GiB of bytes. Here an
    input takes the next `offload_extent(n)` bytes of one virtual stack laid over the slabs (it may
    span two or more of them: its copies go piece by piece), and the stack holds its high-water
    mark rounded up to a slab: `offload_host_bytes`. Inputs are taken in forward order and given
    back in backward order (a block's saved inputs die with its backward), so a freed extent is
    popped with every freed one above it; one given back out of order waits until those above it go.

    Each slab allocation is exactly `slab` bytes, of which `slab - PAGE` serve the stack (pinned:
    page_aligned's page-aligned view of one slab-sized allocation; pageable: the same bytes used).

    Reuse is safe without events: every copy into or out of the slabs runs on the offloader's one
    side stream per device (or synchronously off CUDA), so a new input's device->host copy into a
    popped range is ordered after the host->device copy that read it.
    """

    def __init__(self, device: torch.device | str = "cpu", pin: bool = False, slab: int | None = None,
                 cuda_device: torch.device | None = None):
        slab = slab or OFFLOAD_SLAB
        if slab <= PAGE:
            raise ValueError(f"HostSlabs: a slab of {slab} bytes leaves nothing past its page ({PAGE} bytes)")
        self.device, self.pin, self.cuda_device = torch.device(device), pin, cuda_device
        self.slab, self.usable = slab, slab - PAGE
        self.slabs: list[torch.Tensor] = []
        self._undo: list = []
        self.top = 0
        self.peak = 0
        self._live: list[list] = []      # [start, end, freed] in stack order
        self._lock = threading.Lock()    # inputs die on the autograd thread, are taken on the main one

    @property
    def reserved(self) -> int:
        """Host bytes the slabs hold."""
        return len(self.slabs) * self.slab

    def _grow(self) -> None:
        if self.pin:
            buf, undo = alloc_host(self.usable, True, device=self.device, cuda_device=self.cuda_device)
        else:       # the same bytes a pinned slab allocates (page_aligned: one page more than it uses)
            buf, undo = torch.empty(self.slab, dtype=torch.uint8, device=self.device)[:self.usable], None
        self.slabs.append(buf)
        self._undo.append(undo)

    def take(self, nbytes: int) -> list:
        """An extent of the stack for `nbytes` (a handle for `pieces` and `give_back`)."""
        with self._lock:
            start = self.top
            end = start + offload_extent(nbytes)
            while end > len(self.slabs) * self.usable:
                self._grow()
            ext = [start, start + int(nbytes), False]
            self._live.append(ext)
            self.top = end
            self.peak = max(self.peak, end)
            return ext

    def pieces(self, ext: list):
        """(offset in the input, host byte view) per slab the extent touches, in order."""
        start, end, _ = ext
        pos = start
        while pos < end:
            i, lo = divmod(pos, self.usable)
            hi = min(self.usable, lo + end - pos)
            yield pos - start, self.slabs[i][lo:hi]
            pos += hi - lo

    def give_back(self, ext: list) -> None:
        with self._lock:
            ext[2] = True
            while self._live and self._live[-1][2]:
                self.top = self._live.pop()[0]

    def release(self) -> None:
        """Free every slab (nothing may be live)."""
        for undo in self._undo:
            if undo is not None:
                undo()
        self.slabs, self._undo, self._live, self.top = [], [], [], 0
