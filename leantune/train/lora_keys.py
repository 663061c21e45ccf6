"""Names of Flux LoRA modules: diffusers (peft) names <-> BFL / kohya / ComfyUI names.

We train adapters on diffusers' `FluxTransformer2DModel`, whose attention has separate q, k and v
Linears; BFL's reference model (and therefore kohya and ComfyUI files) fuses them: a double block
has one `img_attn.qkv` and one `txt_attn.qkv`, a single block one `linear1` computing q, k, v and
the MLP input at once. A `FusedTarget` records, for one BFL Linear, which diffusers Linears make up
its output rows and in what proportions, so LoRA files can be fused on export and split on import
(lora_formats.py does the arithmetic). This module is only the name table.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

KOHYA_PREFIX = "lora_unet_"


@dataclass(frozen=True)
class FusedTarget:
    """One BFL Linear and the diffusers Linears whose outputs it stacks (rows, top to bottom)."""

    bfl: str                    # "double_blocks.3.img_attn.qkv"
    parts: tuple[str, ...]      # ("transformer_blocks.3.attn.to_q", "...to_k", "...to_v")
    widths: tuple[int, ...]     # relative row counts of the parts: (1, 1, 1); linear1 (1, 1, 1, 4)
    # The final layer's adaLN emits (shift, scale) in BFL and (scale, shift) in diffusers, so a LoRA
    # up matrix's two row halves swap between the layouts.
    swap_halves: bool = False

    @property
    def kohya(self) -> str:
        """kohya / ComfyUI module name: 'lora_unet_double_blocks_3_img_attn_qkv'."""
        return KOHYA_PREFIX + self.bfl.replace(".", "_")


# BFL name inside a double block -> (diffusers names inside a FluxTransformerBlock, widths)
_DOUBLE: dict[str, tuple[tuple[str, ...], tuple[int, ...]]] = {
    "img_attn.qkv": (("attn.to_q", "attn.to_k", "attn.to_v"), (1, 1, 1)),
    "txt_attn.qkv": (("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"), (1, 1, 1)),
    "img_attn.proj": (("attn.to_out.0",), (1,)),
    "txt_attn.proj": (("attn.to_add_out",), (1,)),
    "img_mlp.0": (("ff.net.0.proj",), (1,)),
    "img_mlp.2": (("ff.net.2",), (1,)),
    "txt_mlp.0": (("ff_context.net.0.proj",), (1,)),
    "txt_mlp.2": (("ff_context.net.2",), (1,)),
    "img_mod.lin": (("norm1.linear",), (1,)),
    "txt_mod.lin": (("norm1_context.linear",), (1,)),
}
# Single blocks: linear1 = [q | k | v | mlp_in] with the MLP 4x the attention width (Flux mlp_ratio).
_SINGLE: dict[str, tuple[tuple[str, ...], tuple[int, ...]]] = {
    "linear1": (("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp"), (1, 1, 1, 4)),
    "linear2": (("proj_out",), (1,)),
    "modulation.lin": (("norm.linear",), (1,)),
}
# Top-level Linears (embedders and final layer): never targeted by our presets, but other tools
# train them, so files that carry them must be read.
_TOP: dict[str, str] = {
    "img_in": "x_embedder",
    "txt_in": "context_embedder",
    "time_in.in_layer": "time_text_embed.timestep_embedder.linear_1",
    "time_in.out_layer": "time_text_embed.timestep_embedder.linear_2",
    "vector_in.in_layer": "time_text_embed.text_embedder.linear_1",
    "vector_in.out_layer": "time_text_embed.text_embedder.linear_2",
    "guidance_in.in_layer": "time_text_embed.guidance_embedder.linear_1",
    "guidance_in.out_layer": "time_text_embed.guidance_embedder.linear_2",
    "final_layer.linear": "proj_out",
    "final_layer.adaLN_modulation.1": "norm_out.linear",
}
_SWAPPED = {"final_layer.adaLN_modulation.1"}

# Block list attributes on the diffusers model and their BFL prefixes (as in FLUX_SPEC).
_BLOCK_LISTS = (
    ("transformer_blocks", "double_blocks", _DOUBLE),
    ("single_transformer_blocks", "single_blocks", _SINGLE),
)

_BFL_BLOCK_RE = re.compile(r"(double_blocks|single_blocks)\.(\d+)\.(.+)")
_KOHYA_BLOCK_RE = re.compile(r"(double_blocks|single_blocks)_(\d+)_(.+)")
_DIFFUSERS_BLOCK_RE = re.compile(r"(transformer_blocks|single_transformer_blocks)\.(\d+)\.(.+)")

# Reverse tables: kohya suffix -> BFL name; diffusers in-block name -> (BFL name, part index).
_KOHYA_SUFFIX = {bfl_prefix: {name.replace(".", "_"): name for name in table} for _, bfl_prefix, table in _BLOCK_LISTS}
_KOHYA_TOP = {name.replace(".", "_"): name for name in _TOP}
_DIFFUSERS_PART = {
    attr: {part: (name, i) for name, (parts, _) in table.items() for i, part in enumerate(parts)}
    for attr, _, table in _BLOCK_LISTS
}
_DIFFUSERS_TOP = {d: b for b, d in _TOP.items()}


def target_for_bfl(bfl: str) -> FusedTarget | None:
    """The target of a BFL module name ('single_blocks.0.linear1'), or None if it is not a Flux Linear."""
    if bfl in _TOP:
        return FusedTarget(bfl, (_TOP[bfl],), (1,), swap_halves=bfl in _SWAPPED)
    m = _BFL_BLOCK_RE.fullmatch(bfl)
    if not m:
        return None
    kind, index, inner = m.groups()
    for attr, bfl_prefix, table in _BLOCK_LISTS:
        if bfl_prefix == kind and inner in table:
            parts, widths = table[inner]
            return FusedTarget(bfl, tuple(f"{attr}.{int(index)}.{p}" for p in parts), widths)
    return None


def target_for_kohya(name: str) -> FusedTarget | None:
    """The target of a kohya module name ('lora_unet_double_blocks_0_img_attn_qkv'), or None."""
    if not name.startswith(KOHYA_PREFIX):
        return None
    rest = name[len(KOHYA_PREFIX):]
    if rest in _KOHYA_TOP:
        return target_for_bfl(_KOHYA_TOP[rest])
    m = _KOHYA_BLOCK_RE.fullmatch(rest)
    if not m:
        return None
    kind, index, suffix = m.groups()
    inner = _KOHYA_SUFFIX[kind].get(suffix)
    return None if inner is None else target_for_bfl(f"{kind}.{int(index)}.{inner}")


def target_for_diffusers(name: str) -> tuple[FusedTarget, int] | None:
    """(target, index of `name` among its parts) for a diffusers Linear name, or None if unknown."""
    if name in _DIFFUSERS_TOP:
        return target_for_bfl(_DIFFUSERS_TOP[name]), 0
    m = _DIFFUSERS_BLOCK_RE.fullmatch(name)
    if not m:
        return None
    attr, index, inner = m.groups()
    found = _DIFFUSERS_PART[attr].get(inner)
    if found is None:
        return None
    bfl_inner, part = found
    bfl_prefix = next(p for a, p, _ in _BLOCK_LISTS if a == attr)
    return target_for_bfl(f"{bfl_prefix}.{int(index)}.{bfl_inner}"), part
