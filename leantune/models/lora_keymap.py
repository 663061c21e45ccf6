"""LoRA module names of one model family: diffusers (peft) names <-> the family's native names.

We train adapters on diffusers' transformers, whose attention has separate q, k and v Linears. The
reference implementations that kohya sd-scripts and ComfyUI follow (BFL's Flux, Stability's MMDiT
for SD3.5) fuse them: Flux's `double_blocks.N.img_attn.qkv`, SD3's
`joint_blocks.N.x_block.attn.qkv`, Flux's single-block `linear1` (q, k, v and the MLP input at
once). A `FusedTarget` records, for one native Linear, which diffusers Linears make up its output
rows and in what proportions, so LoRA files can be fused on export and split on import
(train/lora_formats.py does the arithmetic).

A `LoraKeyMap` is one family's name table, built from data: the block lists (diffusers attribute,
native prefix, in-block names), the top-level Linears, which modulation Linears order their two
output halves differently, and the header notes kohya writes (`ss_network_module`,
`ss_base_model_version`). Each family module declares one and hangs it on its `ModelSpec`
(`spec.lora_keys`); the generic LoRA code never names a family's modules itself.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cached_property

KOHYA_PREFIX = "lora_unet_"

# Row-half swap rules (see FusedTarget.swaps_halves).
NEVER, ALWAYS, WHEN_TWO_CHUNKS = "", "always", "when_two_chunks"

# In-block table: native name inside a block -> (diffusers names inside the block, relative widths)
BlockTable = dict[str, tuple[tuple[str, ...], tuple[int, ...]]]


@dataclass(frozen=True)
class FusedTarget:
    """One native Linear and the diffusers Linears whose outputs it stacks (rows, top to bottom)."""

    native: str                 # "double_blocks.3.img_attn.qkv", "joint_blocks.3.x_block.attn.qkv"
    parts: tuple[str, ...]      # ("transformer_blocks.3.attn.to_q", "...to_k", "...to_v")
    widths: tuple[int, ...]     # relative row counts of the parts: (1, 1, 1); Flux linear1 (1, 1, 1, 4)
    # Modulation Linears that emit (shift, scale) natively and (scale, shift) in diffusers: a LoRA up
    # matrix's two row halves swap between the layouts. ALWAYS for final layers; WHEN_TWO_CHUNKS for
    # SD3's context adaLN, which emits two chunks (out = 2 * in) only in the last, context-pre-only
    # block (elsewhere six chunks, in the same order in both layouts).
    swap: str = NEVER

    @property
    def kohya(self) -> str:
        """kohya / ComfyUI module name: 'lora_unet_double_blocks_3_img_attn_qkv'."""
        return KOHYA_PREFIX + self.native.replace(".", "_")

    def swaps_halves(self, out_rows: int, in_features: int) -> bool:
        """Whether a LoRA of this shape on this Linear has its up matrix's row halves swapped."""
        return self.swap == ALWAYS or (self.swap == WHEN_TWO_CHUNKS and out_rows == 2 * in_features)


class LoraKeyMap:
    """One family's LoRA names: native (BFL / Stability / kohya) <-> diffusers, from tables."""

    def __init__(self, family: str, display: str, block_lists: tuple[tuple[str, str, BlockTable], ...],
                 top: dict[str, str], swaps: dict[str, str], header: dict[str, str],
                 header_hints: tuple[str, ...], widths: tuple[int, ...] = (),
                 ratios: dict[str, tuple[int, int]] | None = None, comfyui_unnamed: tuple[str, ...] = ()):
        self.family = family                # "flux": the ModelFamily name
        self.display = display              # "Flux": in messages
        # (diffusers attribute, native prefix, in-block table): ("transformer_blocks", "double_blocks", {...})
        self.block_lists = block_lists
        self.top = top                      # top-level native name -> diffusers name
        self.swaps = swaps                  # native name (top level, or inside a block) -> swap rule
        self.header = header                # kohya header notes for files of this family
        # Lower-case prefixes of `ss_base_model_version` / `modelspec.architecture` values that say
        # a file is for this family (a tie-breaker only, when the keys fit several families).
        self.header_hints = header_hints
        # Transformer widths of the family's released checkpoints (Flux.1: 3072): the most common
        # LoRA input width of a file tells its family apart when names and header cannot.
        self.widths = widths
        # (outputs, inputs) proportions of native Linears (names inside a block, or top level) whose
        # shape tells this family from another with the same names (Flux.1's single-block linear1
        # is 7:1, FLUX.2's 9:1): a LoRA of other proportions is not this family's.
        self.ratios = dict(ratios or {})
        # diffusers module names ComfyUI's LoRA key map has no diffusers-layout name for (it knows
        # those modules only by their native names): a diffusers file's keys for them are skipped
        # there, so a diffusers export that has them says so (lora_formats.save_lora)
        self.comfyui_unnamed = frozenset(comfyui_unnamed)

    def __repr__(self) -> str:
        return f"LoraKeyMap({self.family!r})"

    # -- reverse tables -------------------------------------------------------------------------------
    @cached_property
    def _native_block_re(self) -> re.Pattern:
        prefixes = "|".join(re.escape(p) for _, p, _ in self.block_lists)
        return re.compile(rf"({prefixes})\.(\d+)\.(.+)")

    @cached_property
    def _kohya_block_re(self) -> re.Pattern:
        prefixes = "|".join(re.escape(p) for _, p, _ in self.block_lists)
        return re.compile(rf"({prefixes})_(\d+)_(.+)")

    @cached_property
    def _diffusers_block_re(self) -> re.Pattern:
        attrs = "|".join(re.escape(a) for a, _, _ in self.block_lists)
        return re.compile(rf"({attrs})\.(\d+)\.(.+)")

    @cached_property
    def _kohya_suffix(self) -> dict[str, dict[str, str]]:
        """native prefix -> {kohya suffix ('img_attn_qkv') -> native in-block name ('img_attn.qkv')}"""
        return {prefix: {name.replace(".", "_"): name for name in table} for _, prefix, table in self.block_lists}

    @cached_property
    def _kohya_top(self) -> dict[str, str]:
        return {name.replace(".", "_"): name for name in self.top}

    @cached_property
    def _diffusers_part(self) -> dict[str, dict[str, tuple[str, int]]]:
        """diffusers attribute -> {diffusers in-block name -> (native in-block name, part index)}"""
        return {attr: {part: (name, i) for name, (parts, _) in table.items() for i, part in enumerate(parts)}
                for attr, _, table in self.block_lists}

    @cached_property
    def _diffusers_top(self) -> dict[str, str]:
        return {d: n for n, d in self.top.items()}

    # -- lookups ----------------------------------------------------------------------------------------
    def target_for_native(self, native: str) -> FusedTarget | None:
        """The target of a native module name ('single_blocks.0.linear1'), or None if it is not one."""
        if native in self.top:
            return FusedTarget(native, (self.top[native],), (1,), self.swaps.get(native, NEVER))
        m = self._native_block_re.fullmatch(native)
        if not m:
            return None
        prefix, index, inner = m.groups()
        for attr, native_prefix, table in self.block_lists:
            if native_prefix == prefix and inner in table:
                parts, widths = table[inner]
                return FusedTarget(f"{prefix}.{int(index)}.{inner}", tuple(f"{attr}.{int(index)}.{p}" for p in parts),
                                   widths, self.swaps.get(inner, NEVER))
        return None

    def target_for_kohya(self, name: str) -> FusedTarget | None:
        """The target of a kohya module name ('lora_unet_double_blocks_0_img_attn_qkv'), or None."""
        if not name.startswith(KOHYA_PREFIX):
            return None
        rest = name[len(KOHYA_PREFIX):]
        if rest in self._kohya_top:
            return self.target_for_native(self._kohya_top[rest])
        m = self._kohya_block_re.fullmatch(rest)
        if not m:
            return None
        prefix, index, suffix = m.groups()
        inner = self._kohya_suffix[prefix].get(suffix)
        return None if inner is None else self.target_for_native(f"{prefix}.{int(index)}.{inner}")

    def target_for_diffusers(self, name: str) -> tuple[FusedTarget, int] | None:
        """(target, index of `name` among its parts) for a diffusers Linear name, or None if unknown."""
        if name in self._diffusers_top:
            return self.target_for_native(self._diffusers_top[name]), 0
        m = self._diffusers_block_re.fullmatch(name)
        if not m:
            return None
        attr, index, inner = m.groups()
        found = self._diffusers_part[attr].get(inner)
        if found is None:
            return None
        native_inner, part = found
        native_prefix = next(p for a, p, _ in self.block_lists if a == attr)
        return self.target_for_native(f"{native_prefix}.{int(index)}.{native_inner}"), part

    def target_for_lycoris(self, name: str) -> tuple[FusedTarget, int] | None:
        """(target, part) for a LyCORIS module name, diffusers' path with '_' for '.'
        ('lycoris_transformer_blocks_0_attn_to_q'), or None."""
        if not name.startswith("lycoris_"):
            return None
        rest = name[len("lycoris_"):]
        if rest in self._lycoris_top:
            return self.target_for_diffusers(self._lycoris_top[rest])
        m = self._lycoris_block_re.fullmatch(rest)
        if not m:
            return None
        attr, index, suffix = m.groups()
        inner = self._lycoris_suffix[attr].get(suffix)
        return None if inner is None else self.target_for_diffusers(f"{attr}.{int(index)}.{inner}")

    @cached_property
    def _lycoris_block_re(self) -> re.Pattern:
        attrs = "|".join(re.escape(a) for a, _, _ in sorted(self.block_lists, key=lambda b: -len(b[0])))
        return re.compile(rf"({attrs})_(\d+)_(.+)")

    @cached_property
    def _lycoris_suffix(self) -> dict[str, dict[str, str]]:
        return {attr: {p.replace(".", "_"): p for parts, _ in table.values() for p in parts}
                for attr, _, table in self.block_lists}

    @cached_property
    def _lycoris_top(self) -> dict[str, str]:
        return {d.replace(".", "_"): d for d in self.top.values()}

    def shape_problem(self, target: FusedTarget, out_features: int, in_features: int) -> str | None:
        """Why a LoRA of shape (out, in) on `target` cannot be this family's, or None."""
        m = self._native_block_re.fullmatch(target.native)
        inner = m.group(3) if m else target.native
        if inner not in self.ratios:
            return None
        a, b = self.ratios[inner]
        if out_features * b != in_features * a:
            return (f"{out_features} outputs for {in_features} inputs, where a {self.display} {inner} has "
                    f"{a}:{b}")
        return None

    def has_width(self, width: int) -> bool:
        return width in self.widths

    def hinted_by(self, metadata: dict[str, str]) -> bool:
        """Whether a file header names this family (kohya's ss_base_model_version, modelspec)."""
        return self.hint_strength(metadata) > 0

    def hint_strength(self, metadata: dict[str, str]) -> int:
        """The length of the longest of this family's hints the header starts with (0: none), so that
        a header naming "flux2" picks FLUX.2 over Flux.1, whose hint "flux" it also starts with."""
        best = 0
        for key in ("ss_base_model_version", "modelspec.architecture"):
            value = str(metadata.get(key, "")).strip().lower()
            best = max([best] + [len(h) for h in self.header_hints if value and value.startswith(h)])
        return best
