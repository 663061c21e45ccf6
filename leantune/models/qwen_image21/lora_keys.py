"""Qwen-Image-2.1 LoRA names: diffusers' QwenImage21Transformer2DModel <-> ComfyUI's model names
(the kohya-style `lora_unet_` files).

ComfyUI's repackaged Qwen-Image-2.1 (keys.py) names its weights as diffusers does but for one
fused Linear per block: the SwiGLU gate and up projections are `img_mlp.gate_up` (gate rows
first, then up: diffusers' `img_mlp.gate_layer` then `img_mlp.proj`, as
`convert_qwen_image21_transformer_checkpoint_to_diffusers` splits them). So the native names are
diffusers' own, `img_mlp.gate_up` fused from two equal parts; nothing swaps its halves (the final
`norm_out.linear` emits (scale, shift) in both, the same module). A kohya file's module is
`lora_unet_<native name with _>`, which ComfyUI's generic key map (`model_lora_keys_unet`: every
model weight W as `lora_unet_<W_>` and `diffusion_model.W`) loads whole.

ComfyUI's own code for this model could not be read here (its repository is not in the code
index and too large to fetch), so whatever diffusers-name branch its key map may have for this
class is unknown: tests/comfyui_keymap.py models the generic rule only, under which a
diffusers-layout file's `transformer.*` keys are not loaded (the conformance suite states it as a
finding).

The names tell Qwen-Image-2.1 apart from Qwen-Image (whose blocks have `add_q_proj`, `img_mod`,
`txt_mlp`): `img_mlp.gate_up` / `img_mlp.gate_layer`, `txt_in.in_layer`, `modulation.1`.
"""

from __future__ import annotations

from ..lora_keymap import LoraKeyMap

_BLOCK = {
    "attn.to_q": (("attn.to_q",), (1,)),
    "attn.to_k": (("attn.to_k",), (1,)),
    "attn.to_v": (("attn.to_v",), (1,)),
    "attn.to_out.0": (("attn.to_out.0",), (1,)),
    "img_mlp.gate_up": (("img_mlp.gate_layer", "img_mlp.proj"), (1, 1)),
    "img_mlp.out": (("img_mlp.out",), (1,)),
}
_TOP = {n: n for n in ("time_text_embed.timestep_embedder.linear_1", "time_text_embed.timestep_embedder.linear_2",
                       "txt_in.in_layer", "txt_in.out_layer", "img_in", "modulation.1", "norm_out.linear",
                       "proj_out")}

QWEN_IMAGE21_LORA_KEYS = LoraKeyMap(
    family="qwen-image-2.1", display="Qwen-Image-2.1",
    block_lists=(("transformer_blocks", "transformer_blocks", _BLOCK),),
    top=_TOP,
    swaps={},
    header={"ss_network_module": "networks.lora_qwen_image21", "ss_base_model_version": "qwen_image_2_1"},
    # (a prefix of "qwen_image_2" alone would claim a "qwen_image_20b" note of Qwen-Image)
    header_hints=("qwen_image_2_1", "qwen_image_2.1", "qwen-image-2.1", "qwen-image-2_1", "qwen_image21", "qwen-image21"),
    # 4096 wide (32 heads of 128): the width alone tells an attention-only file from Qwen-Image's 3072
    widths=(4096,),
)
