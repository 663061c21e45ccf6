"""Loading straight into the disk tier: the blocks the plan reads from disk never sit in host RAM together.

Why: the disk tier (disk_tier.py) keeps the steps' host RAM to the blocks the budget holds, but a
load that fills the whole transformer in host RAM before the engine packs it needs the whole
transformer there first: a FLUX.2-dev transformer (32 GiB in bf16) could not be loaded on a 32 GiB
host at all, whatever the steps hold. Here the loader (models/weights.load_into_empty, inside
`parking`) reads the disk-tier blocks one at a time; as soon as a block's tensors are filled,
`BlockSpill.park` writes their bytes to an unlinked file in the disk tier's folder, waits for the
disk to have them (fdatasync), drops their pages from the page cache, and re-points the block's
tensors at a shared mapping of that file (file pages, which the kernel can drop and read again,
and no commit charge, as a private writable mapping would have; nothing writes a frozen weight in
place, and a write would only land in this unlinked file). Host RAM during the load then holds
the RAM-tier blocks, the non-block weights and one block being filled: the bounded window.

Everything between the load and the engine (adapters attached by the mode, base adapters, the fp8
wrappers of weights already quantized as read) works on the parked tensors as on any host tensor:
they are ordinary CPU tensors whose pages come from the file when touched, which nothing does
before packing. The engine then packs each disk-tier unit from them (streaming.apply_streaming:
the mapped pages are read once, into the unit's buffer, which goes to the disk tier's own file),
re-points them at the slots, and calls `release`, which drops those pages from the page cache
again. The bytes are the loaded bytes, copied twice without conversion, which is why a run loaded
so equals one loaded whole into RAM bit for bit.

The cost: each disk-tier block is written twice (here raw, then packed by the engine). Reading the
engine's packed layout needs what comes after the load (adapters, fp8 wrappers), which is why the
load cannot write the packed file itself.

The file is unlinked as soon as it is created (no name another program could write to; its space
is freed when the last mapping goes); its size, modification time and inode are checked before
each block is parked and when each is released, so a file changed behind the run's back is named.
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import torch
from torch import nn

from .disk_tier import PAGE, READ_CHUNK, DiskTierError, _aligned, _drop_cache, _stamp, cached_pages, temp_file


class BlockSpill:
    """The disk-tier blocks of one load, parked in one unlinked file of `folder`."""

    def __init__(self, folder: str | Path, blocks):
        fd, tmp = temp_file(Path(folder), ".load-", "the loading file")
        os.unlink(tmp)                                # nothing left behind, however the process ends
        self.path, self.fd = tmp, fd
        self.blocks = tuple(blocks)                   # the block names the load parks (Plan.disk_blocks)
        self._size = 0
        self._stamp = _stamp(os.fstat(fd))
        # block -> its (offset, length) in the file, in parking order: a model of several parts that
        # compute in turn (Wan 2.2's two experts, memory/switched.py) parks a block of each name per part
        self.ranges: dict[str, list[tuple[int, int]]] = {}
        self.parked_blocks = 0
        self.parked_bytes = 0                         # tensor bytes parked (what the load kept out of RAM)

    def check(self) -> None:
        """The file must be as this load left it (size, modification time, inode)."""
        if self.fd is None or _stamp(os.fstat(self.fd)) != self._stamp:
            raise DiskTierError(f"{self.path} (the disk tier's loading file, unlinked): it was changed during "
                                f"the load; the blocks parked there can no longer be trusted (start the run again)")

    def park(self, name: str, block: nn.Module, skip_trained: bool = False) -> None:
        """Write every tensor of `block` (parameters and buffers, tied ones once) to the file and
        re-point it at the file's mapping; the filled host tensors are freed by the caller's
        dropping its references (the block's own are the only ones). `skip_trained` (a re-plan,
        the mode's adapters attached): parameters that require gradients stay as they are. (A
        fresh load's parameters all require them until the mode freezes the base.)"""
        self.check()
        tensors: dict[int, torch.Tensor] = {}
        for m in block.modules():
            for store in (m._parameters, m._buffers):
                for t in store.values():
                    if (t is not None and t.device.type == "cpu" and id(t) not in tensors
                            and not (skip_trained and isinstance(t, nn.Parameter) and t.requires_grad)):
                        tensors[id(t)] = t
        start = _aligned(self._size)
        layout, pos = [], 0
        for key, t in tensors.items():                # page-aligned: any dtype's view is aligned
            layout.append((key, pos, t.numel() * t.element_size()))
            pos = _aligned(pos + t.numel() * t.element_size())
        try:
            for key, rel, n in layout:
                _write(self.fd, _bytes_of(tensors[key]), start + rel)
            if pos > self._size - start:
                os.ftruncate(self.fd, start + pos)    # the mapping must not end past the file
            os.fdatasync(self.fd)                     # on the disk, so the pages can be dropped
        except OSError as e:
            raise DiskTierError(f"{self.folder_name()}: writing the disk tier's loading file failed "
                                f"({e.strerror or e}); the disk needs room for the blocks it holds") from None
        _drop_cache(self.fd, start, pos)
        self._size = start + pos
        self._stamp = _stamp(os.fstat(self.fd))
        self.ranges.setdefault(name, []).append((start, pos))
        self.parked_blocks += 1
        if pos == 0:
            return
        mapping = mmap.mmap(self.fd, pos, access=mmap.ACCESS_WRITE, offset=start)
        mapped = {}
        for key, rel, n in layout:
            t = tensors[key]
            view = (torch.frombuffer(mapping, dtype=torch.uint8, count=n, offset=rel) if n
                    else torch.empty(0, dtype=torch.uint8))
            mapped[key] = view.view(t.dtype).view(t.shape) if t.dim() else view.view(t.dtype).reshape(())
            self.parked_bytes += n
        del mapping                                   # the tensors keep it mapped while they live
        with torch.no_grad():
            for m in block.modules():
                for store in (m._parameters, m._buffers):
                    for attr, t in list(store.items()):
                        if t is None or id(t) not in mapped:
                            continue
                        if isinstance(t, nn.Parameter):
                            t.data = mapped[id(t)]    # the same Parameter object: ties and PEFT keep it
                        else:
                            store[attr] = mapped[id(t)]

    def release(self, name: str) -> None:
        """Drop block `name`'s pages from the page cache (the engine has packed it; with several
        parts, the first of them not dropped yet)."""
        if self.fd is None or not self.ranges.get(name):
            return
        self.check()
        start, length = self.ranges[name].pop(0)     # the parts are packed in the order they were loaded
        _drop_cache(self.fd, start, length)

    def cached_pages(self) -> int:
        """Pages of the file in the page cache now (disk_tier.cached_pages)."""
        return cached_pages(self.fd) if self.fd is not None and self._size else 0

    def folder_name(self) -> str:
        return str(self.path.parent)

    def close(self) -> None:
        """Close the file; its disk space goes once the last parked tensor is gone (the mappings
        hold it: a block the engine has not placed yet stays readable)."""
        if self.fd is not None:
            _drop_cache(self.fd, 0, 0)
            os.close(self.fd)
            self.fd = None


def _bytes_of(t: torch.Tensor) -> memoryview:
    flat = t.detach().contiguous().reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)
    return memoryview(flat.numpy()).cast("B")


def _write(fd: int, view: memoryview, offset: int) -> None:
    done = 0
    while done < len(view):
        done += os.pwrite(fd, view[done:done + READ_CHUNK], offset + done)


__all__ = ["BlockSpill", "PAGE"]


def blocks_for_room(model: nn.Module, spec, plan, room: int) -> tuple[str, ...]:
    """The streamed blocks the engine will put on disk for a host budget of `room` bytes (the
    explicit [memory] choices: streaming.apply_streaming's `disk_room`), from the meta-built
    `model` before any weight is read, so the loader can park exactly those. The same rule on the
    same packed sizes (streaming_units.layout_unit, disk_tier.room_split); the trained adapters
    the mode adds later stay resident and are not packed, so they change nothing here."""
    from .disk_tier import room_split
    from .streaming_units import ALIGN, layout_unit
    from .switched import parts_of

    parts = parts_of(model)
    if parts:                 # parts that compute in turn: the engine gives each the same room (switched.py)
        return tuple(dict.fromkeys(n for part in parts.values() for n in blocks_for_room(part, spec, plan, room)))
    blocks = dict(spec.blocks(model))
    sizes = []
    if plan.stream_non_blocks:
        mods = [getattr(model, n) for n in spec.non_block_modules if hasattr(model, n)]
        nbytes = layout_unit(mods, "non_blocks", True)[2] if mods else 0
        sizes.append(("non_blocks", max(nbytes, ALIGN)))
    wanted = set(plan.streamed_blocks)
    for name, block in blocks.items():
        if name in wanted:
            sizes.append((name, max(layout_unit([block], name, True)[2], ALIGN)))
    return room_split(sizes, wanted, room)
