"""LoRA on a model of parts that compute one at a time (`[model] expert = "both"`: Wan 2.2 A14B's
high- and low-noise experts in one run), one adapter per part or one shared by all.

- "each" ([lora] experts): every part gets its own adapter. A forward call runs one part
  (wan/experts.WanExperts routes each timestep to its expert), so a step's loss reaches only that
  part's adapter: the other's gradient stays None, and the optimizer skips it (its weights and
  moments do not move). Files: one per part, `<name>_<part>_<format>` (`<name>_high_noise_...`,
  `<name>_low_noise_...`), each in the family's LoRA names, so a user loads the high-noise file
  into WanPipeline's `transformer` and the low-noise one with `load_lora_weights(...,
  load_into_transformer_2=True)`, or each into its expert's ComfyUI LoRA loader.
- "shared": the parts' adapters are the same tensors (each part's peft layer holds the first
  part's adapter Parameters), so every step trains the one adapter, and its one file
  `<name>_<format>` loads into both experts.

`[lora] init_from` starts every part's adapter from the one file (a shared adapter: once).

The resumable state is the LoraMode's: the trainable parameters by name (a shared tensor once) and
the optimizer state, so an interrupted two-expert run resumes both adapters and their moments.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import torch

from ..memory.switched import parts_of
from .lora_mode import LoraMode

log = logging.getLogger("leantune")


def _tie(first: torch.nn.Module, other: torch.nn.Module, adapter_name: str) -> int:
    """Make `other`'s adapter the very modules / Parameters of `first`'s (same module names, same
    shapes: the parts share one architecture); returns how many tuner layers were tied."""
    from .lora import _LOHA_ROLES, _LOKR_ROLES, _LORA_ROLES, layer_kind, lora_layers

    mine, theirs = lora_layers(first, adapter_name), lora_layers(other, adapter_name)
    if set(mine) != set(theirs):
        raise ValueError("the parts' adapters are on different modules; they cannot share one LoRA")
    for name, layer in theirs.items():
        roles = {"lokr": _LOKR_ROLES, "loha": _LOHA_ROLES}.get(layer_kind(layer, adapter_name), _LORA_ROLES)
        for attr in roles.values():
            src, dst = getattr(mine[name], attr, None), getattr(layer, attr, None)
            if src is None or dst is None or adapter_name not in src:
                continue
            a, b = src[adapter_name], dst[adapter_name]
            shape = (lambda x: tuple(x.shape if isinstance(x, torch.nn.Parameter) else x.weight.shape))
            if shape(a) != shape(b):
                raise ValueError(f"{name}.{attr}: the parts' adapters differ in shape; they cannot share one LoRA")
            dst[adapter_name] = a            # the same module (LoRA's A / B) or Parameter (LoKr, LoHa)
    return len(theirs)


class PartsLoraMode(LoraMode):
    """LoraMode on every part of the model (`[lora] experts` = "each" or "shared")."""

    def __init__(self, *args, shared: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self.shared = bool(shared)
        self.part_names: list[str] = []

    def prepare(self, transformer: torch.nn.Module, spec) -> list[torch.nn.Parameter]:
        parts = parts_of(transformer)
        if parts is None:
            raise ValueError("[model] expert = \"both\": the loaded model has one transformer")
        self.part_names = list(parts)
        transformer.requires_grad_(False)
        params: list[torch.nn.Parameter] = []
        first = None
        for name, part in parts.items():
            got = super().prepare(part, spec)
            if first is None:
                first, params = part, list(got)
            elif self.shared:
                _tie(first, part, "default")
            else:
                params.extend(got)
        log.info("lora: %s over the parts %s", "one adapter shared" if self.shared else "one adapter each",
                 ", ".join(self.part_names))
        return params

    def export(self, t, paths, step: int, intermediate: bool) -> list[Path]:
        """One file set per part ("each"), or the shared adapter's one set; see the module docstring."""
        parts = parts_of(t.transformer)
        if self.shared:
            first = next(iter(parts.values()))
            return super().export(SimpleNamespace(transformer=first, optimizer=getattr(t, "optimizer", None)),
                                  paths, step, intermediate)
        files = []
        for name, part in parts.items():
            view = SimpleNamespace(transformer=part, optimizer=getattr(t, "optimizer", None))
            files += super().export(view, replace(paths, name=f"{paths.name}_{name}"), step, intermediate)
        return files

    def _metadata(self, step: int, keys) -> dict:
        return {**super()._metadata(step, keys), "leantune_experts": "shared" if self.shared else "each"}
