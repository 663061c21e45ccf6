"""Previews on another base: the LoRA being trained, sampled on another checkpoint of its family.

`[sample] base` (train on Krea 2 Raw, preview on Turbo): at each preview the other transformer is
read from disk into host RAM (models/other_base.py: what that costs), the preview's frozen adapters
([sample] base_adapters, else [model]'s: train/base_adapters.py) and a copy of the trained adapter
(at strength 1) are attached to it unmerged, exactly as to the training model, and it samples
through the memory engine with the cached prompts; then it is released. The training model is not
touched: its weights, adapters, memory plan and optimizer state stay where they are.

Its placement is fixed, so the planner can price it without a search: every block and the
non-block group streamed through a ring of two slots, in the training plan's fp8 storage. The
device then holds two slots of the largest unit beside the training state (the planner's "another
base for previews (ring)" term) and the host the whole other transformer (its "another base for
previews" term), each only while the preview runs.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Sequence

import torch
from torch import nn

from ..memory.plan import Plan
from .sampler import sample_during_training


def preview_plan(spec, model: nn.Module, fp8: bool = False) -> Plan:
    """Every block and the non-block group streamed through two slots (the planner prices this)."""
    return Plan(streamed_blocks=tuple(name for name, _ in spec.blocks(model)), stream_non_blocks=True, fp8=fp8,
                ring_slots=2)


def sample_on_other_base(trained: nn.Module, load_base: Callable[[], nn.Module], adapters: Sequence,
                         embeds, sample_cfg, *, family, vae, device, dtype: torch.dtype, base_path,
                         fp8: bool = False, negative=None, references=None, schedule_folder=None,
                         variant: str = "auto"):
    """A grid of samples from the other base + `adapters` (train/base_adapters.BaseAdapter, frozen)
    + the trained adapter of `trained` (its "default" adapter, at strength 1).

    `load_base()` reads the other transformer onto the CPU (models/other_base.load_other_base);
    `schedule_folder`: the other base's diffusers folder, whose scheduler config is its schedule
    (Krea 2 Turbo's is told by its folder: models/krea2), None for a single file (the published
    schedule of its variant); `variant`: [sample] base_variant, the other base's kind where its
    file cannot say ("turbo" for a Krea 2 Turbo single file); the rest are sample_during_training's
    arguments."""
    from ..memory.engine import apply_memory
    from ..models.other_base import check_same_architecture
    from ..train.lora import apply_lora, lora_weights_from_model

    lora = lora_weights_from_model(trained, "default")        # a CPU copy: the training model is untouched
    other = load_base().eval().requires_grad_(False)
    handle = None
    try:
        check_same_architecture(trained, other, base_path)
        for i, a in enumerate(adapters):
            apply_lora(other, a.weights, strength=a.strength, adapter_name=f"base_adapter_{i}")
        apply_lora(other, lora, strength=1.0, adapter_name="trained")
        schedule = family.sampling.schedule(variant if variant != "auto" else family.sampling.variant(other),
                                            schedule_folder)
        handle = apply_memory(other, family.spec, preview_plan(family.spec, other, fp8), device)
        return sample_during_training(other, vae, embeds, sample_cfg, memory_handle=handle, device=device,
                                      dtype=dtype, negative=negative, references=references, family=family,
                                      schedule=schedule)
    finally:
        if handle is not None:
            handle.release()           # the model is dropped: nothing to restore
        del other, handle
        gc.collect()
        if torch.device(device).type == "cuda":
            torch.cuda.empty_cache()
