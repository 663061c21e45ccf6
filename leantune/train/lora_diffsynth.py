"""DiffSynth-Studio's LoRA files: the keys its trainer writes, renamed to names lora_formats reads.

What DiffSynth-Studio writes was read in modelscope/DiffSynth-Studio (snapshot fed7b18f, 2026-08-20):

* diffsynth/diffusion/training_module.py, `DiffusionTrainingModule.add_lora_to_model`: peft's
  `inject_adapter_in_model` with `LoraConfig(r=rank, lora_alpha=rank)` on the pipeline's DiT (its
  own module classes); `switch_pipe_to_training_mode` passes no other alpha, so every file trains at
  alpha / r = 1.
* the same file's `export_trainable_state_dict` with diffsynth/diffusion/logger.py
  `ModelLogger.save_model`: the trainable parameters under peft's names, `<module>.lora_A.default.weight`
  (down, (r, in)) and `<module>.lora_B.default.weight` (up, (out, r)) — the adapter name between
  the role and `weight` —, the `--remove_prefix_in_ckpt` prefix (diffsynth/diffusion/parsers.py:
  "pipe.dit." by default) cut off; a safetensors file without alpha keys or adapter config.
* diffsynth/utils/lora/general.py, `GeneralLoRALoader.get_name_dict`, `convert_state_dict` and
  `fuse_lora_to_base_model` (what `pipe.load_lora` uses for these families): the adapter name is
  dropped, the delta is strength * up @ down; only a file that has a `<module>.alpha` key (not one
  DiffSynth wrote) is scaled by alpha / rank. leantune reads exactly that: alpha = rank (scale 1)
  without an alpha key, the file's alpha / rank with one.

The module names are those of DiffSynth's DiT classes:

* Qwen-Image-2.1 (diffsynth/models/qwen_image_21_dit.py, `QwenImage21DiT`, at later commits of
  the code index than that snapshot; trained by examples/qwen_image_21/model_training/train.py,
  whose lora/Qwen-Image-2.1.sh leaves `--lora_target_modules` empty: `auto_detect_lora_target_modules`
  then takes every Linear of the blocks at least 512 wide, attn.to_q / to_k / to_v / to_out.0 and
  img_mlp.proj / gate_layer / out), Qwen-Image (diffsynth/models/qwen_image_dit.py, `QwenImageDiT`)
  and FLUX.2 (diffsynth/models/flux2_dit.py): diffusers' own module paths (Qwen-Image-2.1's SwiGLU
  unfused, as in the official release; each DiT loads the diffusers transformer files), read as a
  diffusers-layout file;
* Wan (diffsynth/models/wan_video_dit.py, `WanModel`): Wan-AI's native names (`blocks.N.self_attn.q`,
  `ffn.0`, `head.head`, ...), which the Wan family's table reads;
* FLUX.1 (diffsynth/models/flux_dit.py, `FluxDiT`): names of its own, each a rename of one BFL
  Linear (diffsynth/utils/state_dict_converters/flux_dit.py, `FluxDiTStateDictConverter`, moves no
  row: the fused q / k / v and the single blocks' `to_qkv_mlp` keep BFL's order, the modulations
  too, and `final_norm_out` emits (shift, scale) as BFL's final layer does). `FLUX_BLOCKS` /
  `FLUX_TOP` give each its BFL name, which the Flux table fuses and splits; `x_embedder` and
  `context_embedder` are already diffusers' names of the same Linears and stay. (Its
  `--align_to_opensource_format` files are kohya's names, read as such.)

The Z-Image and Krea 2 DiTs have state-dict converters whose names are not mapped here: such a
file's first unmapped key is named in the error.
"""

from __future__ import annotations

import re
from typing import Callable

import torch

# peft's name of a LoRA matrix with its adapter name: `<stem>.lora_A.<adapter>.weight`
_PEFT_ADAPTER = re.compile(r"^(?P<stem>.+)\.lora_(?P<role>[AB])\.(?P<adapter>[^.]+)\.weight$")
_PLAIN = re.compile(r"^(?P<stem>.+)\.(?P<role>lora_A\.weight|lora_B\.weight|alpha)$")
# what `--remove_prefix_in_ckpt` cuts off by default, kept by a run that set another prefix
TRAINING_PREFIX = "pipe.dit."

# FluxDiT module names inside a block -> BFL's, per block list (DiffSynth's list name, BFL's)
FLUX_BLOCKS = {
    ("blocks", "double_blocks"): {
        "attn.a_to_qkv": "img_attn.qkv", "attn.b_to_qkv": "txt_attn.qkv",
        "attn.a_to_out": "img_attn.proj", "attn.b_to_out": "txt_attn.proj",
        "ff_a.0": "img_mlp.0", "ff_a.2": "img_mlp.2", "ff_b.0": "txt_mlp.0", "ff_b.2": "txt_mlp.2",
        "norm1_a.linear": "img_mod.lin", "norm1_b.linear": "txt_mod.lin",
    },
    ("single_blocks", "single_blocks"): {
        "to_qkv_mlp": "linear1", "proj_out": "linear2", "norm.linear": "modulation.lin",
    },
}
FLUX_TOP = {
    "time_embedder.timestep_embedder.0": "time_in.in_layer",
    "time_embedder.timestep_embedder.2": "time_in.out_layer",
    "guidance_embedder.timestep_embedder.0": "guidance_in.in_layer",
    "guidance_embedder.timestep_embedder.2": "guidance_in.out_layer",
    "pooled_text_embedder.0": "vector_in.in_layer",
    "pooled_text_embedder.2": "vector_in.out_layer",
    "final_norm_out.linear": "final_layer.adaLN_modulation.1",
    "final_proj_out": "final_layer.linear",
}
_FLUX_BLOCK = re.compile(r"^(blocks|single_blocks)\.(\d+)\.(.+)$")


def flux_native(stem: str) -> str | None:
    """BFL's name of a FluxDiT Linear ('blocks.0.attn.a_to_qkv' -> 'double_blocks.0.img_attn.qkv'),
    or None for a name that is not one of FluxDiT's own."""
    if stem in FLUX_TOP:
        return FLUX_TOP[stem]
    m = _FLUX_BLOCK.match(stem)
    if not m:
        return None
    listed, index, inner = m.groups()
    for (ours, bfl), table in FLUX_BLOCKS.items():
        if ours == listed and inner in table:
            return f"{bfl}.{int(index)}.{table[inner]}"
    return None


def _split(key: str) -> tuple[str, str] | None:
    """(stem, suffix as lora_formats reads it) of a LoRA key, the adapter name dropped; None: not one."""
    m = _PEFT_ADAPTER.match(key)
    if m and m["adapter"] != "weight":
        return m["stem"], f"lora_{m['role']}.weight"
    m = _PLAIN.match(key)
    return (m["stem"], m["role"]) if m else None


def is_diffsynth(keys) -> bool:
    """Whether a file's keys are DiffSynth-Studio's: peft names with the adapter name kept (no other
    tool leantune reads writes them), or FluxDiT's own module names."""
    for key in keys:
        if _PEFT_ADAPTER.match(key):
            return True
        split = _split(key)
        if split and flux_native(split[0].removeprefix(TRAINING_PREFIX)) is not None:
            return True
    return False


def readable(source: str, tensors: dict[str, torch.Tensor],
             known: Callable[[str], bool]) -> dict[str, torch.Tensor] | None:
    """The tensors of a DiffSynth-Studio LoRA under names lora_formats reads
    (`<module>.lora_A.weight`, FluxDiT's modules under BFL's names), or None when the file is not
    DiffSynth's. `known(stem)` says whether a module name is one the families in question have; a
    key naming none, or no LoRA tensor at all, is an error naming the file and that key."""
    from .lora_errors import LoraFormatError

    if not is_diffsynth(tensors):
        return None
    out: dict[str, torch.Tensor] = {}
    origin: dict[str, str] = {}
    for key in sorted(tensors):
        split = _split(key)
        if split is None:
            raise LoraFormatError(f"{source}: key {key!r} of this DiffSynth-Studio LoRA file is not a LoRA matrix "
                                  f"(<module>.lora_A.default.weight / lora_B) nor an alpha; a weight trained whole "
                                  f"beside the LoRA is not read as LoRA")
        stem, suffix = split
        stem = stem.removeprefix(TRAINING_PREFIX)
        stem = flux_native(stem) or stem
        if not known(stem):
            raise LoraFormatError(f"{source}: key {key!r}: DiffSynth-Studio module {stem!r} maps to no transformer "
                                  f"Linear leantune knows (its DiT names are read for Qwen-Image-2.1, Qwen-Image, "
                                  f"FLUX.1, FLUX.2 and Wan)")
        name = f"{stem}.{suffix}"
        if name in out:
            raise LoraFormatError(f"{source}: keys {origin[name]!r} and {key!r} give the same LoRA tensor (two "
                                  f"adapters of one module in one file)")
        out[name], origin[name] = tensors[key], key
    return out
