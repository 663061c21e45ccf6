"""Base adapters: frozen LoRAs under the trained one ([model] base_adapters, [sample] base_adapters).

A distilled "turbo" base (Z-Image Turbo, Krea 2 Turbo) loses its distillation when a plain LoRA
trains on it. The recipe other engines use is a frozen LoRA applied to the base while the new LoRA
trains and left out afterwards: ostris' de-distilling training adapter for Z-Image Turbo
(ai-toolkit's "assistant LoRA"), musubi-tuner's `--base_weights`. The trained LoRA then learns only
what the frozen one does not already do, and the exported file holds the trained adapter alone.

Design: separate, frozen, unmerged adapters, not a merge into the base weights.
- Each file becomes its own peft adapter beside the trained one (train/lora.apply_lora, as the
  sampler stacks LoRAs), attached after the trained adapter and before the memory engine. Its
  weights are frozen (no gradient, no optimizer state, not in the resumable state) and it is not
  exported: `lora_weights_from_model(transformer, "default")` reads the trained adapter only.
- Previews without it are exact: switching an adapter off removes its term from each wrapped
  Linear's sum, so `[sample] base_adapters = []` samples exactly the base plus the trained LoRA,
  and `[sample] base_adapters = [other]` another stack, while training goes on with [model]'s. A
  merge would rewrite the base weights (before fp8 quantization and streaming, so in e4m3 where
  the plan stores fp8): previews without the adapter would then need an unmerged copy of the
  whole base, and the fp8 rounding of the merged weights would differ from the base's own.
- The cost is the adapters' own bytes, in fp32 as apply_lora stores them, and they travel with
  their block: a streamed block's base-adapter weights are packed into its host unit beside its
  base weights (memory/streaming_units.streams_with_unit: frozen weights of adapters named
  `PREFIX`...), copied into the ring slot with it and exact there (their dtype as stored, never
  fp8), so the device holds them only while their block computes; a resident block's stay
  resident, and so does the trained adapter everywhere (the optimizer steps it in place). A
  Z-Image Turbo training adapter or a Krea 2 Turbo LoRA at high rank (hundreds of MiB) thus
  costs VRAM only for the blocks that do not stream. The planner prices them so
  (`unit_tensors`: each tensor by the module it sits in; planner/memory_model.py adds a streamed
  block's to its unit, hence the slots, host RAM and copy time, and counts the rest as the
  "base adapters (resident)" VRAM term). A frozen adapter saves nothing for backward
  (both its Linears are frozen: only their weights are needed to pass the gradient through), so
  its activations are the (tokens, rank) intermediates of the wrapped Linears, transient and left
  unpriced; its FLOPs (2 * rank * (in + out) per token) are small beside the Linear's own.
- Every adapter a phase uses is attached once, at the start: [model]'s and [sample]'s (a file in
  both is attached once and takes each phase's strength). Attaching one later, to a model whose
  blocks already stream, would wrap Linears the engine has re-pointed at its slots. A streamed
  block's unit carries every attached file's weights, the phase's inactive ones too: switching
  stacks (`for_sampling`) changes which adapters compute and at what scale, never where a weight
  lives, so a preview on another stack is as exact streamed as resident.

`BaseAdapterStack.for_sampling()` switches to the preview's stack and back; the active set of the
trained adapter and every parameter's requires_grad are kept across the switch (peft's set_adapter
toggles requires_grad).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from ..memory.streaming_units import STREAMED_ADAPTER_PREFIX
from .lora import (LoraFormatError, LoraWeights, adapter_parameters, apply_lora, check_fits, layer_adapters,
                   lora_layers, read_lora)

log = logging.getLogger("leantune")

# peft adapter names of the frozen stack (the trained one is "default"); the memory engine streams
# the weights of adapters so named with their block
PREFIX = STREAMED_ADAPTER_PREFIX


@dataclass(frozen=True)
class BaseAdapter:
    """One frozen LoRA of a stack: its file, its strength in that stack, and its weights."""

    path: Path
    strength: float
    weights: LoraWeights
    entry: str = "base adapter"       # where it was named ("[model] base_adapters #1"), for errors


def read_adapters(refs: Sequence, resolve: Callable[[str], Path], keys, where: str) -> list[BaseAdapter]:
    """Read every file of a base_adapters list (config.AdapterRef: path, strength) as a LoRA of the
    family (`keys`: its spec.lora_keys), in any layout leantune reads. `where` names the list in
    errors ("[model] base_adapters"); each error also names the file and, for a bad file, the key."""
    out = []
    for i, ref in enumerate(refs):
        path = resolve(ref.path)
        entry = f"{where} #{i + 1}"
        if not path.is_file():
            raise FileNotFoundError(f"{entry}: {path}: no such LoRA file")
        twice = [a.entry for a in out if a.path == path]
        if twice:       # one adapter per file: a second entry would not add its strength
            raise LoraFormatError(f"{entry}: {path} is listed already ({twice[0]}); give it once, with the "
                                  f"strength wanted")
        try:
            weights = read_lora(path, keys)
        except (LoraFormatError, ValueError, OSError) as e:    # the message names the file and key
            raise LoraFormatError(f"{entry}: {e}") from None
        if not weights.modules:
            raise LoraFormatError(f"{entry}: {path}: holds no LoRA weights for this model's family")
        out.append(BaseAdapter(path, float(ref.strength), weights, entry))
    return out


def check_adapters(model: torch.nn.Module, adapters: Sequence[BaseAdapter]) -> None:
    """Every adapter fits `model`'s Linears (a meta build will do: only shapes are read); the error
    names the config entry, the file and the key that does not fit."""
    for a in adapters:
        try:
            check_fits(model, a.weights)
        except LoraFormatError as e:
            raise LoraFormatError(f"{a.entry}: {e}") from None


def read_run_adapters(model_cfg, sample_cfg, resolve: Callable[[str], Path], keys
                      ) -> tuple[list[BaseAdapter], list[BaseAdapter] | None]:
    """([model] base_adapters, [sample] base_adapters or None when previews use [model]'s), read."""
    training = read_adapters(model_cfg.base_adapters, resolve, keys, "[model] base_adapters")
    sampling = None
    if sample_cfg is not None and sample_cfg.base_adapters is not None:
        sampling = read_adapters(sample_cfg.base_adapters, resolve, keys, "[sample] base_adapters")
    return training, sampling


def adapter_bytes(adapters: Sequence[BaseAdapter]) -> int:
    """Device bytes the distinct files of `adapters` hold once attached: fp32 down and up matrices."""
    distinct = {a.path: a.weights for a in adapters}
    return sum(4 * t.numel() for w in distinct.values() for m in w.modules.values() for t in m.tensors().values())


def priced_bytes(training: Sequence[BaseAdapter], sampling: Sequence[BaseAdapter] | None) -> int:
    """What a run's stack holds in all (every adapter of either phase, each file once): on the
    device where its blocks are resident, in their units where they stream."""
    return adapter_bytes([*training, *(sampling or ())])


def unit_tensors(adapters: Sequence[BaseAdapter]) -> tuple[tuple[str, int], ...]:
    """(module name, bytes) of every weight the distinct files of `adapters` attach, fp32 as
    apply_lora stores them: the planner adds each to the unit of the block that module sits in
    (planner/memory_model.py), as the engine packs it (memory/streaming_units.streams_with_unit)."""
    distinct = {a.path: a.weights for a in adapters}
    return tuple((name, 4 * t.numel()) for w in distinct.values() for name, m in sorted(w.modules.items())
                 for t in m.tensors().values())


def priced_tensors(training: Sequence[BaseAdapter], sampling: Sequence[BaseAdapter] | None
                   ) -> tuple[tuple[str, int], ...]:
    """`unit_tensors` of a run's stack (every adapter of either phase, each file once)."""
    return unit_tensors([*training, *(sampling or ())])


class BaseAdapterStack:
    """The frozen adapters attached to one transformer, and which of them each phase uses."""

    def __init__(self, transformer: torch.nn.Module, training: Sequence[BaseAdapter],
                 sampling: Sequence[BaseAdapter] | None = None):
        """Attach every distinct file of `training` and `sampling` (None: previews use `training`)
        as a frozen, unmerged adapter, and switch to the training stack. Call after the trained
        adapter is added and before the memory engine is applied. Every file is checked against the
        model before the first is attached, so a LoRA for another model is never half applied."""
        self.transformer = transformer
        self.training = list(training)
        self.sampling = list(training if sampling is None else sampling)
        self.names: dict[Path, str] = {}
        attach: list[BaseAdapter] = []
        for a in [*self.training, *self.sampling]:
            if a.path not in self.names:
                self.names[a.path] = f"{PREFIX}{len(self.names)}"
                attach.append(a)
        check_adapters(transformer, attach)
        for a in attach:
            apply_lora(transformer, a.weights, strength=a.strength, adapter_name=self.names[a.path])
        self.use(self.training)
        if attach:
            log.info("base adapters: %s (frozen, not exported)%s", ", ".join(
                f"{a.path.name} x{a.strength:g}" for a in self.training) or "none while training",
                "" if sampling is None else "; previews: " + (", ".join(
                    f"{a.path.name} x{a.strength:g}" for a in self.sampling) or "none"))

    @property
    def all_names(self) -> set[str]:
        return set(self.names.values())

    def device_bytes(self) -> int:
        """Bytes the stack's adapter weights hold, wherever they are (under the engine: on the device
        for resident blocks, in the ring slots' views for streamed ones)."""
        total = 0
        for name in self.all_names:
            for layer in lora_layers(self.transformer, name).values():
                for p in adapter_parameters(layer, name).values():
                    total += p.numel() * p.element_size()
        return total

    def use(self, adapters: Sequence[BaseAdapter]) -> None:
        """Make exactly `adapters` (at their strengths) the active base adapters; every other adapter
        (the trained one) keeps its active state, every parameter its requires_grad."""
        from peft.tuners.tuners_utils import BaseTunerLayer

        wanted = {self.names[a.path]: a.strength for a in adapters}
        mine = self.all_names
        grads = {p: p.requires_grad for p in self.transformer.parameters()}
        try:
            for module in self.transformer.modules():
                if not isinstance(module, BaseTunerLayer):
                    continue
                present = layer_adapters(module)
                active = [n for n in module.active_adapters if n not in mine]
                active += [n for n in wanted if n in present]
                module.set_adapter(active)
                for n, strength in wanted.items():
                    if n in present:
                        module.set_scale(n, strength)
        finally:
            for p, g in grads.items():
                p.requires_grad_(g)

    @contextmanager
    def for_sampling(self):
        """The preview's stack ([sample] base_adapters) inside, the training stack again after."""
        self.use(self.sampling)
        try:
            yield
        finally:
            self.use(self.training)

    def describe(self, phase: str = "sampling") -> str:
        """'a.safetensors:1, b.safetensors:0.5' (a PNG's parameters), or '' for none."""
        adapters = self.sampling if phase == "sampling" else self.training
        return ", ".join(f"{a.path}:{a.strength:g}" for a in adapters)
