"""Krea 2 LoRA names: diffusers' Krea2Transformer2DModel <-> the official krea-ai names (ComfyUI,
musubi-tuner's kohya-style `lora_unet_` files, ai-toolkit's `diffusion_model.` files).

ComfyUI's key map for a Krea2 model (comfy/lora.py `model_lora_keys_unet`) gives every weight of
its model, which carries the official names, `lora_unet_<name with _>` and `diffusion_model.<name>`,
and through comfy/utils.py `krea2_to_diffusers` the diffusers name of every Linear (blocks, text
fusion blocks, embedders, final linear) as `transformer.<name>`, `diffusion_model.<name>`,
`lycoris_<name_>` and the bare name. Nothing is fused: each native Linear is one diffusers Linear,
and no modulation Linear swaps halves (Krea 2's modulation tables are parameters, not Linears).

The text fusion's four blocks are not a block list of the spec (they run once on the text before
the 28 blocks); their Linears are named as top-level modules here, 2 layerwise and 2 refiner
blocks as the official model and ComfyUI's map fix them.

The names tell Krea 2 apart from every other family (`blocks.N.attn.wq`, `attn.to_gate`,
`ff.gate`, `text_fusion.*`); its 6144 width is FLUX.2-dev's too, so it claims no width.
"""

from __future__ import annotations

from ..lora_keymap import LoraKeyMap
from .keys import BLOCK_LINEARS, FUSION_KINDS, TOP_LINEARS

FUSION_BLOCKS = 2          # of each kind: fixed by the official model and ComfyUI's key map

_BLOCK = {native: ((diffusers,), (1,)) for native, diffusers in BLOCK_LINEARS}
_TOP = {native: diffusers for native, diffusers in TOP_LINEARS}
for _kind in FUSION_KINDS:
    for _i in range(FUSION_BLOCKS):
        for _native, _diffusers in BLOCK_LINEARS:
            _TOP[f"txtfusion.{_kind}.{_i}.{_native}"] = f"text_fusion.{_kind}.{_i}.{_diffusers}"

KREA2_LORA_KEYS = LoraKeyMap(
    family="krea2", display="Krea 2",
    block_lists=(("transformer_blocks", "blocks", _BLOCK),),
    top=_TOP,
    swaps={},
    header={"ss_network_module": "networks.lora_krea2", "ss_base_model_version": "krea2"},
    header_hints=("krea2", "krea-2", "krea_2", "krea 2"),
    widths=(),
)
