"""Saved-tensor hooks for trainable streamed units run without checkpointing, and the residency
check every streamed unit's backward makes.

Autograd saves some tensors in forward for backward, and inside a streamed unit some of them are
its weights, that is views of a ring slot (memory/slot_ring.py). Between the unit's forward and its
backward the slot holds other units' bytes; what matters is that the unit is held again (resident
and valid) whenever backward reads them.

- Frozen weights (LoRA, sampling): no hook. Each streamed tensor's owner has a version counter of
  its own (streaming_units.point_owners), so autograd saves the weight itself and reads the slot in
  backward, where the schedule holds the unit from its call's backward boundary to the next one.
  `check_resident` runs once per block as its backward begins (streamed_forward.Boundary) and
  raises, rather than let the block compute with whatever the slot holds. A hook here would run
  once per saved tensor (about 60 per Flux block, most of them activations): it was the largest
  part of the engine's per-block CPU time.
- Trained weights (memory/trainable_streaming.py) are stepped in place during backward, so their
  saved views go through these hooks: a view of a slot is packed into a handle (unit, offset,
  shape, strides) and rebuilt from the slot in backward, after the same check. Any other tensor
  passes through.

With checkpointing no hook is installed either way: the recompute re-enters the streamed forward,
which re-acquires the unit; checkpointing therefore wraps *outside* streaming (see engine.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .slot_ring import Slot
from .streaming_units import StreamedUnit


@dataclass(frozen=True)
class SavedSlotView:
    """A saved tensor that was a view of a streaming slot, rebuilt from the slot in backward."""

    unit: StreamedUnit
    dtype: torch.dtype
    offset: int
    size: tuple
    stride: tuple


def check_resident(unit: StreamedUnit, slot: Slot) -> None:
    """Refuse to let backward read `unit`'s weights unless it is held and `slot` holds its bytes."""
    if unit.refs == 0 or slot.owner is not unit or not slot.valid:
        raise RuntimeError(f"streaming: backward needs the weights of {unit.name} while they are not "
                           f"resident; the streaming schedule missed this unit")


def storage_key(t: torch.Tensor) -> int:
    """Identity of the storage `t` views (the address of its StorageImpl), valid while it lives."""
    return t.untyped_storage()._cdata


class SlotSavedTensors:
    """The pack/unpack pair for `torch.autograd.graph.saved_tensors_hooks` over the ring `slots`."""

    def __init__(self, slots: list[Slot]):
        self.slots = slots
        # Keyed by storage identity, not data_ptr(): a fake or meta storage (the simulated device,
        # memory/simulated.py) has data_ptr() 0, which would make every tensor look like a slot view.
        self.by_storage = {storage_key(s.buf): s for s in slots}
        # Real slots (CPU, CUDA): their address ranges, found once. A tensor whose first element lies
        # in a slot's range is a view of that slot (no other live allocation overlaps it), and
        # data_ptr() is a field read where untyped_storage() builds a Python object per saved tensor.
        real = all(s.buf.device.type in ("cpu", "cuda") and s.buf.data_ptr() for s in slots)
        self.ranges = [(s.buf.data_ptr(), s.buf.data_ptr() + s.buf.numel(), s) for s in slots] if real else None

    def installed(self):
        """The context in which a unit's forward runs: its saved slot views become handles."""
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    def pack(self, t: torch.Tensor):
        # Called for every tensor autograd saves in a streamed unit's forward (about 60 per Flux
        # block), most of them activations: the common case is a few integer comparisons.
        ranges = self.ranges
        if ranges is not None:
            try:
                p = t.data_ptr()
            except RuntimeError:                      # no storage (a wrapper subclass): look it up
                slot = self.by_storage.get(storage_key(t))
            else:
                for lo, hi, slot in ranges:
                    if lo <= p < hi:
                        break
                else:
                    return t
        else:
            slot = self.by_storage.get(storage_key(t))
        if slot is None:
            return t
        return SavedSlotView(slot.owner, t.dtype, t.storage_offset(), tuple(t.shape), tuple(t.stride()))

    def unpack(self, h):
        if h.__class__ is not SavedSlotView:
            return h
        slot = self.slots[h.unit.slot]
        check_resident(h.unit, slot)
        return slot.view_as_dtype(h.dtype).as_strided(h.size, h.stride, h.offset)

    def clear(self) -> None:
        """Forget the slots (teardown): no tensor is a slot view any more."""
        self.by_storage.clear()
        self.ranges = None if self.ranges is None else []
