"""The device slots of weight streaming and the copies into them.

The GPU holds K slots (a ring, K >= 2), each as large as the largest unit. Unit i always uses slot
i mod K, so its module parameters are re-pointed once, at apply time, at views of that slot: a
fetch is then a single copy, with no per-step Python re-pointing. A unit with a slot to itself
stays resident; outside its hold window a streamed module sees whatever its slot holds.

Copies run on a dedicated copy stream (memory/copy_streams.py). Compute waits on the copy's event
before using a unit (`wait_ready`); a slot is refilled only after the event recorded on the compute
stream at its last use (`mark_free`, the slot's `free_event`). No device- or stream-wide
synchronize anywhere in the per-block path. A pinned host buffer is copied directly; a pageable one
through the staging worker (memory/host_buffers.py).

`poison` (debug): a released slot is filled with 0xFF bytes, which is NaN in every float dtype,
so any use of a weight outside its hold window turns the loss NaN. On CPU the slots are separate
host buffers, and streams and events are absent, so the same schedule runs there.

Which unit is fetched when is not decided here: that is the schedule (memory/streaming.py).
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from .copy_streams import CopyBackend
from .host_buffers import Stager
from .streaming_stats import StreamStats
from .streaming_units import StreamedUnit

POISON_BYTE = 0xFF           # all-ones bits: NaN in fp32, bf16, fp16 and e4m3fn


@dataclass(eq=False)
class Slot:
    buf: torch.Tensor                  # (slot_bytes,) uint8 on the compute device
    owner: StreamedUnit | None = None
    valid: bool = False                # owner's bytes are (being) copied in and not poisoned
    ready: object = None               # None | CUDA event | Future of the staged copy
    free_event: object = None          # CUDA event recorded at the last release
    typed: dict = field(default_factory=dict)
    heads: dict = field(default_factory=dict)     # nbytes -> buf[:nbytes], the destination of a fetch

    def head(self, nbytes: int) -> torch.Tensor:
        """The slot's first `nbytes`, as one view kept per size (a fetch per unit per step; a
        fresh slice is a tensor allocation each time)."""
        v = self.heads.get(nbytes)
        if v is None:
            v = self.heads[nbytes] = self.buf[:nbytes]
        return v

    def view_as_dtype(self, dtype: torch.dtype) -> torch.Tensor:
        v = self.typed.get(dtype)
        if v is None:
            v = self.typed[dtype] = self.buf.view(dtype)
        return v


def allocate_ring(count: int, slot_bytes: int, backend: CopyBackend, poison: bool) -> list[Slot]:
    """`count` empty slots of `slot_bytes` on the compute device (poisoned if asked)."""
    slots = []
    for _ in range(count):
        buf = torch.empty(slot_bytes, dtype=torch.uint8, device=backend.device)
        if poison:
            buf.fill_(POISON_BYTE)
        slot = Slot(buf)
        if backend.cuda:        # the first copy into the slot waits for its allocation and poison fill,
            slot.free_event = backend.event()     # issued on the compute stream (and earlier compute)
            slot.free_event.record(backend.compute_stream())
        slots.append(slot)
    return slots


class SlotCopies:
    """Issues the host->device copies into the slots, waits for them, and marks when a slot may be
    refilled. `staged`: some unit's host buffer is pageable, so the staging worker is needed."""

    def __init__(self, backend: CopyBackend, stats: StreamStats, staged: bool):
        self.backend, self.stats = backend, stats
        self.stager = Stager(backend, stats) if staged else None

    def fetch(self, unit: StreamedUnit, slot: Slot, demand: bool) -> None:
        """Copy `unit` into `slot`. Copies into one slot are serialized: a staged copy still queued
        on the worker would otherwise land after a direct copy issued now, and the slot would hold
        the previous unit's bytes while naming the new one. So while the slot's last copy is a
        pending staged one, the new copy is queued behind it on the same worker (FIFO); every
        issued copy is on the one copy stream, which orders the rest."""
        n = unit.nbytes
        ready = slot.ready
        queued = isinstance(ready, Future) and not ready.done()
        if unit.disk is not None:                     # the third tier: read on the staging worker
            slot.ready = self.stager.submit_read(unit.disk, slot.head(n), slot.free_event)
        elif unit.pinned and not queued:
            slot.ready = self.copy_direct(unit.host, slot.head(n), slot.free_event)
        elif unit.pinned:
            slot.ready = self.stager.pool.submit(self.copy_direct, unit.host, slot.head(n), slot.free_event, True)
        else:
            slot.ready = self.stager.submit(unit.host, slot.head(n), slot.free_event)
        slot.owner, slot.valid = unit, True
        self.stats.bytes += n
        self.stats.copies += 1
        self.stats.demand += int(demand)

    def copy_direct(self, src: torch.Tensor, dst: torch.Tensor, free_event, on_worker: bool = False):
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

    def wait_ready(self, slot: Slot) -> None:
        """Make compute wait for the slot's last copy (on CUDA: the compute stream waits on its event)."""
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

    def retire(self, slot: Slot, poison: bool) -> None:
        """A slot's unit was released: poison it (debug) and mark when it may be refilled."""
        if poison:
            slot.buf.fill_(POISON_BYTE)               # on the compute stream, after every use
            slot.valid = False
        self.mark_free(slot)

    def mark_free(self, slot: Slot) -> None:
        """Record on the compute stream the event the next copy into `slot` waits for."""
        stream = self.backend.compute_stream()
        if stream is not None:
            if slot.free_event is None:
                slot.free_event = self.backend.event()
            slot.free_event.record(stream)

    def close(self) -> None:
        """Wait until no copy reads a host buffer or writes a slot: the stager has issued everything
        it was given, and an event recorded after the last copy on the copy stream has completed."""
        if self.stager is not None:
            self.stager.close()
            self.stager = None
        be = self.backend
        if be.cuda:
            done = be.event()
            done.record(be.copy_stream)
            done.synchronize()
