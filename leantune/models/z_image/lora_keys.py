"""Z-Image LoRA names: diffusers' ZImageTransformer2DModel <-> the original checkpoint's (kohya-style
`lora_unet_` files, ComfyUI).

The native names are the original single file's (z_image/keys.py): a block's q, k and v are one
`attention.qkv` Linear (diffusers' three `attention.to_q/to_k/to_v`, fused and split as for
Flux.1's qkv), its output `attention.out` (diffusers' `attention.to_out.0`); the MLP
(`feed_forward.w1/w2/w3`) and the block's adaLN Linear (`adaLN_modulation.0`; the context
refiner has none) are named alike in both. At the top, `x_embedder` and `final_layer.*` are
diffusers' `all_x_embedder.2-1` and `all_final_layer.2-1.*`; `t_embedder.mlp.*` and
`cap_embedder.1` are the same in both. No Linear swaps its output halves: Z-Image's final layer
has a scale only.

ComfyUI loads a `lora_unet_<native>` file through its generic key map and a diffusers one
(`transformer.<diffusers>`) through its Lumina2 (Z-Image) branch (`comfy.utils.z_image_to_diffusers`),
so both of leantune's layouts load whole there (tests/comfyui_keymap.py).

musubi-tuner trains a model with diffusers' module names and writes kohya names of them
(`lora_unet_layers_0_attention_to_q`): those are not native names, so `leantune convert` reads
them as LyCORIS-style diffusers paths (train/lora_convert.py).
"""

from __future__ import annotations

from ..lora_keymap import LoraKeyMap

_ATTN = {
    "attention.qkv": (("attention.to_q", "attention.to_k", "attention.to_v"), (1, 1, 1)),
    "attention.out": (("attention.to_out.0",), (1,)),
}
_MLP = {f"feed_forward.{w}": ((f"feed_forward.{w}",), (1,)) for w in ("w1", "w2", "w3")}
_MODULATED = {**_ATTN, **_MLP, "adaLN_modulation.0": (("adaLN_modulation.0",), (1,))}
_PLAIN = {**_ATTN, **_MLP}           # the context refiner: no adaLN

_TOP = {
    "x_embedder": "all_x_embedder.2-1",
    "final_layer.linear": "all_final_layer.2-1.linear",
    "final_layer.adaLN_modulation.1": "all_final_layer.2-1.adaLN_modulation.1",
    "t_embedder.mlp.0": "t_embedder.mlp.0",
    "t_embedder.mlp.2": "t_embedder.mlp.2",
    "cap_embedder.1": "cap_embedder.1",
}

Z_IMAGE_LORA_KEYS = LoraKeyMap(
    family="z-image", display="Z-Image",
    block_lists=(("noise_refiner", "noise_refiner", _MODULATED),
                 ("context_refiner", "context_refiner", _PLAIN),
                 ("layers", "layers", _MODULATED)),
    top=_TOP,
    swaps={},
    # kohya-style notes: musubi-tuner's Z-Image network module and full architecture name
    header={"ss_network_module": "networks.lora_zimage", "ss_base_model_version": "z_image"},
    header_hints=("zimage", "z_image", "z-image", "z image"),
    # Z-Image's released width (Turbo and base): no other family has it
    widths=(3840,),
)
