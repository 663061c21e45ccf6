"""The memory engine: turn the [memory] section into a Plan and apply it to a model in one order.

Order, and why (each step is one module with its own docstring):

1. adapters       added by the caller (train/lora.py) *before* apply_memory: peft then wraps Linears
                  whose weights are still bf16/fp32, so it never creates fp8 LoRA weights, and every
                  later step can tell adapter weights (resident, trainable) from base weights. The
                  frozen base adapters (train/base_adapters.py) are adapters too (never fp8), but
                  streaming packs them with their block (streaming_units.streams_with_unit).
2. fp8 storage    quantizes the base Linear weights inside the blocks while they are still in host
                  RAM, so streaming packs (and later moves) fp8 bytes. Block Linears that arrived in
                  e4m3 from an fp8 checkpoint always take this step, whatever plan.fp8 says: a plain
                  Linear cannot compute with an e4m3 weight. plan.fp8 decides only whether the
                  other block Linears are quantized too, plan.fp8_modulation whether the
                  modulation Linears are (an e4m3 modulation weight from the file stays e4m3).
2b. CPU matmuls   on a CPU compute device, every frozen bf16/fp16 Linear computes through fp32
                  (cpu_linear.py): torch's bf16 matmul backward is 10-40x slower there.
3. streaming      packs each streamed unit's frozen tensors into one host buffer, block by block,
                  freeing the originals as it goes, and re-points them at device ring slots; wraps
                  the unit's forward (inner wrapper).
4. checkpointing  wraps the block forward *outside* streaming, so that checkpoint's recompute in
                  backward re-enters the streaming wrapper and the block's weights come back before
                  they are used. (Hooks outside `forward` would be skipped by the recompute.)
5. placement      everything that does not stream moves to the device; streamed tensors already
                  live in the slots.
6. split blocks   the family's split blocks (memory/split_parts.py) switched to plan.split_blocks:
                  a flag each block reads in its forward, so its place in the order does not matter.

`torch.compile` is not part of the order: the streaming and checkpointing wrappers are Python-level
and would break compiled graphs at every block anyway.

`MemoryHandle.remove()` undoes the steps in reverse and leaves a plain model (weights the engine
quantized come back dequantized, since the original values were not kept; weights that arrived in
e4m3 stay e4m3, as they were). `MemoryHandle.release()` drops the engine's state without restoring
anything, for a model about to be discarded.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, replace

import torch
from torch import nn

from ..config import MemoryConfig
from ..spec import ModelSpec
from .checkpointing import (
    MIN_OFFLOAD_BYTES,
    CheckpointHandle,
    apply_checkpointing,
    remove_checkpointing,
)
from .attention_kernels import guard_attention_kernels
from .cpu_linear import CpuLinearHandle, apply_cpu_linears, remove_cpu_linears
from .fp8 import Fp8Handle, apply_fp8_storage, has_prequantized, remove_fp8_storage
from .host_buffers import return_freed_host_memory
from .plan import Plan
from .split_parts import has_split_blocks, set_split_parts
from .switched import apply_switched, parts_of
from .spread import even_spread  # noqa: F401 - where the planner and resolve_plan take it
from .streaming import (
    RunMode,
    StreamingHandle,
    apply_streaming,
    release_streaming,
    remove_streaming,
)

log = logging.getLogger("leantune.memory")

_APPLIED_ATTR = "_leantune_memory"
_RELEASED = "released"          # value of _APPLIED_ATTR after MemoryHandle.release()


def resolve_plan(memory_cfg: MemoryConfig, spec: ModelSpec, model: nn.Module) -> Plan:
    """The explicit [memory] choices as a Plan (vram_budget / ram_budget are the planner's)."""
    names = [n for n, _ in spec.blocks(model)]
    sb = memory_cfg.streamed_blocks
    if sb == "all":
        streamed = list(names)
    elif isinstance(sb, int):
        if sb > len(names):
            raise ValueError(f"memory.streamed_blocks = {sb}, but this model has only {len(names)} blocks "
                             f"(use \"all\" to stream every block)")
        streamed = even_spread(names, sb)
    else:
        known = set(names)
        unknown = [n for n in sb if n not in known]
        if unknown:
            raise ValueError(f"memory.streamed_blocks: unknown block names {unknown}; names look like "
                             f"{names[0]!r} ... {names[-1]!r}")
        dupes = sorted({n for n in sb if sb.count(n) > 1})
        if dupes:
            raise ValueError(f"memory.streamed_blocks: blocks listed twice: {dupes}")
        order = {n: i for i, n in enumerate(names)}
        streamed = sorted(sb, key=order.__getitem__)
    return Plan(streamed_blocks=tuple(streamed), stream_non_blocks=memory_cfg.stream_non_blocks,
                fp8=memory_cfg.fp8, fp8_modulation=memory_cfg.fp8_modulation is True,
                checkpointing=memory_cfg.checkpointing, ring_slots=memory_cfg.ring_slots,
                pin_memory=memory_cfg.pin_memory, debug_poison=memory_cfg.debug_poison,
                split_blocks=memory_cfg.split_blocks is True)


@dataclass
class MemoryHandle:
    """The techniques applied to one model; undo them with remove()."""

    model: nn.Module
    device: torch.device
    plan: Plan
    mode: RunMode
    fp8: Fp8Handle | None = None
    streaming: StreamingHandle | None = None
    checkpointing: CheckpointHandle | None = None
    cpu_linears: CpuLinearHandle | None = None

    def forward_only(self, enabled: bool) -> None:
        """Sampling mode (call the model under torch.no_grad()): the streaming ring keeps cycling
        across calls, the next denoising step's first blocks being fetched at the end of the current
        one; resident blocks never move. Grad-enabled calls are refused while it is on."""
        self.mode.forward_only = bool(enabled)

    def step_report(self, wait: bool = False) -> dict:
        """Counters since the previous report: bytes moved host->device, copies, copy time, time
        compute waited on copies (stall), ring slots; and activation offload bytes. On CUDA, copies
        still in flight are counted in a later report unless `wait`."""
        rep: dict = {"streamed_units": 0, "bytes_h2d": 0, "copies": 0, "demand_fetches": 0, "copy_s": 0.0,
                     "stall_s": 0.0, "h2d_GBps": None, "slots": 0, "slot_bytes": 0, "slots_held_max": 0,
                     "slots_valid": 0}
        if self.streaming is not None:
            rep.update(self.streaming.engine.report(wait))
        if self.checkpointing is not None:
            rep.update(self.checkpointing.report())
        return rep

    def device_bytes(self) -> dict[str, int]:
        """What the model holds on the compute device, counted from its tensors: "resident" (the
        distinct storages of its parameters and buffers on the device, the streamed weights'
        slots excluded) and "stream slots" (the ring). Storages, not tensors: a tensor shared by
        several modules, or a view, counts once. On a CPU compute device the host buffers of the
        streamed units are not counted (no parameter refers to them; only the slots do)."""
        slots = self.streaming.engine.slots if self.streaming is not None else []
        in_slots = {s.buf.untyped_storage().data_ptr() for s in slots}
        seen: set[int] = set()
        resident = 0
        for m in self.model.modules():
            for t in (*m._parameters.values(), *m._buffers.values()):
                if t is None or t.device != self.device:
                    continue
                storage = t.untyped_storage()
                ptr = storage.data_ptr()
                if ptr in in_slots or ptr in seen or not storage.nbytes():
                    continue
                seen.add(ptr)
                resident += storage.nbytes()
        return {"resident": resident, "stream slots": sum(s.buf.numel() for s in slots)}

    def describe(self) -> list[str]:
        lines = []
        if self.fp8 is not None:
            lines.append(self.fp8.describe())
        if self.checkpointing is not None:
            lines.append(self.checkpointing.describe())
        if self.streaming is not None:
            lines.append(self.streaming.describe())
        return lines or ["memory: nothing applied (all weights resident, no checkpointing)"]

    def remove(self, device: torch.device | str | None = None, keep_fp8: bool = False,
               keep_host: bool = False, park=None) -> None:
        """Restore the plain model: weights back as ordinary parameters on `device` (default: the
        engine's device).

        For a re-plan (the model is applied again right after): `keep_fp8` leaves fp8-stored
        weights e4m3 with their scales (the next apply takes them as they are: no bf16 copy of the
        model on the host, no requantizing); `keep_host` leaves shared host weights where they are
        (views of the shared pages, not a private copy per process); `park` (a
        memory/disk_load.BlockSpill) takes each unit read back from the disk tier, so host RAM
        holds one of them at a time, not all (remove_streaming)."""
        if self.model.__dict__.get(_APPLIED_ATTR) == _RELEASED:
            raise RuntimeError("MemoryHandle.remove(): the engine was released; the streamed weights are gone "
                               "and cannot be restored")
        set_split_parts(self.model, False)            # the plain model's blocks: the reference forward
        if self.checkpointing is not None:
            remove_checkpointing(self.checkpointing)
            self.checkpointing = None
        if self.streaming is not None:
            remove_streaming(self.streaming, device or self.device, keep_host=keep_host, park=park)
            self.streaming = None
        if self.cpu_linears is not None:
            remove_cpu_linears(self.cpu_linears)
            self.cpu_linears = None
        if self.fp8 is not None:
            if not keep_fp8:
                remove_fp8_storage(self.fp8)
            self.fp8 = None
        if device is not None:
            _place(self.model, torch.device(device))
            return_freed_host_memory()
        self.model.__dict__.pop(_APPLIED_ATTR, None)

    def release(self) -> None:
        """Drop the engine's state and return its memory, without copying any weight back.

        Waits for in-flight copies (on an event recorded on the copy stream), closes the staging
        thread, unpins and frees the streamed units' host buffers, frees the device slots and
        removes every wrapper and hook. Unlike remove(), nothing is restored: the streamed modules
        are left with empty weights, so **the model cannot compute any more** (and apply_memory
        refuses it); resident weights stay where they are until the model itself is dropped. For
        a model that is discarded right after use (sampling), where remove() would copy every
        streamed weight onto the device, which does not fit under a budget.
        """
        if self.checkpointing is not None:
            remove_checkpointing(self.checkpointing)
            self.checkpointing = None
        if self.streaming is not None:
            release_streaming(self.streaming)
            self.streaming = None
        if self.cpu_linears is not None:
            remove_cpu_linears(self.cpu_linears)
            self.cpu_linears = None
        self.fp8 = None                       # fp8 weights stay as they are: no dequantized copies
        self.model.__dict__[_APPLIED_ATTR] = _RELEASED


def _place(model: nn.Module, device: torch.device, keep=()) -> None:
    """Move every parameter and buffer that is not on `device` there, keeping Parameter identity
    (optimizers and peft keep their references); the modules in `keep` stay where they are."""
    kept = {id(m) for m in keep}
    with torch.no_grad():
        for m in model.modules():
            if id(m) in kept:
                continue
            for p in m._parameters.values():
                if p is not None and p.device != device:
                    p.data = p.data.to(device)
            for name, b in m._buffers.items():
                if b is not None and b.device != device:
                    m._buffers[name] = b.to(device)


def validate(model: nn.Module, spec: ModelSpec, plan: Plan, device: torch.device) -> None:
    """Reject impossible combinations before touching the model; messages name the [memory] key."""
    if plan.checkpointing not in ("none", "blocks", "offload"):
        raise ValueError(f"memory.checkpointing must be \"none\", \"blocks\" or \"offload\", got {plan.checkpointing!r}")
    if plan.ring_slots < 2:
        raise ValueError(f"memory.ring_slots must be >= 2 (one slot computes while the next fills), "
                         f"got {plan.ring_slots}")
    names = [n for n, _ in spec.blocks(model)]
    known = set(names)
    unknown = [n for n in plan.streamed_blocks if n not in known]
    if unknown:
        raise ValueError(f"memory.streamed_blocks: unknown block names {unknown}; names look like "
                         f"{names[0]!r} ... {names[-1]!r}")
    if len(set(plan.streamed_blocks)) != len(plan.streamed_blocks):
        raise ValueError("memory.streamed_blocks: a block is listed twice")
    if getattr(model, "gradient_checkpointing", False):
        raise ValueError("memory.checkpointing: the model has diffusers' own gradient checkpointing switched on; "
                         "set [memory] checkpointing = \"blocks\" instead of calling enable_gradient_checkpointing()")
    if model.__dict__.get(_APPLIED_ATTR) == _RELEASED:
        raise ValueError("apply_memory: this model's memory engine was released (MemoryHandle.release()); its "
                         "streamed weights are gone, so load the model again")
    if _APPLIED_ATTR in model.__dict__:
        raise ValueError("apply_memory: this model already has the memory engine applied; call remove() first")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"apply_memory: device {device} requested but CUDA is not available")
    if plan.split_blocks and not has_split_blocks(model):
        raise ValueError("[memory] split_blocks = true: this model's blocks have no split variant (Flux, Wan and "
                         "Qwen-Image-2.1 have them); remove the key")
    if plan.debug_poison and not (plan.streamed_blocks or plan.stream_non_blocks):
        log.warning("memory.debug_poison has no effect without streaming (memory.streamed_blocks = 0)")


def _apply_rows(model, spec, fmt: str, modulation: bool) -> None:
    """Plan.base_format's storage of the block Linears ("int8", "nf4"): each storage skips what is
    stored already, so after a loader that read the rows so this changes nothing."""
    if fmt == "int8":
        from .int8_storage import apply_int8_storage
        apply_int8_storage(model, spec, modulation=modulation)
    else:
        from .nf4_storage import apply_nf4_storage
        apply_nf4_storage(model, spec, modulation=modulation)


def apply_memory(model: nn.Module, spec: ModelSpec, plan: Plan, device: torch.device | str = "cpu", *,
                 fp8_scales: Mapping[str, torch.Tensor] | None = None,
                 offload_min_bytes: int = MIN_OFFLOAD_BYTES, streaming_engine=None,
                 host_device: torch.device | str = "cpu", host_buffers=None, disk_dir=None,
                 disk_room: int | None = None, parked=None) -> MemoryHandle:
    """Apply the plan to `model` (adapters already added) and move it to `device`, except the
    streamed weights, which stay in host memory and visit the device in ring slots.

    Block Linear weights that are already e4m3 (an fp8 checkpoint loaded with keep_fp8, see
    models/flux/loading.py) go through fp8 storage whatever plan.fp8 says, with their
    `weight_scale` buffer as the scale. `fp8_scales`: scales for e4m3 weights that carry no such
    buffer, by qualified Linear name (see fp8.apply_fp8_storage).
    `offload_min_bytes`: with checkpointing = "offload", smaller saved block inputs stay on the device.
    `streaming_engine`: a StreamingEngine subclass (full fine-tuning streams trainable weights with
    memory/trainable_streaming.py's).
    `host_device`: host RAM, where streamed units and offloaded block inputs wait (another device
    in the simulation, memory/simulated.py).
    `host_buffers`: shared host buffers for the streamed weights (memory/shared_host.py), or None.
    `disk_dir`: the disk tier's folder ([memory] disk_dir, memory/disk_tier.py) for the plan's
    disk_blocks; with `disk_room` and a plan that names none, the streamed blocks beyond
    `disk_room` host bytes go there (apply_streaming), and the handle's plan names them.
    A model whose parts compute one at a time (`alternating_parts()`: Wan 2.2 A14B's two experts)
    gets the plan on the part in use only, the others waiting on the host (memory/switched.py).
    `parked`: the loader's memory/disk_load.BlockSpill, when the disk-tier blocks were loaded
    straight to disk (apply_streaming drops their file pages once packed).
    """
    device = torch.device(device)
    if device.type == "cuda" and device.index is None and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    parts = parts_of(model)
    if parts is not None:            # parts that compute one at a time (Wan 2.2 A14B's experts): switched.py
        def apply_one(part, **where):
            return apply_memory(part, spec, plan, fp8_scales=fp8_scales, offload_min_bytes=offload_min_bytes,
                                streaming_engine=streaming_engine, disk_room=disk_room, parked=parked, **where)
        return apply_switched(model, parts, apply_one, device, host_buffers=host_buffers, disk_dir=disk_dir,
                              host_device=host_device)
    validate(model, spec, plan, device)
    guard_attention_kernels(device)
    mode = RunMode()
    handle = MemoryHandle(model=model, device=device, plan=plan, mode=mode)
    try:
        rows = plan.base_format != "fp8" and (plan.fp8 or plan.fp8_modulation)
        if rows:           # 2. int8 / NF4 rows: the loader's (none left to do), or quantized here, in place
            _apply_rows(model, spec, plan.base_format, plan.fp8_modulation)
        fp8, fp8_mod = (False, False) if rows else (plan.fp8, plan.fp8_modulation)
        if fp8 or fp8_mod or fp8_scales or has_prequantized(model, spec):   # 2. fp8 storage
            handle.fp8 = apply_fp8_storage(model, spec, scales=fp8_scales, quantize_rest=fp8,
                                           modulation=fp8_mod,
                                           work_device=device if device.type == "cuda" else None,
                                           keep_trainable=getattr(streaming_engine, "trains_weights", False))
        if device.type == "cpu":                                         # 2b. fp32 matmuls on CPU
            handle.cpu_linears = apply_cpu_linears(model)
        streaming = bool(plan.streamed_blocks) or plan.stream_non_blocks
        if streaming:                                                    # 3. streaming (inner wrapper)
            handle.streaming = apply_streaming(model, spec, plan, device,
                                               checkpointed=plan.checkpointing != "none", mode=mode,
                                               host_buffers=host_buffers,
                                               host_device=host_device, disk_dir=disk_dir, disk_room=disk_room,
                                               parked=parked,
                                               **({"engine_cls": streaming_engine} if streaming_engine else {}))
            if handle.streaming.disk_blocks != plan.disk_blocks:          # decided by disk_room
                handle.plan = replace(plan, disk_blocks=handle.streaming.disk_blocks)
        if plan.checkpointing != "none":                                 # 4. checkpointing (outer wrapper)
            handle.checkpointing = apply_checkpointing(model, spec, offload=plan.checkpointing == "offload",
                                                       offload_min_bytes=offload_min_bytes, host_device=host_device)
        _place(model, device, keep=handle.streaming.host_modules if handle.streaming else ())   # 5. the resident set
        return_freed_host_memory()                                       # their host copies
        set_split_parts(model, plan.split_blocks)                        # 6. split blocks, on or off
    except BaseException:
        # Roll back to the host, never onto the device: this is typically an out-of-memory while a
        # tighter plan is applied, and copying every streamed block onto the device would run out again.
        handle.remove(device=host_device)
        raise
    model.__dict__[_APPLIED_ATTR] = True
    for line in handle.describe():
        log.info(line)
    return handle
