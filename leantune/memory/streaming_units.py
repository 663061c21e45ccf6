"""Streamed units: which tensors a unit streams, how they are laid out in its one host buffer, and
how their modules are re-pointed at that buffer (or at a device slot).

A *unit* is one streamed block, or (optionally) all non-block modules as one group. All its frozen
tensors (parameters and buffers; with trainable streaming also its trained weights and their
optimizer state) are packed into one contiguous host buffer of exactly the unit's size, each
tensor at an `ALIGN`-byte boundary. A tensor shared by several modules is packed once and all its
owners point at the one place.

Adapter weights (peft's lora_A / lora_B / lokr_* / hada_* / magnitude containers) stay resident on
the device, with one exception: the frozen *base adapters* (train/base_adapters.py), peft adapters
named `STREAMED_ADAPTER_PREFIX`..., whose weights are frozen like the base weights they sit beside.
Their weights travel with their block: packed into its unit in the dtype they are stored in
(fp32 as apply_lora makes them; never fp8: fp8 storage skips every adapter module), copied into
the slot with it, bit for bit. The trained adapter (and any adapter whose weights take a
gradient) stays resident: the optimizer steps it in place and backward accumulates into it.
`streams_with_unit` is the rule.

Host RAM while applying: units are packed one at a time, and each unit's tensors are re-pointed at
their place in its buffer right after the copy (`pack_unit`), so the original storage is freed
(and its pages handed back to the OS) before the next unit is packed. The peak is the model plus
one unit, not the model plus every buffer; afterwards the host holds the streamed units once, as
their buffers.

The planner prices streamed blocks with this same layout (planner/weight_bytes.py reads `ALIGN`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from .block_linears import adapter_module_ids
from .host_buffers import return_freed_host_memory

ALIGN = 512                  # byte alignment of each tensor inside a packed unit
# peft adapter names of the frozen base adapters (train/base_adapters.PREFIX): their weights stream
# with their block; every other adapter's stay resident
STREAMED_ADAPTER_PREFIX = "base_adapter_"
# Set (True) on a module holding a trained weight's optimizer state (train/fused_optim.ParamState):
# under Plan.optimizer_on_host a streamed unit leaves such modules in host RAM.
OPTIMIZER_STATE_ATTR = "holds_optimizer_state"


@dataclass
class PackedTensor:
    """One tensor of a unit: where it sits in the packed buffer and who refers to it."""

    owners: list[tuple[nn.Module, str, str]]   # (module, "param" | "buffer", attribute name)
    offset: int
    nbytes: int
    dtype: torch.dtype
    shape: torch.Size
    base_adapter: bool = False                 # a frozen base adapter's weight (streams_with_unit)


@dataclass(eq=False)
class StreamedUnit:
    name: str
    modules: list[nn.Module]
    entries: list[PackedTensor]
    nbytes: int
    host: torch.Tensor                 # (nbytes,) uint8, pinned when possible
    pinned: bool
    slot: int
    checkpointed: bool
    adapter_params: list[nn.Parameter]
    unpin: object = None               # undoes the host buffer's pinning
    refs: int = 0
    shared: bool = False               # the host buffer is a shared mapping (memory/shared_host.py)
    disk: object = None                # memory/disk_tier.DiskExtent: the bytes are on disk, `host` is empty
    _packed_params: list | None = field(default=None, repr=False)   # see trainable()

    def trainable(self) -> bool:
        """Whether any of the unit's parameters (adapters first) currently takes a gradient.

        Asked on every call of a streamed module none of whose inputs needs a gradient, so the
        packed parameters are listed once (the Parameter objects stay; streaming re-points their
        .data) and only their requires_grad is read each time."""
        if any(p.requires_grad for p in self.adapter_params):
            return True
        if self._packed_params is None:
            self._packed_params = [m._parameters[attr] for e in self.entries for m, kind, attr in e.owners
                                   if kind == "param"]
        return any(p.requires_grad for p in self._packed_params)


def streams_with_unit(qualified: str, p: nn.Parameter) -> bool:
    """Whether an adapter parameter (its name under the unit, e.g. 'attn.to_q.lora_A.base_adapter_0.weight'
    or, for LoKr's ParameterDicts, 'attn.to_q.lokr_w1.base_adapter_0') is packed with its unit: a
    frozen weight of a base adapter. The adapter's name is the component right after peft's
    container; no module of a model is named so otherwise."""
    return not p.requires_grad and any(part.startswith(STREAMED_ADAPTER_PREFIX) for part in qualified.split("."))


def layout_unit(modules: list[nn.Module], unit_name: str, trainable_ok: bool = False, state_on_host: bool = False
                ) -> tuple[list[PackedTensor], list[nn.Parameter], int, list[nn.Module]]:
    """The frozen tensors of a unit (and its trainable ones if `trainable_ok`), laid out in one
    buffer, its base adapters' frozen weights among them (`streams_with_unit`); its resident
    adapter parameters; and, with `state_on_host`, the optimizer-state modules left out of the
    buffer (they stay in host RAM: Plan.optimizer_on_host)."""
    by_id: dict[int, PackedTensor] = {}
    entries: list[PackedTensor] = []
    adapters: list[nn.Parameter] = []
    kept: list[nn.Module] = []
    offset = 0
    for top in modules:
        skip = adapter_module_ids(top)
        for mname, m in top.named_modules():
            adapter = id(m) in skip
            if adapter:
                adapters.extend(p for attr, p in m._parameters.items()
                                if p is not None and not streams_with_unit(f"{mname}.{attr}", p))
            elif state_on_host and getattr(m, OPTIMIZER_STATE_ATTR, False):
                kept.append(m)
                continue
            for kind, store in (("param", m._parameters), ("buffer", m._buffers)):
                for attr, t in store.items():
                    if t is None:
                        continue
                    if adapter and not (kind == "param" and streams_with_unit(f"{mname}.{attr}", t)):
                        continue              # resident: the trained adapter (and adapter buffers)
                    if id(t) in by_id:
                        by_id[id(t)].owners.append((m, kind, attr))
                        continue
                    if kind == "param" and t.requires_grad and not trainable_ok:
                        raise ValueError(
                            f"memory.streamed_blocks: {unit_name}.{mname + '.' if mname else ''}{attr} is trainable; "
                            f"streaming moves frozen weights only (LoRA bases, sampling). Stream fewer blocks "
                            f"or freeze the base model")
                    nbytes = t.numel() * t.element_size()
                    e = PackedTensor([(m, kind, attr)], offset, nbytes, t.dtype, t.shape, base_adapter=adapter)
                    by_id[id(t)] = e
                    entries.append(e)
                    offset += -(-nbytes // ALIGN) * ALIGN
    return entries, adapters, offset, kept


def _tensor_of(entry: PackedTensor) -> torch.Tensor:
    m, kind, attr = entry.owners[0]
    return (m._parameters if kind == "param" else m._buffers)[attr]


def point_owners(entry: PackedTensor, value: torch.Tensor) -> None:
    """Make every owner of `entry` refer to `value` (a parameter's .data, or for a buffer an alias
    of `value`).

    Either way the owner gets a version counter of its own, not the one of the buffer `value`
    views: a slot is refilled by a copy into the whole slot, which bumps the slot's counter, and a
    block's saved tensors (a Linear's weight, an fp8 weight's scale buffer) are checked against
    their own counter when backward unpacks them. Sharing the slot's would make every saved
    streamed buffer look modified in place once its slot had been refilled."""
    alias = None
    for m, kind, attr in entry.owners:
        if kind == "param":
            m._parameters[attr].data = value
        else:
            if alias is None:
                alias = value.new_empty(0)
                alias.data = value                    # same memory, own version counter (not a view)
            m._buffers[attr] = alias


def packed_view(buf: torch.Tensor, e: PackedTensor) -> torch.Tensor:
    """`e`'s tensor inside a unit-layout byte buffer (the unit's host buffer or its slot)."""
    return buf[e.offset:e.offset + e.nbytes].view(e.dtype).view(e.shape)


def pack_unit(host: torch.Tensor, entries: list[PackedTensor], copy: bool = True) -> None:
    """Copy a unit's tensors into its host buffer and re-point their owners there at once, so each
    original storage is freed now, unit by unit, rather than after the whole model was packed.
    `copy=False`: the buffer already holds these bytes (shared with another process): only re-point."""
    with torch.no_grad():
        for e in entries:
            place = packed_view(host, e)
            if copy:
                place.copy_(_tensor_of(e).detach())
            point_owners(e, place)
    return_freed_host_memory()


def free_host_buffer(unit: StreamedUnit) -> None:
    """Unpin (cudaHostUnregister) and free a unit's host buffer; nothing may view it any more."""
    if unit.unpin is not None:
        unit.unpin()
        unit.unpin = None
    unit.host = torch.empty(0, dtype=torch.uint8)
