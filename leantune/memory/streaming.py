"""Weight streaming ("block swap"): frozen block weights live in host RAM and visit the GPU in turn.

What it trades: VRAM for PCIe traffic. Each streamed block costs one host->GPU copy per use (one in
forward, one in backward) and K slots of VRAM in total, however many blocks stream. When the
streamed blocks are spread through the stack, the resident blocks' compute hides the copies.

How it works:
- A *unit* is one streamed block, or (optionally) all non-block modules as one group. All its frozen
  tensors (parameters and buffers, not adapter weights) are packed into one contiguous host buffer
  of exactly the unit's size, pinned where possible. A pageable buffer (pinning off or refused) is
  copied through a small pinned staging pool by a worker thread, so the main thread still never
  waits on a copy.
- Host RAM while applying: units are packed one at a time, and each unit's tensors are re-pointed at
  their place in its buffer right after the copy, so the original storage is freed (and its pages
  handed back to the OS) before the next unit is packed. The peak is the model plus one unit, not
  the model plus every buffer; afterwards the host holds the streamed units once, as their buffers.
- The GPU holds K slots (a ring, K >= 2), each as large as the largest unit. Unit i always uses slot
  i mod K, so its module parameters are re-pointed once, at apply time, at views of that slot: a
  fetch is then a single copy, with no per-step Python re-pointing. A unit with a slot to itself
  stays resident; outside its hold window a streamed module sees whatever its slot holds.
- Copies run on a dedicated copy stream. Compute waits on the copy's event before using a unit; a
  slot is refilled only after the event recorded on the compute stream at its last use. No device-
  or stream-wide synchronize anywhere in the per-block path.
- A unit is *held* while its weights are in use: during its forward; in backward from the moment
  its output gradients arrive (an identity autograd Function on its outputs) until its input
  gradients are computed (an identity Function on its grad-requiring inputs; created first in the
  block, it has the lowest sequence number, so autograd's ready queue runs it after every other
  node of the block). A unit none of whose inputs needs a gradient (the first trainable block) is held
  until the end of backward (an engine callback), as FSDP2 does for the same reason.
- Without checkpointing, the tensors autograd saves inside a streamed unit are packed by
  saved-tensor hooks: a view of a slot becomes a handle (unit, offset, shape, strides) and is
  rebuilt from the slot in backward, after checking that the unit is held again. With
  checkpointing, the recompute re-enters this module's forward wrapper, which re-acquires the unit;
  checkpointing therefore wraps *outside* streaming (see engine.py for the full order).
- Prefetch follows the expected order: the forward order learned from the previous step, its
  reverse for backward, and at the end of backward (or of a no-grad forward) the start of the next
  forward. A fetch that was not prefetched still happens on demand; order affects speed only.
- Forward-only mode (sampling, under no_grad) keeps the ring cycling across calls: the first units
  of the next denoising step are fetched at the end of the current one, resident blocks never move,
  and a model whose streamed units fit the ring moves nothing after the first step. A grad-enabled
  call in that mode is refused rather than silently losing the streamed blocks' gradients.
- `poison` (debug): a released slot is filled with 0xFF bytes, which is NaN in every float dtype,
  so any use of a weight outside its hold window turns the loss NaN. The same schedule runs on CPU
  (slots are separate host buffers, streams and events are absent), which lets CI test it.

Teardown: `remove_streaming` copies every streamed tensor back to ordinary tensors (unit by unit,
freeing each host buffer as it goes); `release_streaming` only drops the engine's state (buffers,
pins, slots, wrappers, hooks) and leaves the streamed modules without weights, for a model that is
about to be discarded (after sampling) where a copy back could not even fit on the device.

How it differs from kohya's block swap: no cap on the number of blocks (kohya asserts <= 35 for
Flux), no per-swap `synchronize()` of the current stream, H2D only for frozen weights, sampling does
not re-place every block per step, and streaming composes with activation checkpointing.
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..spec import ModelSpec
from .fp8 import adapter_module_ids
from .plan import Plan

log = logging.getLogger("leantune.memory")

ALIGN = 512                  # byte alignment of each tensor inside a packed unit
STAGING_CHUNK = 32 * 2**20   # bytes per pinned staging buffer for pageable units
POISON_BYTE = 0xFF           # all-ones bits: NaN in fp32, bf16, fp16 and e4m3fn
# Set (True) on a module holding a trained weight's optimizer state (train/fused_optim.ParamState):
# under Plan.optimizer_on_host a streamed unit leaves such modules in host RAM.
OPTIMIZER_STATE_ATTR = "holds_optimizer_state"


class RunMode:
    """Shared switch between training and forward-only (sampling) execution."""

    def __init__(self) -> None:
        self.forward_only = False


# -- device abstraction: CUDA streams and events, or their absence on CPU --------------------------

class _Backend:
    def __init__(self, device: torch.device | str):
        dev = torch.device(device)
        self.cuda = dev.type == "cuda"
        if self.cuda and dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        self.device = dev
        self.copy_stream = torch.cuda.Stream(dev) if self.cuda else None

    def compute_stream(self):
        return torch.cuda.current_stream(self.device) if self.cuda else None

    def event(self, timing: bool = False):
        return torch.cuda.Event(enable_timing=timing) if self.cuda else None


@dataclass
class _Stats:
    bytes: int = 0
    copies: int = 0
    demand: int = 0            # fetches that were not prefetched
    copy_s: float = 0.0        # time the copies took (copy stream / worker)
    stall_s: float = 0.0       # time compute waited on copies
    held_max: int = 0          # most units held at once
    pending_copy: list = field(default_factory=list)    # CUDA (start, end) events not yet read
    pending_stall: list = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, attr: str, start, end) -> None:
        with self.lock:
            getattr(self, attr).append((start, end))
        if len(getattr(self, attr)) > 4096:           # nobody reads reports: fold finished pairs in
            self.settle(wait=False)

    def settle(self, wait: bool) -> None:
        """Add up the CUDA event pairs that have completed (all of them if `wait`)."""
        for attr, key in (("pending_copy", "copy_s"), ("pending_stall", "stall_s")):
            with self.lock:
                pairs, keep = getattr(self, attr), []
                for start, end in pairs:
                    if wait:
                        end.synchronize()
                    if end.query():
                        setattr(self, key, getattr(self, key) + start.elapsed_time(end) / 1000.0)
                    else:
                        keep.append((start, end))
                setattr(self, attr, keep)


# -- units and slots ---------------------------------------------------------------------------------

@dataclass
class _Entry:
    """One tensor of a unit: where it sits in the packed buffer and who refers to it."""

    owners: list[tuple[nn.Module, str, str]]   # (module, "param" | "buffer", attribute name)
    offset: int
    nbytes: int
    dtype: torch.dtype
    shape: torch.Size


@dataclass(eq=False)
class _Unit:
    name: str
    modules: list[nn.Module]
    entries: list[_Entry]
    nbytes: int
    host: torch.Tensor                 # (nbytes,) uint8, pinned when possible
    pinned: bool
    slot: int
    checkpointed: bool
    adapter_params: list[nn.Parameter]
    unpin: object = None               # undoes the host buffer's pinning
    refs: int = 0

    def trainable(self) -> bool:
        return any(p.requires_grad for p in self.adapter_params) or any(
            kind == "param" and m._parameters[attr].requires_grad for e in self.entries for m, kind, attr in e.owners)


@dataclass(eq=False)
class _Slot:
    buf: torch.Tensor                  # (slot_bytes,) uint8 on the compute device
    owner: _Unit | None = None
    valid: bool = False                # owner's bytes are (being) copied in and not poisoned
    ready: object = None               # None | CUDA event | Future of the staged copy
    free_event: object = None          # CUDA event recorded at the last release
    typed: dict = field(default_factory=dict)

    def view_as_dtype(self, dtype: torch.dtype) -> torch.Tensor:
        v = self.typed.get(dtype)
        if v is None:
            v = self.typed[dtype] = self.buf.view(dtype)
        return v


@dataclass(frozen=True)
class _SavedHandle:
    """A saved tensor that was a view of a streaming slot, rebuilt from the slot in backward."""

    unit: _Unit
    dtype: torch.dtype
    offset: int
    size: tuple
    stride: tuple


# -- the staged copier for pageable host buffers ----------------------------------------------------

class _Stager:
    """Copies a pageable host buffer into a slot through two pinned staging buffers, on a worker
    thread so the main thread keeps issuing compute. On CPU it runs the same chunked path."""

    def __init__(self, backend: _Backend, stats: _Stats, chunk: int = STAGING_CHUNK):
        self.backend, self.stats, self.chunk = backend, stats, chunk
        self.bufs = [torch.empty(chunk, dtype=torch.uint8, pin_memory=backend.cuda) for _ in range(2)]
        self.events: list = [None, None]
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="leantune-stage")

    def submit(self, src: torch.Tensor, dst: torch.Tensor, free_event) -> Future:
        return self.pool.submit(self._run, src, dst, free_event)

    def _run(self, src: torch.Tensor, dst: torch.Tensor, free_event):
        be, n, c = self.backend, src.numel(), self.chunk
        t0 = time.perf_counter()
        if not be.cuda:
            for k, off in enumerate(range(0, n, c)):
                m = min(c, n - off)
                stage = self.bufs[k % 2][:m]
                stage.copy_(src[off:off + m])
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
                self.bufs[i][:m].copy_(src[off:off + m])
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


PAGE = 4096                  # host page size; cudaHostRegister pins whole pages


def _cudart():
    """The CUDA runtime bindings (a seam: tests give a recording stand-in)."""
    return torch.cuda.cudart()


def _page_aligned(nbytes: int, device: torch.device | str = "cpu") -> tuple[torch.Tensor, int, int]:
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


def _alloc_host(nbytes: int, pin: bool, t: torch.Tensor | None = None,
                device: torch.device | str = "cpu") -> tuple[torch.Tensor, object]:
    """A (nbytes,) uint8 host buffer, pinned if asked and the driver agrees.

    Pinned by registering a page-aligned allocation of our own (cudaHostRegister): torch's pinned
    caching allocator rounds every request up to a power of two, which would cost up to half again
    the host RAM for block-sized buffers. A refused registration leaves a sticky error in the CUDA
    runtime that a later, unrelated launch would report, so it is cleared at once
    (cudaGetLastError) and the buffer stays pageable. Returns the buffer and, when pinned, a
    callable that undoes the registration (also called if the buffer is garbage-collected first).
    `t`: an existing buffer to pin instead (a shared-memory mapping, see memory/shared_host.py,
    page-aligned by mmap).
    """
    if t is None:
        if not pin:
            return torch.empty(nbytes, dtype=torch.uint8, device=device), None
        t, ptr, length = _page_aligned(nbytes, device)
    else:
        ptr, length = t.data_ptr(), nbytes
        if not pin:
            return t, None
    rt = _cudart()
    rc = int(rt.cudaHostRegister(ptr, length, 0))
    if rc == 0:
        return t, weakref.finalize(t.untyped_storage(), _unregister, ptr)
    _clear_cuda_error(rt)                       # the refusal left a sticky error: clear it now
    log.warning("streaming: could not pin %.1f MB of host memory (cudaError %d); using a pageable buffer "
                "copied through the staging pool", nbytes / 2**20, rc)
    return t, None


def _clear_cuda_error(rt) -> None:
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


def _unregister(ptr: int) -> None:
    """cudaHostUnregister; a refusal would leave the same sticky error a refused pin does (reported
    by the next kernel launch of this thread, e.g. the autograd thread when a buffer dies there)."""
    rt = _cudart()
    if int(rt.cudaHostUnregister(ptr)) != 0:
        _clear_cuda_error(rt)


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


# -- autograd boundaries -----------------------------------------------------------------------------

class _Enter(torch.autograd.Function):
    """Identity on a unit's grad-requiring inputs; its backward runs once the unit's backward is done."""

    @staticmethod
    def forward(ctx, engine, unit, *xs):
        ctx.engine, ctx.unit = engine, unit
        ctx.set_materialize_grads(False)
        return tuple(x.view_as(x) for x in xs)

    @staticmethod
    def backward(ctx, *grads):
        ctx.engine.backward_end(ctx.unit)
        return (None, None, *grads)


class _Leave(torch.autograd.Function):
    """Identity on a unit's outputs; its backward runs just before the unit's backward starts."""

    @staticmethod
    def forward(ctx, engine, unit, release_at_end, *xs):
        ctx.engine, ctx.unit, ctx.release_at_end = engine, unit, release_at_end
        ctx.set_materialize_grads(False)
        return tuple(x.view_as(x) for x in xs)

    @staticmethod
    def backward(ctx, *grads):
        ctx.engine.backward_begin(ctx.unit, ctx.release_at_end)
        return (None, None, None, *grads)


def _storage_key(t: torch.Tensor) -> int:
    """Identity of the storage `t` views (the address of its StorageImpl), valid while it lives."""
    return t.untyped_storage()._cdata


def _dedupe(seq: list) -> list:
    """Drop consecutive repeats (a group unit used by several consecutive modules)."""
    out: list = []
    for x in seq:
        if not out or out[-1] is not x:
            out.append(x)
    return out


# -- the schedule --------------------------------------------------------------------------------------

class StreamingEngine:
    """Owns the slots and decides when each unit is copied, waited on, held and released.

    Moves frozen weights only; memory/trainable_streaming.py subclasses it (`trains_weights`) to
    write updated weights back through the `_retire` and `_drain` hooks.
    """

    trains_weights = False

    def __init__(self, units: list[_Unit], slots: list[_Slot], backend: _Backend, plan: Plan, mode: RunMode):
        self.units, self.slots, self.backend, self.mode = units, slots, backend, mode
        self.poison = plan.debug_poison
        self.stats = _Stats()
        self.stager = _Stager(backend, self.stats) if any(not u.pinned for u in units) else None
        self.fwd_order: list[_Unit] = list(units)     # learned from each forward
        self.order: list[_Unit] = list(units)
        self.cursor = -1
        self.phase = "idle"                           # idle | forward | backward
        self.log: list[_Unit] = []                    # units acquired in this forward
        self.tracked: list[_Unit] = []                # units whose weights backward will need
        self.bwd_holds: list[_Unit] = []              # holds taken in backward, not yet released
        self.end_holds: list[_Unit] = []              # holds released at the end of backward
        self.callback_queued = False
        self.held = 0
        # Keyed by storage identity, not data_ptr(): a fake or meta storage (the simulated device,
        # memory/simulated.py) has data_ptr() 0, which would make every tensor look like a slot view.
        self.by_storage = {_storage_key(s.buf): s for s in slots}

    # -- phases (model-level hooks and autograd boundaries) -------------------------------------
    def begin_forward(self) -> None:
        for u in self.units:                          # holds left by an interrupted backward
            while u.refs:
                self.release(u)
        self.bwd_holds.clear()
        self.end_holds.clear()
        # An interrupted backward (an exception, e.g. out of memory) never ran the end-of-backward
        # callback it queued: without this the next backward would queue none and keep its
        # held-to-the-end units held past its end.
        if self.callback_queued:
            self._backward_ended()
        self.callback_queued = False
        self.phase, self.order, self.cursor = "forward", self.fwd_order, -1
        self.log, self.tracked = [], []
        self._prefetch()

    def end_forward(self) -> None:
        if self.log:
            self.fwd_order = _dedupe(self.log)
        if self.tracked and not self.mode.forward_only:
            self.phase, self.order = "backward", list(reversed(_dedupe(self.tracked)))
        else:
            self.phase, self.order = "idle", self.fwd_order
        self.cursor = -1
        self._prefetch()

    def note_tracked(self, unit: _Unit) -> None:
        if self.phase == "forward":
            self.tracked.append(unit)

    def backward_begin(self, unit: _Unit, release_at_end: bool) -> None:
        if not self.callback_queued:
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
            self.callback_queued = True
            if self.phase != "backward":
                self.phase, self.order, self.cursor = "backward", list(reversed(_dedupe(self.tracked))), -1
        self.acquire(unit)
        (self.end_holds if release_at_end else self.bwd_holds).append(unit)

    def backward_end(self, unit: _Unit) -> None:
        for i, u in enumerate(self.bwd_holds):
            if u is unit:
                del self.bwd_holds[i]
                self.release(unit)
                return

    def _end_backward(self) -> None:
        self.callback_queued = False
        for u in self.end_holds + self.bwd_holds:     # bwd_holds: input grads nobody asked for
            self.release(u)
        self.end_holds.clear()
        self.bwd_holds.clear()
        self.phase, self.order, self.cursor = "idle", self.fwd_order, -1
        self._backward_ended()
        self._prefetch()                              # the next forward's first units

    def _backward_ended(self) -> None:
        """A hook: backward ended, or was interrupted and the next forward released its holds
        (trainable streaming uses it)."""

    # -- holding ---------------------------------------------------------------------------------
    def acquire(self, unit: _Unit) -> None:
        if unit.refs == 0:
            self._make_resident(unit)
            self.held += 1
            self.stats.held_max = max(self.stats.held_max, self.held)
        unit.refs += 1
        self._advance(unit)
        if self.phase == "forward" and (not self.log or self.log[-1] is not unit):
            self.log.append(unit)

    def release(self, unit: _Unit) -> None:
        unit.refs -= 1
        if unit.refs:
            return
        self.held -= 1
        self._retire(unit, self.slots[unit.slot])
        self._prefetch()

    def _retire(self, unit: _Unit, slot: _Slot) -> None:
        """A unit's last hold ended: poison its slot (debug) and mark when the slot may be refilled."""
        stream = self.backend.compute_stream()
        if self.poison:
            slot.buf.fill_(POISON_BYTE)               # on the compute stream, after every use
            slot.valid = False
        if stream is not None:
            if slot.free_event is None:
                slot.free_event = self.backend.event()
            slot.free_event.record(stream)

    def _drain(self) -> None:
        """Wait for copies other than the H2D fetches (none here; write-backs in the subclass)."""

    def _make_resident(self, unit: _Unit) -> None:
        slot = self.slots[unit.slot]
        if not (slot.owner is unit and slot.valid):
            if slot.owner is not None and slot.owner.refs > 0:
                raise RuntimeError(
                    f"streaming: {unit.name} needs ring slot {unit.slot}, which {slot.owner.name} still holds; "
                    f"these units are used at the same time, so raise memory.ring_slots")
            self._fetch(unit, demand=True)
        self._wait_ready(slot)

    def _wait_ready(self, slot: _Slot) -> None:
        ready = slot.ready
        if ready is None:
            return
        if isinstance(ready, Future):
            # The staged copy must have been issued (CPU: done) before compute may wait on it. If
            # it has not, the main thread blocks here: that is a stall like any other and is
            # counted, on CUDA too, so calibration sees it. A prefetch issued early enough finds
            # the future done and costs nothing.
            t0 = time.perf_counter()
            ready = ready.result()
            self.stats.stall_s += time.perf_counter() - t0
        if ready is not None and not ready.query():
            stream = self.backend.compute_stream()
            before, after = self.backend.event(timing=True), self.backend.event(timing=True)
            before.record(stream)
            stream.wait_event(ready)
            after.record(stream)
            self.stats.add("pending_stall", before, after)
        slot.ready = None

    def _fetch(self, unit: _Unit, demand: bool) -> None:
        """Copy `unit` into its slot. Copies into one slot are serialized: a staged copy still queued
        on the worker would otherwise land after a direct copy issued now, and the slot would hold
        the previous unit's bytes while naming the new one. So while the slot's last copy is a
        pending staged one, the new copy is queued behind it on the same worker (FIFO); every
        issued copy is on the one copy stream, which orders the rest."""
        slot = self.slots[unit.slot]
        n = unit.nbytes
        queued = isinstance(slot.ready, Future) and not slot.ready.done()
        if unit.pinned and not queued:
            slot.ready = self._copy_direct(unit.host, slot.buf[:n], slot.free_event)
        elif unit.pinned:
            slot.ready = self.stager.pool.submit(self._copy_direct, unit.host, slot.buf[:n], slot.free_event, True)
        else:
            slot.ready = self.stager.submit(unit.host, slot.buf[:n], slot.free_event)
        slot.owner, slot.valid = unit, True
        self.stats.bytes += n
        self.stats.copies += 1
        self.stats.demand += int(demand)

    def _copy_direct(self, src: torch.Tensor, dst: torch.Tensor, free_event, on_worker: bool = False):
        be = self.backend
        if not be.cuda:
            t0 = time.perf_counter()
            dst.copy_(src)
            dt = time.perf_counter() - t0
            with self.stats.lock:
                self.stats.copy_s += dt
            if not on_worker:
                self.stats.stall_s += dt              # nothing overlaps on CPU: a copy is a stall
            return None
        cs = be.copy_stream
        with torch.cuda.device(be.device), torch.cuda.stream(cs):
            if free_event is not None:
                cs.wait_event(free_event)
            start, end = be.event(timing=True), be.event(timing=True)
            start.record(cs)
            dst.copy_(src, non_blocking=True)
            end.record(cs)
        self.stats.add("pending_copy", start, end)
        return end

    # -- prefetch --------------------------------------------------------------------------------
    def _advance(self, unit: _Unit) -> None:
        order = self.order
        if 0 <= self.cursor < len(order) and order[self.cursor] is unit:
            pass
        else:
            for i in range(self.cursor + 1, len(order)):
                if order[i] is unit:
                    self.cursor = i
                    break
        self._prefetch()

    def _prefetch(self) -> None:
        """Fetch the next units of the expected order into free slots, at most one ring ahead."""
        order, k = self.order, len(self.slots)
        # The unit under the cursor may be called again (a group's consecutive modules): keep it.
        window: list[_Unit] = [order[self.cursor]] if 0 <= self.cursor < len(order) else []
        i = self.cursor + 1
        while i < len(order) and len(window) < k:
            unit = order[i]
            i += 1
            if any(unit is w for w in window):
                continue
            window.append(unit)
            slot = self.slots[unit.slot]
            if slot.owner is unit and slot.valid:
                continue
            owner = slot.owner
            if owner is not None and owner is not unit and (owner.refs > 0 or any(owner is w for w in window)):
                break                                 # the slot's owner is in use or needed sooner
            self._fetch(unit, demand=False)

    # -- saved tensors (no checkpointing) --------------------------------------------------------
    def pack(self, t: torch.Tensor):
        slot = self.by_storage.get(_storage_key(t))
        if slot is None:
            return t
        return _SavedHandle(slot.owner, t.dtype, t.storage_offset(), tuple(t.shape), tuple(t.stride()))

    def unpack(self, h):
        if not isinstance(h, _SavedHandle):
            return h
        slot = self.slots[h.unit.slot]
        if h.unit.refs == 0 or slot.owner is not h.unit or not slot.valid:
            raise RuntimeError(f"streaming: backward needs the weights of {h.unit.name} while they are not "
                               f"resident; the streaming schedule missed this unit")
        return slot.view_as_dtype(h.dtype).as_strided(h.size, h.stride, h.offset)

    # -- report ----------------------------------------------------------------------------------
    def report(self, wait: bool = False) -> dict:
        s = self.stats
        s.settle(wait)
        out = {
            "streamed_units": len(self.units),
            "bytes_h2d": s.bytes,
            "copies": s.copies,
            "demand_fetches": s.demand,
            "copy_s": s.copy_s,
            "stall_s": s.stall_s,
            "h2d_GBps": (s.bytes / s.copy_s / 1e9) if s.copy_s > 0 else None,
            "slots": len(self.slots),
            "slot_bytes": self.slots[0].buf.numel() if self.slots else 0,
            "slots_held_max": s.held_max,
            "slots_valid": sum(1 for sl in self.slots if sl.valid),
        }
        s.bytes = s.copies = s.demand = 0
        s.copy_s = s.stall_s = 0.0
        s.held_max = self.held
        return out


# -- the forward wrapper -----------------------------------------------------------------------------

class _StreamedForward:
    """Instance-level forward of a streamed module: hold the unit around the original forward and
    wire the backward holds."""

    def __init__(self, engine: StreamingEngine, unit: _Unit, module: nn.Module):
        self.engine, self.unit = engine, unit
        self.prev = module.__dict__.get("forward")    # an earlier instance-level forward, if any
        self.orig = module.forward

    def __call__(self, *args, **kwargs):
        eng, unit = self.engine, self.unit
        if not torch.is_grad_enabled():
            return self._held(self.orig, args, kwargs)
        if eng.mode.forward_only:
            raise RuntimeError("memory engine is in forward-only (sampling) mode but autograd is on: sample "
                               "under torch.no_grad(), or call forward_only(False) before training")
        eng.acquire(unit)
        try:
            flat, spec = tree_flatten((args, kwargs))
            grad_in = [i for i, x in enumerate(flat) if isinstance(x, torch.Tensor) and x.requires_grad]
            if not grad_in and not unit.trainable():
                return self.orig(*args, **kwargs)     # nothing here needs these weights in backward
            if grad_in:
                routed = _Enter.apply(eng, unit, *[flat[i] for i in grad_in])
                for i, x in zip(grad_in, routed, strict=True):
                    flat[i] = x
                args, kwargs = tree_unflatten(flat, spec)
            if unit.checkpointed:
                out = self.orig(*args, **kwargs)      # checkpoint's recompute re-enters this wrapper
            else:
                with torch.autograd.graph.saved_tensors_hooks(eng.pack, eng.unpack):
                    out = self.orig(*args, **kwargs)
            oflat, ospec = tree_flatten(out)
            grad_out = [i for i, x in enumerate(oflat) if isinstance(x, torch.Tensor) and x.requires_grad]
            if grad_out:
                routed = _Leave.apply(eng, unit, not grad_in, *[oflat[i] for i in grad_out])
                for i, x in zip(grad_out, routed, strict=True):
                    oflat[i] = x
                out = tree_unflatten(oflat, ospec)
                eng.note_tracked(unit)
            return out
        finally:
            eng.release(unit)

    def _held(self, fn, args, kwargs):
        self.engine.acquire(self.unit)
        try:
            return fn(*args, **kwargs)
        finally:
            self.engine.release(self.unit)


# -- apply / remove ----------------------------------------------------------------------------------

@dataclass
class StreamingHandle:
    engine: StreamingEngine
    units: list[_Unit]
    wrapped: list[tuple[nn.Module, _StreamedForward]]
    hooks: list
    total_blocks: int
    fp8: bool
    # Modules whose tensors stay in host RAM, neither packed nor placed on the device: the
    # streamed blocks' optimizer state under Plan.optimizer_on_host.
    host_modules: list[nn.Module] = field(default_factory=list)

    @property
    def host_bytes(self) -> int:
        return sum(u.host.numel() for u in self.units)

    @property
    def pinned_bytes(self) -> int:
        return sum(u.host.numel() for u in self.units if u.pinned)

    def unit_bytes(self) -> dict[str, int]:
        return {u.name: u.nbytes for u in self.units}

    def describe(self) -> str:
        nblocks = sum(1 for u in self.units if u.name != "non_blocks")
        extra = " + non-block modules" if any(u.name == "non_blocks" for u in self.units) else ""
        pinned = self.pinned_bytes
        if not self.engine.backend.cuda:
            where = ""                                # CPU compute: host and "device" are the same RAM
        else:
            where = " pinned" if pinned == self.host_bytes else (" pageable" if not pinned else " partly pinned")
        ring = len(self.engine.slots)
        return (f"streaming: {nblocks}/{self.total_blocks} blocks{extra} ({'fp8' if self.fp8 else 'no fp8'}, "
                f"{self.host_bytes / 2**30:.1f} GB host{where}), ring {ring}"
                + (f" x {_size(self.engine.slots[0].buf.numel())}" if ring else "")
                + (", poison" if self.engine.poison else ""))


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GB" if n >= 2**30 else (f"{n / 2**20:.0f} MB" if n >= 2**20 else f"{n / 2**10:.0f} KB")


def _collect(modules: list[nn.Module], unit_name: str, trainable_ok: bool = False, state_on_host: bool = False
             ) -> tuple[list[_Entry], list[nn.Parameter], int, list[nn.Module]]:
    """The frozen tensors of a unit (and its trainable ones if `trainable_ok`), laid out in one
    buffer; its adapter parameters; and, with `state_on_host`, the optimizer-state modules left out
    of the buffer (they stay in host RAM: Plan.optimizer_on_host)."""
    by_id: dict[int, _Entry] = {}
    entries: list[_Entry] = []
    adapters: list[nn.Parameter] = []
    kept: list[nn.Module] = []
    offset = 0
    for top in modules:
        skip = adapter_module_ids(top)
        for mname, m in top.named_modules():
            if id(m) in skip:
                adapters.extend(p for p in m._parameters.values() if p is not None)
                continue
            if state_on_host and getattr(m, OPTIMIZER_STATE_ATTR, False):
                kept.append(m)
                continue
            for kind, store in (("param", m._parameters), ("buffer", m._buffers)):
                for attr, t in store.items():
                    if t is None:
                        continue
                    if id(t) in by_id:
                        by_id[id(t)].owners.append((m, kind, attr))
                        continue
                    if kind == "param" and t.requires_grad and not trainable_ok:
                        raise ValueError(
                            f"memory.streamed_blocks: {unit_name}.{mname + '.' if mname else ''}{attr} is trainable; "
                            f"streaming moves frozen weights only (LoRA bases, sampling). Stream fewer blocks "
                            f"or freeze the base model")
                    nbytes = t.numel() * t.element_size()
                    e = _Entry([(m, kind, attr)], offset, nbytes, t.dtype, t.shape)
                    by_id[id(t)] = e
                    entries.append(e)
                    offset += -(-nbytes // ALIGN) * ALIGN
    return entries, adapters, offset, kept


def _tensor_of(entry: _Entry) -> torch.Tensor:
    m, kind, attr = entry.owners[0]
    return (m._parameters if kind == "param" else m._buffers)[attr]


def _point(entry: _Entry, value: torch.Tensor) -> None:
    for m, kind, attr in entry.owners:
        if kind == "param":
            m._parameters[attr].data = value
        else:
            m._buffers[attr] = value


def _view(buf: torch.Tensor, e: _Entry) -> torch.Tensor:
    return buf[e.offset:e.offset + e.nbytes].view(e.dtype).view(e.shape)


def _pack(host: torch.Tensor, entries: list[_Entry], copy: bool = True) -> None:
    """Copy a unit's tensors into its host buffer and re-point their owners there at once, so each
    original storage is freed now, unit by unit, rather than after the whole model was packed.
    `copy=False`: the buffer already holds these bytes (shared with another process): only re-point."""
    with torch.no_grad():
        for e in entries:
            place = _view(host, e)
            if copy:
                place.copy_(_tensor_of(e).detach())
            _point(e, place)
    return_freed_host_memory()


def apply_streaming(model: nn.Module, spec: ModelSpec, plan: Plan, device: torch.device | str, *,
                    checkpointed: bool = False, mode: RunMode | None = None,
                    engine_cls: type[StreamingEngine] = StreamingEngine, host_buffers=None,
                    host_device: torch.device | str = "cpu") -> StreamingHandle:
    """Stream the plan's blocks (and optionally the non-block group) of `model` onto `device`.

    Call after fp8 storage and adapters, before checkpointing wraps the blocks. Streamed tensors end
    up as views of the device slots; the caller moves everything else to `device`. Host RAM peaks
    at the model plus one unit (see the module docstring). `host_buffers`: where the units' host
    buffers come from when several processes share them (memory/shared_host.py); None: private.
    `host_device`: where the packed units live (host RAM; another device in the simulation,
    memory/simulated.py).
    """
    mode = mode or RunMode()
    backend = _Backend(device)
    blocks = dict(spec.blocks(model))
    unknown = [n for n in plan.streamed_blocks if n not in blocks]
    if unknown:
        raise ValueError(f"memory.streamed_blocks: unknown block names {unknown[:5]}; this model's blocks are "
                         f"{next(iter(blocks), '?')} ... {list(blocks)[-1] if blocks else '?'}")
    if plan.ring_slots < 2:
        raise ValueError(f"memory.ring_slots must be >= 2, got {plan.ring_slots}")
    groups: list[tuple[str, list[nn.Module], bool]] = []
    if plan.stream_non_blocks:
        mods = [getattr(model, n) for n in spec.non_block_modules
                if hasattr(model, n) and any(True for _ in getattr(model, n).parameters())]
        if mods:
            groups.append(("non_blocks", mods, False))
    wanted = set(plan.streamed_blocks)
    for name, block in blocks.items():                # spec order = execution order
        if name in wanted:
            groups.append((name, [block], checkpointed))

    # Every unit is checked (trainable weights) before the first one is packed: a refused plan
    # leaves the model untouched.
    state_on_host = plan.optimizer_on_host and engine_cls.trains_weights
    layouts = [(name, mods, ckpt, *_collect(mods, name, engine_cls.trains_weights, state_on_host))
               for name, mods, ckpt in groups]
    pin = backend.cuda and plan.pin_memory and torch.device(host_device).type == "cpu"
    units: list[_Unit] = []
    for index, (name, mods, ckpt, entries, adapters, nbytes, _) in enumerate(layouts):
        shared = host_buffers.buffer(name, max(nbytes, ALIGN)) if host_buffers is not None else None
        host, unpin = _alloc_host(max(nbytes, ALIGN), pin, shared[0] if shared else None, host_device)
        _pack(host, entries, copy=not (shared and shared[1]))
        # On CPU "pinned" selects the direct copy path, pin_memory = false the staged one.
        direct = unpin is not None or (not backend.cuda and plan.pin_memory)
        units.append(_Unit(name, mods, entries, nbytes, host, direct, index % plan.ring_slots, ckpt, adapters,
                           unpin=unpin))

    k = min(plan.ring_slots, len(units))
    slot_bytes = max((u.nbytes for u in units), default=0)
    slot_bytes = -(-max(slot_bytes, ALIGN) // ALIGN) * ALIGN
    slots = []
    for _ in range(k):
        buf = torch.empty(slot_bytes, dtype=torch.uint8, device=backend.device)
        if plan.debug_poison:
            buf.fill_(POISON_BYTE)
        slot = _Slot(buf)
        if backend.cuda:        # the first copy into the slot waits for its allocation and poison fill,
            slot.free_event = backend.event()     # issued on the compute stream (and earlier compute)
            slot.free_event.record(backend.compute_stream())
        slots.append(slot)
    for u in units:                                   # re-point once: unit i always uses slot i mod K
        for e in u.entries:
            _point(e, _view(slots[u.slot].buf, e))

    engine = engine_cls(units, slots, backend, plan, mode)
    wrapped = []
    for u in units:
        for m in u.modules:
            w = _StreamedForward(engine, u, m)
            m.forward = w
            wrapped.append((m, w))
    hooks = [model.register_forward_pre_hook(lambda mod, args: engine.begin_forward()),
             model.register_forward_hook(lambda mod, args, out: engine.end_forward())]
    handle = StreamingHandle(engine, units, wrapped, hooks, total_blocks=len(blocks),
                             fp8=any(e.dtype == torch.float8_e4m3fn for u in units for e in u.entries),
                             host_modules=[m for layout in layouts for m in layout[-1]])
    return handle


def _quiesce(engine: StreamingEngine) -> None:
    """Wait until no copy reads a host buffer or writes a slot: the stager has issued everything it
    was given, and an event recorded after the last copy on the copy stream has completed."""
    engine._drain()
    close = getattr(engine, "close", None)            # workers of a subclass (trainable streaming)
    if close is not None:
        close()
    if engine.stager is not None:
        engine.stager.close()
        engine.stager = None
    be = engine.backend
    if be.cuda:
        done = be.event()
        done.record(be.copy_stream)
        done.synchronize()


def _unwrap(handle: StreamingHandle) -> None:
    """Restore the streamed modules' forwards and drop the model-level hooks."""
    for m, w in handle.wrapped:
        if w.prev is None:
            del m.forward
        else:
            m.forward = w.prev
    for h in handle.hooks:
        h.remove()
    handle.wrapped.clear()
    handle.hooks.clear()


def _check_unwrappable(handle: StreamingHandle) -> None:
    for m, w in handle.wrapped:
        if m.__dict__.get("forward") is not w:
            raise RuntimeError(f"streaming: {type(m).__name__}.forward was wrapped again after streaming; "
                               f"remove checkpointing before streaming")


def _drop_host(unit: _Unit) -> None:
    """Unpin (cudaHostUnregister) and free a unit's host buffer; nothing may view it any more."""
    if unit.unpin is not None:
        unit.unpin()
        unit.unpin = None
    unit.host = torch.empty(0, dtype=torch.uint8)


def remove_streaming(handle: StreamingHandle, device: torch.device | str | None = None) -> None:
    """Put every streamed tensor back as an ordinary tensor on `device` (default: the compute
    device) and restore the modules' forwards. Checkpointing must be removed first.

    Unit by unit: a unit's tensors are copied out, then its host buffer is freed, so restoring to
    the host needs one unit of extra RAM, not a second copy of the streamed blocks.
    """
    device = torch.device(device) if device is not None else handle.engine.backend.device
    _check_unwrappable(handle)
    engine = handle.engine
    _quiesce(engine)
    if engine.backend.cuda:                           # teardown, not the hot path: uses of the slots finish
        done = engine.backend.event()
        done.record(torch.cuda.current_stream(engine.backend.device))
        done.synchronize()
    with torch.no_grad():
        for u in handle.units:
            for e in u.entries:
                t = torch.empty(e.shape, dtype=e.dtype, device=device)
                t.copy_(_view(u.host, e))
                _point(e, t)
            _drop_host(u)
            return_freed_host_memory()
        for m in handle.host_modules:                 # a plain model keeps everything on `device`
            for attr, b in m._buffers.items():
                if b is not None:
                    m._buffers[attr] = b.to(device)
    _unwrap(handle)
    engine.slots.clear()
    engine.by_storage.clear()
    handle.units.clear()
    handle.host_modules.clear()


def release_streaming(handle: StreamingHandle) -> None:
    """Drop the engine's state without restoring any weight: in-flight copies are waited for (on an
    event, no device-wide synchronize), host buffers are unpinned and freed, slots are freed, the
    forwards and hooks are removed. The streamed modules are left with empty (0-element) weights,
    so the model cannot compute any more; use this for a model that is about to be dropped.
    Checkpointing must be removed first.
    """
    _check_unwrappable(handle)
    engine = handle.engine
    _quiesce(engine)
    with torch.no_grad():
        for u in handle.units:
            for e in u.entries:
                _point(e, torch.empty(0, dtype=e.dtype, device=engine.backend.device))
            _drop_host(u)
    _unwrap(handle)
    engine.slots.clear()
    engine.by_storage.clear()
    engine.fwd_order, engine.order, engine.log, engine.tracked = [], [], [], []
    engine.bwd_holds.clear()
    engine.end_holds.clear()
    handle.units.clear()
    return_freed_host_memory()
