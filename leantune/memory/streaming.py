"""Weight streaming ("block swap"): frozen block weights live in host RAM and visit the GPU in turn.

What it trades: VRAM for PCIe traffic. Each streamed block costs one host->GPU copy per use (one in
forward, one in backward) and K slots of VRAM in total, however many blocks stream. When the
streamed blocks are spread through the stack, the resident blocks' compute hides the copies.

This module is the schedule: which unit is fetched, waited for, held and released, and when. The
parts it drives have one module each (each docstring says how and why):
- streaming_units.py: a *unit* (one streamed block, or optionally all non-block modules as one
  group) and its tensors packed into one host buffer, unit by unit, so host RAM peaks at the model
  plus one unit; a block's frozen base adapters (train/base_adapters.py) travel in its unit too.
- host_buffers.py: the host buffers, page-aligned and pinned (cudaHostRegister) where possible; a
  pageable one is copied through a small pinned staging pool by a worker thread.
- slot_ring.py, copy_streams.py: K device slots (a ring, K >= 2), unit i always in slot i mod K;
  copies on a dedicated copy stream, ordered by events only (no synchronize in the per-block path);
  `poison` (debug) fills a released slot with NaN bytes.
- streamed_forward.py: the per-block hook, a forward wrapper that calls `acquire`/`release` around
  the forward and leaves one backward boundary on the call's output nodes (`backward_boundary`).
- saved_tensors.py: trainable streaming without checkpointing: a saved slot view becomes a handle
  rebuilt in backward. Frozen weights need no hook: a saved weight is the weight itself, read from
  its slot while the unit is held again, and residency is checked once per block
  (`saved_views_as_handles`, `check_resident`).
- streaming_stats.py: bytes, copy and stall times, read by calibration.

The schedule (StreamingEngine):
- A unit is held while its weights are in use: in forward around its call, in backward from its
  call's boundary (its output nodes are about to run) to the next boundary, an earlier call's (or
  to the end of backward for the first call). The first hold makes it resident (fetched on demand
  unless prefetched; compute waits for its copy's event); the last release retires its slot
  (poison; the event the next copy into the slot waits for) and prefetches.
- Prefetch follows the expected order: the forward order learned from the previous step, its
  reverse for backward, and at the end of backward (or of a no-grad forward) the start of the next
  forward. A fetch that was not prefetched still happens on demand; order affects speed only.
- Forward-only mode (sampling, under no_grad) keeps the ring cycling across calls: the first units
  of the next denoising step are fetched at the end of the current one, resident blocks never move,
  and a model whose streamed units fit the ring moves nothing after the first step. A grad-enabled
  call in that mode is refused rather than silently losing the streamed blocks' gradients.
- The same schedule runs on CPU (slots are separate host buffers, streams and events are absent),
  which lets CI test it.

Teardown: `remove_streaming` copies every streamed tensor back to ordinary tensors (unit by unit,
freeing each host buffer as it goes); `release_streaming` only drops the engine's state (buffers,
pins, slots, wrappers, hooks) and leaves the streamed modules without weights, for a model that is
about to be discarded (after sampling) where a copy back could not even fit on the device.

How it differs from kohya's block swap: no cap on the number of blocks (kohya asserts <= 35 for
Flux), no per-swap `synchronize()` of the current stream, H2D only for frozen weights, sampling does
not re-place every block per step, and streaming composes with activation checkpointing.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
from torch import nn

from ..spec import ModelSpec
from .copy_streams import CopyBackend
from .disk_tier import DiskTierFile, room_split
from .host_buffers import alloc_host, return_freed_host_memory
from .plan import Plan
from .saved_tensors import SlotSavedTensors, check_resident
from .slot_ring import Slot, SlotCopies, allocate_ring
from .streamed_forward import StreamedForward
from .streaming_stats import StreamStats
from .streaming_units import (
    ALIGN,
    StreamedUnit,
    free_host_buffer,
    layout_unit,
    pack_unit,
    packed_view,
    point_owners,
)


class RunMode:
    """Shared switch between training and forward-only (sampling) execution."""

    def __init__(self) -> None:
        self.forward_only = False


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
    write updated weights back through the `_retire`, `_fetch`, `_make_resident` and `_drain` hooks.
    """

    trains_weights = False
    # Whether a streamed unit's forward (without checkpointing) runs under the saved-tensor hooks
    # that turn saved slot views into handles (saved_tensors.py). Frozen weights need none: each
    # streamed tensor's owner has a version counter of its own (streaming_units.point_owners), so a
    # saved weight is the weight itself, read from its slot in backward while the unit is held
    # again, and its residency is checked once per block (`check_resident`, from its boundary)
    # instead of once per saved tensor. Trained weights are stepped in place during backward, so they keep
    # the handles.
    saved_views_as_handles = False

    def __init__(self, units: list[StreamedUnit], slots: list[Slot], backend: CopyBackend, plan: Plan,
                 mode: RunMode):
        self.units, self.slots, self.backend, self.mode = units, slots, backend, mode
        self.poison = plan.debug_poison
        self.stats = StreamStats()
        self.copies = SlotCopies(backend, self.stats, staged=any(not u.pinned for u in units))
        self.saved_tensors = SlotSavedTensors(slots)
        self.fwd_order: list[StreamedUnit] = list(units)     # learned from each forward
        self.order: list[StreamedUnit] = list(units)
        self.cursor = -1
        self.phase = "idle"                           # idle | forward | backward
        self.log: list[StreamedUnit] = []             # units acquired in this forward
        self.tracked: list[StreamedUnit] = []         # units whose weights backward will need
        self.bwd_holds: list[StreamedUnit] = []       # holds taken in backward, not yet released
        self.callback_queued = False
        self.backward_epoch = 0                       # counts backward passes (a retained graph's too)
        self.held = 0

    # -- phases (model-level hooks and autograd boundaries) -------------------------------------
    def begin_forward(self) -> None:
        for u in self.units:                          # holds left by an interrupted backward
            while u.refs:
                self.release(u)
        self.bwd_holds.clear()
        # An interrupted backward (an exception, e.g. out of memory) never ran the end-of-backward
        # callback it queued: without this the next backward would queue none and keep its
        # held-to-the-end units held past its end.
        if self.callback_queued:
            self._backward_ended()
        self.callback_queued = False
        self.phase, self.order, self.cursor = "forward", self.fwd_order, -1
        self.log, self.tracked = [], []
        self.backend.bind_forward()                   # waits and releases use the forward's stream
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

    def note_tracked(self, unit: StreamedUnit) -> None:
        if self.phase == "forward":
            self.tracked.append(unit)

    def backward_boundary(self, boundary) -> None:
        """A streamed call's backward boundary fired (streamed_forward.Boundary): the backward of
        every later call is done, so their holds end; this call's unit is held from here until the
        next boundary (an earlier call's) or the end of backward. A unit already held (the
        non-block group's consecutive modules) keeps its hold rather than retire and refetch."""
        if not self.callback_queued:
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
            self.callback_queued = True
            self.backward_epoch += 1
            if self.phase != "backward":
                self.phase, self.order, self.cursor = "backward", list(reversed(_dedupe(self.tracked))), -1
        if boundary.epoch == self.backward_epoch:
            return                                    # another of the call's output nodes fired it
        boundary.epoch = self.backward_epoch
        unit, kept = boundary.unit, False
        for u in self.bwd_holds:
            if u is unit and not kept:
                kept = True
            else:
                self.release(u)
        self.bwd_holds.clear()
        if kept:
            self.bwd_holds.append(unit)
        else:
            self.backward_begin(unit)
        self.check_resident(unit)                     # once per block, before any of its saved weights is read

    def backward_begin(self, unit: StreamedUnit) -> None:
        """Hold `unit` for its backward (released by the next boundary or the end of backward)."""
        self.acquire(unit)
        self.bwd_holds.append(unit)

    def _end_backward(self) -> None:
        self.callback_queued = False
        for u in self.bwd_holds:                      # the first call's, or any no boundary reached
            self.release(u)
        self.bwd_holds.clear()
        self.phase, self.order, self.cursor = "idle", self.fwd_order, -1
        self._backward_ended()
        self._prefetch()                              # the next forward's first units

    def _backward_ended(self) -> None:
        """A hook: backward ended, or was interrupted and the next forward released its holds
        (trainable streaming uses it)."""

    # -- holding ---------------------------------------------------------------------------------
    def acquire(self, unit: StreamedUnit) -> None:
        if unit.refs == 0:
            self._make_resident(unit)
            self.held += 1
            self.stats.held_max = max(self.stats.held_max, self.held)
        unit.refs += 1
        self._advance(unit)
        if self.phase == "forward" and (not self.log or self.log[-1] is not unit):
            self.log.append(unit)

    def release(self, unit: StreamedUnit) -> None:
        unit.refs -= 1
        if unit.refs:
            return
        self.held -= 1
        self._retire(unit, self.slots[unit.slot])
        self._prefetch()

    def check_resident(self, unit: StreamedUnit) -> None:
        """Refuse a backward that would read `unit`'s weights while its slot does not hold them."""
        check_resident(unit, self.slots[unit.slot])

    def _make_resident(self, unit: StreamedUnit) -> None:
        slot = self.slots[unit.slot]
        if not (slot.owner is unit and slot.valid):
            if slot.owner is not None and slot.owner.refs > 0:
                raise RuntimeError(
                    f"streaming: {unit.name} needs ring slot {unit.slot}, which {slot.owner.name} still holds; "
                    f"these units are used at the same time, so raise memory.ring_slots")
            self._fetch(unit, demand=True)
        self.copies.wait_ready(slot)

    def _fetch(self, unit: StreamedUnit, demand: bool) -> None:
        """Copy `unit` into its slot (a hook: trainable streaming writes the claimed slot back first)."""
        self.copies.fetch(unit, self.slots[unit.slot], demand)

    def _retire(self, unit: StreamedUnit, slot: Slot) -> None:
        """A unit's last hold ended: poison its slot (debug) and mark when the slot may be refilled."""
        self.copies.retire(slot, self.poison)

    def _drain(self) -> None:
        """Wait for copies other than the H2D fetches (none here; write-backs in the subclass)."""

    # -- prefetch --------------------------------------------------------------------------------
    def _advance(self, unit: StreamedUnit) -> None:
        """Move the cursor to `unit` in the expected order and prefetch from there. A unit already
        under the cursor (a group's next module) moves nothing: every change since the last
        prefetch that could start a copy (a release, a new order) prefetched itself."""
        order = self.order
        if 0 <= self.cursor < len(order) and order[self.cursor] is unit:
            return
        for i in range(self.cursor + 1, len(order)):
            if order[i] is unit:
                self.cursor = i
                break
        self._prefetch()

    def _prefetch(self) -> None:
        """Fetch the next units of the expected order into free slots, at most one ring ahead."""
        order, k = self.order, len(self.slots)
        # The unit under the cursor may be called again (a group's consecutive modules): keep it.
        window: list[StreamedUnit] = [order[self.cursor]] if 0 <= self.cursor < len(order) else []
        i = self.cursor + 1
        n = len(order)
        slots = self.slots
        while i < n and len(window) < k:
            unit = order[i]
            i += 1
            if unit in window:                        # identity: units compare by identity (eq=False)
                continue
            window.append(unit)
            slot = slots[unit.slot]
            owner = slot.owner
            if owner is unit:
                if slot.valid:
                    continue
            elif owner is not None and (owner.refs > 0 or owner in window):
                break                                 # the slot's owner is in use or needed sooner
            self._fetch(unit, demand=False)

    def report(self, wait: bool = False) -> dict:
        return self.stats.report(self.units, self.slots, self.held, wait)


# -- apply / remove ----------------------------------------------------------------------------------

@dataclass
class StreamingHandle:
    engine: StreamingEngine
    units: list[StreamedUnit]
    wrapped: list[tuple[nn.Module, StreamedForward]]
    hooks: list
    total_blocks: int
    fp8: bool
    # Modules whose tensors stay in host RAM, neither packed nor placed on the device: the
    # streamed blocks' optimizer state under Plan.optimizer_on_host.
    host_modules: list[nn.Module] = field(default_factory=list)
    disk: object = None                # memory/disk_tier.DiskTierFile of the plan's disk_blocks, or None

    @property
    def host_bytes(self) -> int:
        return sum(u.host.numel() for u in self.units)

    @property
    def disk_blocks(self) -> tuple[str, ...]:
        """The streamed blocks whose packed bytes are on disk, in packing order."""
        return tuple(u.name for u in self.units if u.disk is not None)

    @property
    def disk_bytes(self) -> int:
        return sum(u.nbytes for u in self.units if u.disk is not None)

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
        adapters = sum(e.nbytes for u in self.units for e in u.entries if e.base_adapter)
        return (f"streaming: {nblocks}/{self.total_blocks} blocks{extra} ({'fp8' if self.fp8 else 'no fp8'}, "
                f"{self.host_bytes / 2**30:.1f} GB host{where}"
                + (f", base adapters {_size(adapters)} of it" if adapters else "")
                + (f"; {len(self.disk_blocks)} of the blocks, {_size(self.disk_bytes)}, read from disk"
                   if self.disk_blocks else "") + f"), ring {ring}"
                + (f" x {_size(self.engine.slots[0].buf.numel())}" if ring else "")
                + (", poison" if self.engine.poison else ""))


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GB" if n >= 2**30 else (f"{n / 2**20:.0f} MB" if n >= 2**20 else f"{n / 2**10:.0f} KB")


def apply_streaming(model: nn.Module, spec: ModelSpec, plan: Plan, device: torch.device | str, *,
                    checkpointed: bool = False, mode: RunMode | None = None,
                    engine_cls: type[StreamingEngine] = StreamingEngine, host_buffers=None,
                    host_device: torch.device | str = "cpu", disk_dir=None,
                    disk_room: int | None = None, parked=None) -> StreamingHandle:
    """Stream the plan's blocks (and optionally the non-block group) of `model` onto `device`.

    Call after fp8 storage and adapters, before checkpointing wraps the blocks. Streamed tensors end
    up as views of the device slots; the caller moves everything else to `device`. Host RAM peaks
    at the model plus one unit (memory/streaming_units.py). `host_buffers`: where the units' host
    buffers come from when several processes share them (memory/shared_host.py); None: private.
    `host_device`: where the packed units live (host RAM; another device in the simulation,
    memory/simulated.py). `disk_dir`: the folder of the disk tier's file for the plan's
    disk_blocks (memory/disk_tier.py); each such unit is written there as soon as it is packed and
    its host buffer freed, so host RAM never holds them all. `disk_room` (with `disk_dir`, for a
    plan that names no disk_blocks itself): the host bytes the streamed blocks' buffers may take;
    the streamed blocks beyond it go to disk (disk_tier.disk_split over their packed sizes), and
    the handle's `disk_blocks` says which. `parked`: the loader's memory/disk_load.BlockSpill
    when the disk-tier blocks were loaded straight to disk; each parked block's file pages are
    dropped from the page cache once its unit is packed.
    """
    mode = mode or RunMode()
    backend = CopyBackend(device)
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
        # a ModuleDict / ModuleList is never called itself, its entries are (Z-Image's per-patch-size
        # all_x_embedder / all_final_layer): the hooks go on them
        mods = [c for m in mods for c in (m.values() if isinstance(m, nn.ModuleDict) else
                                          m if isinstance(m, nn.ModuleList) else (m,))]
        if mods:
            groups.append(("non_blocks", mods, False))
    wanted = set(plan.streamed_blocks)
    for name, block in blocks.items():                # spec order = execution order
        if name in wanted:
            groups.append((name, [block], checkpointed))

    # Every unit is checked (trainable weights) before the first one is packed: a refused plan
    # leaves the model untouched.
    state_on_host = plan.optimizer_on_host and engine_cls.trains_weights
    layouts = [(name, mods, ckpt, *layout_unit(mods, name, engine_cls.trains_weights, state_on_host))
               for name, mods, ckpt in groups]
    if disk_room is not None and disk_dir is not None and not plan.disk_blocks and not engine_cls.trains_weights:
        sizes = [(name, max(nbytes, ALIGN)) for name, _, _, _, _, nbytes, _ in layouts]
        plan = replace(plan, disk_blocks=room_split(sizes, wanted, disk_room))
    disk_names = set(plan.disk_blocks)
    if disk_names:
        if not disk_names <= set(plan.streamed_blocks):
            raise ValueError(f"memory.disk_blocks: {sorted(disk_names - set(plan.streamed_blocks))[:5]} are not "
                             f"streamed; the disk tier holds streamed blocks only")
        if engine_cls.trains_weights:
            raise ValueError("memory.disk_blocks: a full fine-tune writes its streamed blocks back each step; "
                             "the disk tier holds frozen blocks (a LoRA run's) only")
        if disk_dir is None:
            raise ValueError("memory.disk_blocks needs a folder for the disk tier's file (apply_streaming's disk_dir)")
    pin = backend.cuda and plan.pin_memory and torch.device(host_device).type == "cpu"
    units: list[StreamedUnit] = []
    tier = DiskTierFile(disk_dir) if disk_names else None
    for index, (name, mods, ckpt, entries, adapters, nbytes, _) in enumerate(layouts):
        on_disk = name in disk_names
        shared = host_buffers.buffer(name, max(nbytes, ALIGN)) if host_buffers is not None and not on_disk else None
        host, unpin = alloc_host(max(nbytes, ALIGN), pin and not on_disk, shared[0] if shared else None, host_device,
                                 backend.device if backend.cuda else None)
        pack_unit(host, entries, copy=not (shared and shared[1]))
        # On CPU "pinned" selects the direct copy path, pin_memory = false the staged one.
        direct = unpin is not None or (not backend.cuda and plan.pin_memory and not on_disk)
        unit = StreamedUnit(name, mods, entries, nbytes, host, direct, index % plan.ring_slots, ckpt,
                            adapters, unpin=unpin, shared=bool(shared))
        if on_disk:                                   # written now, its host buffer freed before the next
            unit.disk = tier.add(host[:nbytes])
            for e in entries:                         # nothing may keep viewing the buffer
                point_owners(e, torch.empty(0, dtype=e.dtype, device=host.device))
            del host
            free_host_buffer(unit)
            return_freed_host_memory()
        if parked is not None:
            parked.release(name)                      # read once, into the unit: not needed again
        units.append(unit)
    if tier is not None:
        tier.seal()

    slot_bytes = max((u.nbytes for u in units), default=0)
    slot_bytes = -(-max(slot_bytes, ALIGN) // ALIGN) * ALIGN
    slots = allocate_ring(min(plan.ring_slots, len(units)), slot_bytes, backend, plan.debug_poison)
    for u in units:                                   # re-point once: unit i always uses slot i mod K
        for e in u.entries:
            point_owners(e, packed_view(slots[u.slot].buf, e))

    engine = engine_cls(units, slots, backend, plan, mode)
    wrapped = []
    for u in units:
        for m in u.modules:
            w = StreamedForward(engine, u, m)
            m.forward = w
            wrapped.append((m, w))
    hooks = [model.register_forward_pre_hook(lambda mod, args: engine.begin_forward()),
             model.register_forward_hook(lambda mod, args, out: engine.end_forward())]
    handle = StreamingHandle(engine, units, wrapped, hooks, total_blocks=len(blocks), disk=tier,
                             fp8=any(e.dtype == torch.float8_e4m3fn for u in units for e in u.entries),
                             host_modules=[m for layout in layouts for m in layout[-1]])
    return handle


def _quiesce(engine: StreamingEngine) -> None:
    """Wait until no copy reads a host buffer or writes a slot: write-backs drained, workers of a
    subclass stopped, then the fetches (slot_ring.SlotCopies.close)."""
    engine._drain()
    close = getattr(engine, "close", None)            # workers of a subclass (trainable streaming)
    if close is not None:
        close()
    engine.copies.close()


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


def remove_streaming(handle: StreamingHandle, device: torch.device | str | None = None,
                     keep_host: bool = False, park=None) -> None:
    """Put every streamed tensor back as an ordinary tensor on `device` (default: the compute
    device) and restore the modules' forwards. Checkpointing must be removed first.

    Unit by unit: a unit's tensors are copied out, then its host buffer is freed, so restoring to
    the host needs one unit of extra RAM, not a second copy of the streamed blocks. `keep_host`
    (a re-plan): a unit whose host buffer is a shared mapping is not copied: its tensors become
    views of the shared pages (unpinned), so N processes do not make N private copies of it.
    `park` (a memory/disk_load.BlockSpill, restoring to the host for a re-plan): a unit read
    back from the disk tier is parked in its loading file at once, so host RAM holds one such
    unit at a time and the next apply packs it from there, as after a load into the tiers.
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
            if keep_host and u.shared and device.type == "cpu":
                for e in u.entries:
                    point_owners(e, packed_view(u.host, e))   # the shared pages themselves
                if u.unpin is not None:
                    u.unpin()
                    u.unpin = None
                continue
            from_disk = u.disk is not None
            host = u.disk.read() if from_disk else u.host
            for e in u.entries:
                t = torch.empty(e.shape, dtype=e.dtype, device=device)
                t.copy_(packed_view(host, e))
                point_owners(e, t)
            del host
            u.disk = None
            free_host_buffer(u)
            if from_disk and park is not None and device.type == "cpu" and len(u.modules) == 1:
                t = None
                park.park(u.name, u.modules[0], skip_trained=True)
            return_freed_host_memory()
        _close_disk(handle)
        for m in handle.host_modules:                 # a plain model keeps everything on `device`
            for attr, b in m._buffers.items():
                if b is not None:
                    m._buffers[attr] = b.to(device)
    _unwrap(handle)
    engine.slots.clear()
    engine.saved_tensors.clear()
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
                point_owners(e, torch.empty(0, dtype=e.dtype, device=engine.backend.device))
            free_host_buffer(u)
    _unwrap(handle)
    engine.slots.clear()
    engine.saved_tensors.clear()
    engine.fwd_order, engine.order, engine.log, engine.tracked = [], [], [], []
    engine.bwd_holds.clear()
    handle.units.clear()
    _close_disk(handle)
    return_freed_host_memory()


def _close_disk(handle: StreamingHandle) -> None:
    """Close the disk tier's file, freeing its disk space (memory/disk_tier.py)."""
    if handle.disk is not None:
        handle.disk.close()
        handle.disk = None
