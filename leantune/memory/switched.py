"""A model of parts that compute one at a time (Wan 2.2 A14B's two experts) under one memory plan.

What it trades. Two 14B experts side by side would need two resident sets and two streaming rings
on the device, although a forward call only ever runs one of them (WanPipeline hands each timestep
to one expert). Here the engine holds one part at a time: the part in use has the plan applied as
any model would (fp8 storage, streaming through one ring of slots, checkpointing, its resident
modules on the device); every other part stays a plain model on the host. A call to another part
first takes the plan off the current one (`MemoryHandle.remove` to the host, fp8 weights kept
e4m3, the ring freed) and then applies it to the new one: the device never holds more than one
part's resident set and ring, and the switch costs one re-packing of the part's streamed blocks and
the PCIe transfer of its resident set. The trainable adapters of every part stay on the device
throughout (they are small), so the optimizer's parameters and state never move.

How. The model declares its parts (`alternating_parts()`: name -> module); a forward pre-hook on
each part switches to it before it runs, from outside the model (the parts know nothing of this).
The recompute of checkpointed blocks re-enters blocks, not the part, so it never switches; a call's
backward runs on the part its forward ran on. `SwitchedMemory` stands for a MemoryHandle wherever
the trainer and the sampler hold one (report, forward-only mode, remove, release).

So both experts train in one run on one expert's device memory.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn

log = logging.getLogger("leantune.memory")


def parts_of(model: nn.Module) -> dict[str, nn.Module] | None:
    """The parts a model says compute one at a time, or None for a plain model."""
    parts = getattr(type(model), "alternating_parts", None)
    return dict(parts(model)) if callable(parts) else None


def _trainable_to(model: nn.Module, device: torch.device) -> None:
    """Every trainable tensor (and its gradient) onto `device`, keeping Parameter identity."""
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad and p.device != device:
                grad, p.grad = p.grad, None
                p.data = p.data.to(device)
                if grad is not None:
                    p.grad = grad.to(device)


@contextmanager
def _quiet(enabled: bool):
    """The engine's info lines off for the duration (its warnings stay)."""
    if not enabled:
        yield
        return
    engine_log = logging.getLogger("leantune.memory")
    level = engine_log.level
    engine_log.setLevel(max(level, logging.WARNING))
    try:
        yield
    finally:
        engine_log.setLevel(level)


class SwitchedMemory:
    """The memory plan on whichever part of `model` computes now; the others on the host."""

    def __init__(self, model: nn.Module, parts: dict[str, nn.Module], apply, device: torch.device,
                 host_device: torch.device | str = "cpu"):
        self.model, self.parts, self._apply = model, parts, apply
        self.device, self.host_device = torch.device(device), torch.device(host_device)
        self.active: str | None = None
        self.handle = None
        self.switches = 0
        self._forward_only = False
        _trainable_to(model, self.device)
        self._hooks = [part.register_forward_pre_hook(lambda module, args, name=name: self.activate(name))
                       for name, part in parts.items()]
        self.activate(next(iter(parts)))

    # -- switching ---------------------------------------------------------------------------------
    def activate(self, name: str) -> None:
        """Put the plan on part `name` (a no-op when it has it already)."""
        if name == self.active:
            return
        if self.handle is not None:
            self.handle.remove(device=self.host_device, keep_fp8=True, keep_host=True)   # ring and resident set go home
            self.handle = None
            _trainable_to(self.model, self.device)
            self.switches += 1
        self.active = name
        with _quiet(self.switches > 0):       # the plan's lines were said at the first apply; a switch repeats them
            self.handle = self._apply(name, self.parts[name])
        self.handle.forward_only(self._forward_only)

    # -- what a MemoryHandle offers ---------------------------------------------------------------------
    @property
    def plan(self):
        return self.handle.plan

    @property
    def streaming(self):
        return self.handle.streaming

    @property
    def checkpointing(self):
        return self.handle.checkpointing

    @property
    def fp8(self):
        return self.handle.fp8

    def forward_only(self, enabled: bool) -> None:
        self._forward_only = bool(enabled)
        self.handle.forward_only(enabled)

    def step_report(self, wait: bool = False) -> dict:
        return {**self.handle.step_report(wait), "active_part": self.active, "part_switches": self.switches}

    def device_bytes(self) -> dict[str, int]:
        """The active part's (the others hold only their adapters on the device)."""
        return self.handle.device_bytes()

    def describe(self) -> list[str]:
        return [f"parts: {', '.join(self.parts)} one at a time (now {self.active}), the others on the host",
                *self.handle.describe()]

    def _unhook(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def remove(self, device: torch.device | str | None = None, keep_fp8: bool = False, keep_host: bool = False) -> None:
        """The plain model, every part on `device` (default: the engine's), as MemoryHandle.remove."""
        self._unhook()
        if self.handle is not None:
            self.handle.remove(device=device, keep_fp8=keep_fp8, keep_host=keep_host)
            self.handle = None
        target = torch.device(device) if device is not None else self.device
        with torch.no_grad():
            for p in self.model.parameters():
                if p.device != target:
                    grad, p.grad = p.grad, None
                    p.data = p.data.to(target)
                    if grad is not None:
                        p.grad = grad.to(target)
            for m in self.model.modules():
                for k, b in m._buffers.items():
                    if b is not None and b.device != target:
                        m._buffers[k] = b.to(target)
        self.active = None

    def release(self) -> None:
        """Drop the engine's state (MemoryHandle.release) for a model about to be discarded."""
        self._unhook()
        if self.handle is not None:
            self.handle.release()


def apply_switched(model: nn.Module, parts: dict[str, nn.Module], apply_one, device: torch.device, *,
                   host_buffers=None, disk_dir=None, host_device="cpu", **options) -> SwitchedMemory:
    """`apply_one(part, **options)` (engine.apply_memory) on the part in use, switched per call.
    A disk tier gets one folder per part (their block names are the same); shared host buffers
    (one host copy for several processes) are refused: their names would collide between parts."""
    if host_buffers is not None:
        raise ValueError("[distributed] share_host_weights: a model whose parts compute one at a time (Wan 2.2 "
                         "A14B's two experts) re-packs a part on every switch; set share_host_weights = false")

    def apply(name: str, part: nn.Module):
        folder = None
        if disk_dir is not None:
            folder = Path(disk_dir) / name
            folder.mkdir(parents=True, exist_ok=True)
        return apply_one(part, device=device, host_device=host_device,
                         **({"disk_dir": folder} if folder is not None else {}), **options)

    handle = SwitchedMemory(model, parts, apply, device, host_device)
    log.info("parts: %s one at a time through one plan, the others on the host", ", ".join(parts))
    return handle
