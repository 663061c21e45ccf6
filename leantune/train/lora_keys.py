"""Which family a LoRA's names belong to.

Each family declares its LoRA names as data (`spec.lora_keys`, a models/lora_keymap.LoraKeyMap:
Flux in models/flux/lora_keys.py, SD3.5 in models/sd3/lora_keys.py). This module only finds them:
every family's map, or the one of a family named by the caller, so the LoRA file code
(lora_formats.py) never names a family itself.
"""

from __future__ import annotations

from leantune.models.lora_keymap import FusedTarget, LoraKeyMap  # noqa: F401  (re-exported)


def key_map(family: str) -> LoraKeyMap:
    """The LoRA names of family `family` ([model] family, `leantune convert --family`)."""
    from leantune.models.family import get_family

    keys = get_family(family).spec.lora_keys
    if keys is None:
        raise KeyError(f"model family {family!r} declares no LoRA names")
    return keys


def all_key_maps() -> list[LoraKeyMap]:
    """Every family's LoRA names, in the families' fixed order."""
    from leantune.models.family import get_family, known_families

    maps = [get_family(name).spec.lora_keys for name in known_families()]
    # families that share a transformer share its names (Qwen-Image and Qwen-Image-Edit): once each
    return list({id(m): m for m in maps if m is not None}.values())
