"""LoRAs for sampling: read every file, check each against the model, then apply them unmerged.

Adapters are applied unmerged (peft layers beside the base Linear), never folded into the base
weights: fp8-stored base weights stay exactly what was loaded, several LoRAs keep their own
strengths, and removing one restores the base exactly (train/lora.py).

A LoRA for another model (SDXL, a Flux of another width) or a corrupt file must not get half-
applied: every file is read and checked before the first adapter is added, and the error names
the file and the key (train/lora_formats.py, train/lora.py).
"""

from __future__ import annotations

from pathlib import Path

from torch import nn


def apply_loras(transformer: nn.Module, loras: list[tuple[Path, float]]) -> list[str]:
    """Apply each (file, strength) as its own frozen, unmerged adapter; returns the adapter names."""
    from ..train.lora import apply_lora, check_fits, model_lora_keys, read_lora

    keys = model_lora_keys(transformer)      # read each file as a LoRA of the model's family
    checked = []
    for path, strength in loras:
        weights = read_lora(path, keys)  # any supported layout; raises naming the file and key
        check_fits(transformer, weights)
        checked.append((weights, strength))
    names = []
    for i, (weights, strength) in enumerate(checked):
        name = f"sample_lora_{i}"
        apply_lora(transformer, weights, strength=strength, adapter_name=name)
        names.append(name)
    return names
