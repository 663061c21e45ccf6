"""ModelSpec: what the generic techniques need to know about a model family, as data.

Memory techniques (streaming, fp8, checkpointing), LoRA targeting and the planner read a spec
instead of naming Flux modules themselves, so adding a family (SD3.5 next) means adding a spec,
not editing techniques.

It lives at the bottom of the package, below the memory engine and the families: it is the contract
between them (a family fills one in, the engine and the planner read it), so neither has to import
the other to share it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Callable

import torch


@dataclass(frozen=True)
class BlockList:
    """One list of repeated transformer blocks, e.g. Flux's 19 double blocks."""

    attr: str             # attribute on the model holding an nn.ModuleList: "transformer_blocks"
    kind: str             # short name used in configs, logs and plan reports: "double"
    kohya_prefix: str     # prefix of this list's keys in BFL / kohya files: "double_blocks"


@dataclass(frozen=True)
class BlockVariant:
    """Blocks of one list built with an extra part, listed by index in the model's config: SD3.5
    Medium's joint blocks 0-12 (`dual_attention_layers`) carry a second, image-only attention.
    They keep their list's attribute, kohya prefix and config kind ("joint"); the planner, whose
    activations, FLOPs and streaming order differ between them, prices them as a kind of their own."""

    attr: str             # the block list they belong to: "transformer_blocks"
    kind: str             # the planner's name for them: "joint_dual"
    config_key: str       # model config entry listing their indices: "dual_attention_layers"


# LoRA preset of every family: its "all" preset in the blocks, plus every Linear outside them
# (embedders, final norm's modulation, final projection). On a trained base those are rarely worth
# adapting; on the demo's random base the LoRA must carry everything, and a random, frozen input
# and output projection would cap what the blocks can learn.
ALL_LINEAR = "all_linear"


@dataclass(frozen=True)
class SingleFileLayout:
    """How a family's reference single file (BFL's flux1-dev.safetensors, Stability's
    sd3.5_large.safetensors) names a transformer's tensors: what a full fine-tune's "comfyui"
    export writes, one group of tensors (the non-block modules, or one block) at a time."""

    name: str                 # "BFL", "Stability": for docs and messages
    prefix: str               # every key's prefix in the file: "" (BFL), "model.diffusion_model." (Stability)
    # (diffusers-named state dict of one group, the whole model) -> the group in the file's names (no prefix)
    to_native: Callable
    # the model -> header entries a loader needs to rebuild the same config at any width
    metadata: Callable


@dataclass(frozen=True)
class ModelSpec:
    family: str
    block_lists: tuple[BlockList, ...]
    # Regexes on a module's name *relative to its block* (e.g. "norm1.linear") whose weights keep
    # the compute dtype under fp8 storage: modulation/adaLN linears and norms.
    fp8_skip: tuple[str, ...]
    # Top-level children that are not blocks (embedders, final norm/projection): they never go fp8
    # and may stream as one group.
    non_block_modules: tuple[str, ...]
    # LoRA target presets: name -> regexes on module names relative to a block.
    lora_presets: dict[str, tuple[str, ...]] = field(default_factory=dict)
    default_lora_preset: str = "attention_mlp"
    # LoRA file names of this family (models/lora_keymap.LoraKeyMap): diffusers <-> kohya / native.
    lora_keys: object = None
    # Regexes (relative to a block) of the modulation/adaLN Linears among `fp8_skip`: the ones fp8
    # storage may still take when a plan asks for fp8 modulation (Plan.fp8_modulation), or when an
    # fp8 checkpoint stores them in e4m3. They map the timestep embedding to per-block scales,
    # shifts and gates: a quarter of Flux's parameters, read once per step for one token.
    modulation: tuple[str, ...] = ()
    # The single-file layout full fine-tunes are exported in (SingleFileLayout); None: no such export.
    single_file: SingleFileLayout | None = None
    # Blocks built unlike the rest of their list (BlockVariant): priced by the planner as their own kind.
    block_variants: tuple[BlockVariant, ...] = ()

    # -- helpers -------------------------------------------------------------------------------
    def block_list(self, kind: str) -> BlockList:
        for bl in self.block_lists:
            if bl.kind == kind:
                return bl
        raise KeyError(f"{self.family} has no block list {kind!r}; it has {[b.kind for b in self.block_lists]}")

    def blocks(self, model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
        """Every block in execution order as (qualified name, module): 'transformer_blocks.3'."""
        out = []
        for bl in self.block_lists:
            for i, block in enumerate(getattr(model, bl.attr)):
                out.append((f"{bl.attr}.{i}", block))
        return out

    def variant_indices(self, config, attr: str) -> dict[str, set[int]]:
        """Variant kind -> indices of the blocks of list `attr` built so, read from a model config
        (a diffusers config or a plain dict; absent or empty entries: none)."""
        cfg = dict(config or {})
        return {v.kind: {int(i) for i in (cfg.get(v.config_key) or ())} for v in self.block_variants if v.attr == attr}

    def list_kinds(self, model: torch.nn.Module, bl: BlockList) -> list[str]:
        """The kind the planner prices each block of list `bl` as: the list's kind, or its variant's."""
        variants = self.variant_indices(getattr(model, "config", None), bl.attr)
        return [next((kind for kind, idx in variants.items() if i in idx), bl.kind)
                for i in range(len(getattr(model, bl.attr)))]

    def block_kinds(self, model: torch.nn.Module) -> list[str]:
        """`list_kinds` of every block in execution order (as `blocks`): SD3.5 Medium, 13
        "joint_dual" then 11 "joint"; a model without variants, its lists' kinds."""
        return [kind for bl in self.block_lists for kind in self.list_kinds(model, bl)]

    def is_modulation(self, relative_name: str) -> bool:
        """True for a modulation/adaLN Linear (named relative to its block)."""
        return any(re.search(p, relative_name) for p in self.modulation)

    def keeps_compute_dtype(self, relative_name: str, fp8_modulation: bool = False) -> bool:
        """True if a Linear inside a block (named relative to the block) must not be stored in fp8;
        with `fp8_modulation`, the modulation Linears may be."""
        if fp8_modulation and self.is_modulation(relative_name):
            return False
        return any(re.search(p, relative_name) for p in self.fp8_skip)

    def lora_target_regex(self, preset: str, blocks: dict[str, list[int]] | None = None) -> str:
        """A peft `target_modules` regex (full-match on qualified names) for a preset.

        `blocks` optionally restricts targets to some block indices per block-list kind, e.g.
        {"double": [0, 1], "single": []}; kinds absent from it are not restricted.
        """
        top = preset == ALL_LINEAR
        if top:
            preset = "all"
        if preset not in self.lora_presets:
            choices = sorted(self.lora_presets) + ([ALL_LINEAR] if "all" in self.lora_presets else [])
            raise KeyError(f"unknown LoRA target preset {preset!r}; choose one of {choices}")
        modules = "|".join(self.lora_presets[preset])
        alternatives = []
        for bl in self.block_lists:
            if blocks is not None and bl.kind in blocks:
                idx = blocks[bl.kind]
                if not idx:
                    continue
                index_re = "(" + "|".join(str(i) for i in sorted(set(idx))) + ")"
            else:
                index_re = r"\d+"
            alternatives.append(rf"{re.escape(bl.attr)}\.{index_re}\.({modules})")
        if top:
            # Every module under a non-block child; callers keep the Linears among them.
            alternatives.append(rf"({'|'.join(re.escape(n) for n in self.non_block_modules)})(\..+)?")
        if not alternatives:
            raise ValueError("the LoRA block selection leaves no block to train")
        return "^(" + "|".join(alternatives) + ")$"
