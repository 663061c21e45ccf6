"""The resolved memory plan: what the engine applies, what the planner chooses.

Kept apart from the [memory] config section on purpose: the config says what the user asked for
("auto", a budget, or explicit choices); a Plan is the concrete decision, never written back into
the validated config.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Literal

Checkpointing = Literal["none", "blocks", "offload"]


@dataclass(frozen=True)
class Plan:
    # Qualified names of the blocks to stream, e.g. ("transformer_blocks.3", "single_transformer_blocks.10").
    streamed_blocks: tuple[str, ...] = ()
    stream_non_blocks: bool = False     # stream embedders + final layer as one group
    fp8: bool = False                   # block-scaled e4m3 storage of block Linear weights
    fp8_modulation: bool = False        # ... of the modulation/adaLN Linears too (spec.modulation)
    checkpointing: Checkpointing = "none"
    ring_slots: int = 2
    pin_memory: bool = True
    debug_poison: bool = False
    # Full fine-tuning: the streamed blocks' optimizer step runs on the host (their optimizer state
    # stays in host RAM and never travels; their gradients go to the host) instead of on the device
    # (state packed with the weights, brought in and written back). memory/trainable_streaming.py.
    optimizer_on_host: bool = False
    # Streamed blocks whose packed bytes live on disk, not in host RAM (the third tier,
    # memory/disk_tier.py): a subset of streamed_blocks, frozen (LoRA) runs only.
    disk_blocks: tuple[str, ...] = ()
    # The format of the block Linears fp8 / fp8_modulation quantize: "fp8" (block-scaled e4m3,
    # memory/fp8.py), "int8" (ConvRot rows, memory/int8_storage.py) or "nf4" (bitsandbytes rows,
    # memory/nf4_storage.py); the planner chooses it under [memory] base_format = "auto".
    base_format: Literal["fp8", "int8", "nf4"] = "fp8"
    # Split blocks (memory/split_parts.py): a family's split blocks keep their parts' inputs only
    # and recompute each part in its own backward (less activation memory, one more forward per
    # block); the planner takes it only with checkpointing "blocks" / "offload".
    split_blocks: bool = False
    # Free-form notes from the planner (predicted peak, why this plan); not used by the engine.
    notes: dict = field(default_factory=dict, compare=False)

    @property
    def storage(self) -> tuple[bool, bool]:
        """(fp8, fp8_modulation): what the planner prices a plan's weights and activations by."""
        return (self.fp8, self.fp8_modulation)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["streamed_blocks"] = list(self.streamed_blocks)
        d["disk_blocks"] = list(self.disk_blocks)
        if not self.disk_blocks:
            del d["disk_blocks"]          # a plan without the disk tier reads as before it
        if self.base_format == "fp8":
            del d["base_format"]          # an fp8 (or bf16) plan reads as before the base formats
        if not self.split_blocks:
            del d["split_blocks"]         # a plan without split blocks reads as before them
        return d

    def describe(self, lora: bool = False) -> str:
        """One line. `lora`: the plan of a LoRA run, whose host optimizer step is its adapters'
        (train/lora_host_step.py), not the streamed blocks' (a full fine-tune's)."""
        host_step = "LoRA optimizer step on the host" if lora else "optimizer step of streamed blocks on the host"
        return (f"stream {len(self.streamed_blocks)} blocks{' + non-blocks' if self.stream_non_blocks else ''}, "
                f"{self._storage_text()}, checkpointing={self.checkpointing}, ring {self.ring_slots}, "
                f"{'pinned' if self.pin_memory else 'pageable'}"
                + (f", {host_step}" if self.optimizer_on_host else "")
                + (f", {len(self.disk_blocks)} of them read from disk" if self.disk_blocks else "")
                + (", split blocks" if self.split_blocks else ""))

    def _storage_text(self) -> str:
        mod = " + modulation" if self.fp8_modulation else ""
        if self.base_format != "fp8" and (self.fp8 or self.fp8_modulation):
            return f"base {self.base_format}{mod}"
        return f"fp8={'on' if self.fp8 else 'off'}{mod}"
