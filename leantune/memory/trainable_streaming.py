"""Streaming of trainable weights (full fine-tuning): streamed blocks that also come back updated.

Reuses the streaming engine (memory/streaming.py: the schedule and its holds; streaming_units.py,
host_buffers.py, slot_ring.py: packed host buffers, ring slots, copy stream, events, poison) and adds
what trainable weights need:

- A streamed block's trainable weights *and their optimizer state* (the `ParamState` buffers that
  train/fused_optim.py registers under each weight's module) are packed into the block's host
  buffer, so one H2D copy brings both for the forward, again for the recompute/backward.
- The optimizer step runs inside the block's backward hold (train/in_backward.py), on the device,
  while the block is resident; each stepped weight marks its unit dirty.
- A dirty unit whose last hold ended keeps its slot (valid, updated) until another unit claims
  that slot: then, before the claimant's fetch, the slot is copied back D2H into the host buffer
  on a second copy stream (the write-back stream), after an event recorded on the compute stream;
  the slot's `free_event` becomes the write-back's completion event, so the H2D fetch into that
  slot (on the copy stream) waits for it: the slot is never refilled before its update is saved.
  Deferring to the claim writes a unit back once however often it is released in between (the
  non-block group is held once per module: the final layer's two Linears, then the embedders),
  and a unit used again before its slot is claimed is used from the slot. Poison (debug) fills
  the slot on the write-back stream after the copy. No device-wide synchronize.
- A unit acquired again while its write-back may still run (its slot still valid) makes the
  compute stream wait on that write-back before the next update.
- Stall accounting (what calibration reads as `stall_s`): the compute stream's wait on a pending
  write-back is timed with events, as a fetch's is; a write-back into a pageable host buffer (pin
  refused or off) returns only once the device has finished everything before it, so the thread's
  wait is counted too, and so is a CPU write-back (a synchronous copy).
- A unit stepped and not yet written back (its slot unclaimed, or backward interrupted by an
  out-of-memory error between two of its weights' updates) is written back when the engine drains
  (before a teardown or a save), so saves read the updates and the OOM re-plan's restore keeps the
  updates the redone step will skip.
- On CPU the same path runs with the CPU slot emulation (copies are synchronous), so CI tests it.

The optimizer step on the host (Plan.optimizer_on_host): the streamed units' optimizer state is not
packed (streaming_units.layout_unit leaves the ParamState modules in host RAM), so slots hold
weights only and no state crosses the bus. A trained weight's gradient, when complete, is copied to the host and its
update runs there on the weight's host-buffer view (`step_on_host`); the slot's copy is then out of
date for the stepped weights, so the unit is marked stale and its slot invalidated when backward
ends (or at once when the step runs after backward; nothing is written back). Within the backward
the slot stays usable: a weight's update runs after its last use in that backward, so the rest of
the unit (the non-block group's embedders after its final layer) is still current there. On CUDA the gradient goes to a pinned buffer on the write-back stream (after an event on the
compute stream; the device gradient is kept alive for that stream with record_stream) and one
worker thread waits for that copy's event and steps: the CPU steps overlap the rest of backward.
Pinned gradients in flight are bounded (`host_inflight_limit`: two of the largest unit's trained
gradients, each tensor's copy counted as the caching host allocator reserves it, rounded up to a
power of two: the plan's "gradient staging (pinned)" line); past it the thread waits for the oldest step (counted as stall). A unit is fetched
again only after its host steps finished (`_fetch` waits, counted as stall), and `_drain` waits for
all of them, so checkpoints and exports read updated host weights. On a CPU (or simulated) compute
device the copy and the step run synchronously. bitsandbytes' 8-bit AdamW cannot step on the host.

The host buffer is the authoritative copy of a streamed weight between steps: `WeightAccess`
reads and writes weights and optimizer state there (checkpoints, resume, export) after waiting for
pending write-backs, and invalidates the slots after a write so nothing stale is reused.
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor

import torch
from torch import nn

from .pinned_sizes import caching_host_size
from .slot_ring import POISON_BYTE, Slot
from .streaming import StreamingEngine
from .streaming_units import StreamedUnit, packed_view

_clock = time.perf_counter          # a seam: tests give a clock of their own


def host_step_worker(device: torch.device) -> ThreadPoolExecutor:
    """The one thread that runs host steps, with `device` as its current CUDA device. It makes CUDA
    calls (an event's synchronize, freeing pinned gradients); a new thread's current device is
    device 0, so on cuda:1 those calls would open a context on GPU 0 (hundreds of MB there) and act
    in the wrong context. GPU-only in effect; bench/gpu_checks.sh checks it on two GPUs. Its host
    kernels leave a core to the autograd thread, which runs the device's backward meanwhile and
    launches its kernels (native.leave_a_core)."""
    return ThreadPoolExecutor(1, thread_name_prefix="leantune-host-step", initializer=_host_step_thread,
                              initargs=(device,))


def _host_step_thread(device: torch.device) -> None:
    from ..native import leave_a_core

    torch.cuda.set_device(device)
    leave_a_core()


class TrainableStreamingEngine(StreamingEngine):
    trains_weights = True
    saved_views_as_handles = True                     # weights stepped in place in backward (streaming.py)

    def __init__(self, units: list[StreamedUnit], slots: list[Slot], backend, plan, mode):
        super().__init__(units, slots, backend, plan, mode)
        be = self.backend
        self.writeback_stream = torch.cuda.Stream(be.device) if be.cuda else None
        self.dirty: set[int] = set()                  # id(unit) stepped since its last write-back
        self.written: dict[int, object] = {}         # id(unit) -> write-back completion event (CUDA)
        self.unit_of: dict[int, StreamedUnit] = {}   # id(trainable Parameter) -> its unit
        self.host_views: dict[int, torch.Tensor] = {}   # id(trainable Parameter) -> its host-buffer view
        grads: dict[int, int] = {}                    # id(unit) -> pinned bytes of its gradients' host copies
        for u in self.units:
            for e in u.entries:
                for m, kind, attr in e.owners:
                    if kind == "param" and m._parameters[attr].requires_grad:
                        self.unit_of[id(m._parameters[attr])] = u
                        self.host_views[id(m._parameters[attr])] = packed_view(u.host, e)
                        grads[id(u)] = grads.get(id(u), 0) + caching_host_size(e.nbytes)
        self.bytes_d2h = 0
        # The optimizer step on the host (module docstring).
        self.host_step = plan.optimizer_on_host
        self.stale: set[int] = set()                  # id(unit) whose host copy was stepped since its fetch
        self.pending: dict[int, list[Future]] = {}    # id(unit) -> host steps in flight (CUDA)
        self.host_inflight_limit = 2 * max(grads.values(), default=0)
        self._inflight: deque[tuple[Future, int]] = deque()   # in submission order (one worker: FIFO)
        self._inflight_bytes = 0
        self.host_worker = host_step_worker(be.device) if self.host_step and be.cuda else None

    def mark_stepped(self, p: nn.Parameter) -> None:
        """`p` was updated in place (in its slot): its unit must be written back before reuse."""
        if self.steps_on_host(p):
            return                                    # its host copy was stepped: see step_on_host
        u = self.unit_of.get(id(p))
        if u is not None:
            self.dirty.add(id(u))

    # -- the optimizer step on the host ----------------------------------------------------------------
    def steps_on_host(self, p: nn.Parameter) -> bool:
        return self.host_step and id(p) in self.host_views

    def step_on_host(self, p: nn.Parameter, grad: torch.Tensor | None, step, norm: bool = False) -> None:
        """Run `step(host_weight, host_grad, grad_norm)` for streamed weight `p` on the host: `grad`
        is its gradient on the compute device (None: the step needs no device gradient).

        `norm`: the step clips by the gradient's norm. On a CUDA device the norm is taken there,
        before the copy (a few microseconds of the device's bandwidth), and comes back beside the
        gradient, so the host's pass over the gradient is the update's alone: the norm pass was a
        third of the host step's time for fp32 weights (bench/host_step.py). On a CPU compute device
        the host takes it (grad_norm None)."""
        unit = self.unit_of[id(p)]
        weight = self.host_views[id(p)]
        self.stale.add(id(unit))
        if unit.refs == 0 and self.phase != "backward":
            self._invalidate_stale()                  # stepped after backward (finish_step)
        be = self.backend
        if grad is None:
            if self.host_worker is None:
                step(weight, None, None)
            else:
                self._submit(unit, 0, lambda: step(weight, None, None))
            return
        n = grad.numel() * grad.element_size()
        self.bytes_d2h += n
        if self.host_worker is None:                  # CPU compute device: the copy is a stall, as on CPU
            t0 = _clock()
            host_grad = grad.to(weight.device)
            self.stats.stall_s += _clock() - t0
            step(weight, host_grad, None)
            return
        self._make_room(caching_host_size(n))         # what the caching host allocator reserves for it
        # fp32 arithmetic whatever the gradient's dtype, as clipping on the device takes it
        # (train/fused_optim.clip_in_place); queued on the compute stream before the event below.
        device_norm = torch.linalg.vector_norm(grad, dtype=torch.float32) if norm else None
        used = be.event()
        used.record(be.compute_stream())              # the gradient is complete on the compute stream
        host_grad = torch.empty(grad.shape, dtype=grad.dtype, pin_memory=True)
        host_norm = torch.empty((), dtype=torch.float32, pin_memory=True) if norm else None
        wb = self.writeback_stream
        with torch.cuda.stream(wb):
            wb.wait_event(used)
            host_grad.copy_(grad, non_blocking=True)
            if device_norm is not None:
                host_norm.copy_(device_norm, non_blocking=True)
            copied = be.event()
            copied.record(wb)
        grad.record_stream(wb)                        # its memory is not reused before the copy ends
        if device_norm is not None:
            device_norm.record_stream(wb)

        def run() -> None:
            copied.synchronize()                      # this copy only, on the worker thread
            step(weight, host_grad, None if host_norm is None else float(host_norm))

        self._submit(unit, caching_host_size(n), run)

    def _make_room(self, nbytes: int) -> None:
        """Before a pinned gradient of `nbytes` is allocated: past the in-flight limit, wait for the
        oldest host steps (the worker runs them in order, so the oldest finishes first and frees
        its pinned gradient). The wait is a stall."""
        t0 = _clock()
        while self._inflight and (self._inflight[0][0].done()
                                  or self._inflight_bytes + nbytes > self.host_inflight_limit):
            done, n = self._inflight.popleft()
            done.result()
            self._inflight_bytes -= n
        self.stats.stall_s += _clock() - t0

    def _submit(self, unit: StreamedUnit, nbytes: int, fn) -> None:
        """Queue a host step holding `nbytes` of pinned gradient (room made first: _make_room)."""
        fut = self.host_worker.submit(fn)
        self._inflight.append((fut, nbytes))
        self._inflight_bytes += nbytes
        self.pending.setdefault(id(unit), []).append(fut)

    def _wait_host_steps(self, unit: StreamedUnit | None = None) -> None:
        """Wait for the host steps of `unit` (all units: None); their errors surface here."""
        keys = list(self.pending) if unit is None else [id(unit)]
        t0 = _clock()
        for k in keys:
            for f in self.pending.pop(k, []):
                f.result()
        if keys:
            self.stats.stall_s += _clock() - t0

    @contextlib.contextmanager
    def holding(self, p: nn.Parameter):
        """Keep `p`'s unit resident around an update made outside its backward hold (a weight whose
        gradient came only from earlier micro-batches, train/in_backward.py): outside a hold its
        slot may hold another unit's bytes or poison. The release writes the unit back."""
        unit = self.unit_of.get(id(p))
        if unit is None:
            yield
            return
        self.acquire(unit)
        try:
            yield
        finally:
            self.release(unit)

    # -- hooks of StreamingEngine ------------------------------------------------------------------
    def _retire(self, unit: StreamedUnit, slot: Slot) -> None:
        if id(unit) not in self.dirty:
            return super()._retire(unit, slot)
        # Written back when its slot is claimed (_fetch) or the engine drains; poisoned then.
        self.copies.mark_free(slot)

    def _fetch(self, unit: StreamedUnit, demand: bool) -> None:
        slot = self.slots[unit.slot]
        owner = slot.owner
        if owner is not None and owner is not unit and id(owner) in self.dirty and slot.valid:
            self._write_back(owner, slot, self.poison)   # the claimed slot's update goes home first
        if self.pending.get(id(unit)):
            self._wait_host_steps(unit)               # the copy must read the stepped host weights
        super()._fetch(unit, demand)

    def _invalidate_stale(self) -> None:
        """Slots of units stepped on the host hold old weights: fetch them afresh next time."""
        for u in self.units:
            if id(u) in self.stale and u.refs == 0:
                slot = self.slots[u.slot] if self.slots else None
                if slot is not None and slot.owner is u:
                    slot.valid = False
                self.stale.discard(id(u))

    def _backward_ended(self) -> None:
        self._invalidate_stale()

    def _write_back(self, unit: StreamedUnit, slot: Slot, poison: bool) -> None:
        """Copy a stepped unit's slot into its host buffer (then poison the slot if asked)."""
        self.dirty.discard(id(unit))
        n = unit.nbytes
        self.bytes_d2h += n
        be = self.backend
        if not be.cuda:
            t0 = _clock()
            unit.host[:n].copy_(slot.buf[:n])
            self.stats.stall_s += _clock() - t0     # nothing overlaps on CPU: the copy is a stall
            if poison:
                slot.buf.fill_(POISON_BYTE)
                slot.valid = False
            return
        used = be.event()
        used.record(be.compute_stream())             # every update of the slot is issued before this
        wb = self.writeback_stream
        with torch.cuda.stream(wb):
            wb.wait_event(used)
            t0 = _clock()
            unit.host[:n].copy_(slot.buf[:n], non_blocking=unit.pinned)
            if not unit.pinned:                     # returned only once the device got here
                self.stats.stall_s += _clock() - t0
            if poison:
                slot.buf.fill_(POISON_BYTE)
                slot.valid = False
            done = be.event()
            done.record(wb)
            # The slot gets an event of its own: its next release re-records its free event on the
            # compute stream, which must not move this write-back's completion (what `_drain` and
            # the next fetch wait for before the host copy is read).
            free = be.event()
            free.record(wb)
        slot.free_event = free
        self.written[id(unit)] = done

    def _make_resident(self, unit: StreamedUnit) -> None:
        # Kept (not popped) until _drain: the compute stream waiting for a write-back does not make
        # the host buffer safe to read, and a save reads it after draining.
        done = self.written.get(id(unit))
        if done is not None and not done.query():
            stream = self.backend.compute_stream()
            before, after = self.backend.event(timing=True), self.backend.event(timing=True)
            before.record(stream)
            stream.wait_event(done)
            after.record(stream)
            self.stats.add("pending_stall", before, after)
        super()._make_resident(unit)

    def _drain(self) -> None:
        # A unit stepped but never released (a backward interrupted between two of its weights'
        # updates, e.g. by an out-of-memory error) holds those updates in its slot only, and the
        # redone step skips the weights already stepped: write it back before a teardown (the OOM
        # re-plan's remove) or a save reads the host copy.
        for u in self.units:
            slot = self.slots[u.slot] if self.slots else None
            if id(u) in self.dirty and slot is not None and slot.owner is u and slot.valid:
                self._write_back(u, slot, poison=False)
        for done in self.written.values():
            done.synchronize()
        self.written.clear()
        self._wait_host_steps()

    # -- host access -------------------------------------------------------------------------------
    def invalidate(self) -> None:
        """Host buffers were written: no slot may be reused without a fresh fetch."""
        for s in self.slots:
            s.valid = False

    def close(self) -> None:
        """The engine is torn down (streaming.remove/release, after draining): stop the worker and
        drop the views of the host buffers. Teardown frees each unit's buffer right after copying
        it out; a view kept here would keep every buffer's memory until the engine itself died,
        so a re-plan would hold two copies of the streamed blocks."""
        if self.host_worker is not None:
            self.host_worker.shutdown(wait=True)
            self.host_worker = None
        self.host_views.clear()
        self._inflight.clear()
        self._inflight_bytes = 0

    def report(self, wait: bool = False) -> dict:
        out = super().report(wait)
        out["bytes_d2h"], self.bytes_d2h = self.bytes_d2h, 0
        return out


class WeightAccess:
    """The authoritative tensor of each parameter or buffer of a model under the memory engine:
    the host-buffer view for streamed ones (after pending write-backs finished), the tensor itself
    otherwise. Reading streamed weights this way costs no copy of the model."""

    def __init__(self, memory_handle=None):
        self.engine = None
        self.views: dict[tuple[int, str], torch.Tensor] = {}
        streaming = getattr(memory_handle, "streaming", None) if memory_handle is not None else None
        if streaming is not None:
            self.engine = streaming.engine
            for u in streaming.units:
                for e in u.entries:
                    for m, _, attr in e.owners:
                        self.views[(id(m), attr)] = packed_view(u.host, e)
        self.synced = False

    def _sync(self) -> None:
        if self.engine is not None and not self.synced:
            self.engine._drain()
            self.synced = True

    def get(self, module: nn.Module, attr: str) -> torch.Tensor:
        view = self.views.get((id(module), attr))
        if view is not None:
            self._sync()
            return view
        t = module._parameters.get(attr)
        if t is None:
            t = module._buffers[attr]
        return t.detach()

    def set(self, module: nn.Module, attr: str, value: torch.Tensor) -> None:
        with torch.no_grad():
            self.get(module, attr).copy_(value)
        if (id(module), attr) in self.views and isinstance(self.engine, TrainableStreamingEngine):
            self.engine.invalidate()
