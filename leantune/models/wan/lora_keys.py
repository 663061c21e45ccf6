"""Wan LoRA names: diffusers' WanTransformer3DModel <-> Wan-AI's native checkpoint names (the
kohya-style `lora_unet_blocks_0_self_attn_q` files of musubi-tuner and ComfyUI, and the
`diffusion_model.blocks.0.self_attn.q.lora_A.weight` files musubi-tuner, diffusion-pipe and
ComfyUI's own trainer write).

Every native Linear is one diffusers Linear (wan/keys.py: renames only), so no LoRA is fused or
split and no output half swaps: a block's `self_attn.q/k/v/o` and `cross_attn.q/k/v/o` are
`attn1.*` / `attn2.*` (`to_q to_k to_v to_out.0`), Wan 2.1 I2V's `cross_attn.k_img / v_img` are
`attn2.add_k_proj / add_v_proj`, the MLP `ffn.0 / ffn.2` is `ffn.net.0.proj / ffn.net.2`. At the
top, the text and time embedders' Linears, `time_projection.1` and `head.head` (the condition
embedder's `text_embedder.linear_1/2`, `time_embedder.linear_1/2`, `time_proj`, and `proj_out`).
"""

from __future__ import annotations

from ..lora_keymap import LoraKeyMap

_ONE = (1,)
_BLOCK = {native: ((diffusers,), _ONE) for native, diffusers in (
    ("self_attn.q", "attn1.to_q"), ("self_attn.k", "attn1.to_k"), ("self_attn.v", "attn1.to_v"),
    ("self_attn.o", "attn1.to_out.0"),
    ("cross_attn.q", "attn2.to_q"), ("cross_attn.k", "attn2.to_k"), ("cross_attn.v", "attn2.to_v"),
    ("cross_attn.o", "attn2.to_out.0"),
    ("cross_attn.k_img", "attn2.add_k_proj"), ("cross_attn.v_img", "attn2.add_v_proj"),
    ("ffn.0", "ffn.net.0.proj"), ("ffn.2", "ffn.net.2"),
)}

_TOP = {
    "text_embedding.0": "condition_embedder.text_embedder.linear_1",
    "text_embedding.2": "condition_embedder.text_embedder.linear_2",
    "time_embedding.0": "condition_embedder.time_embedder.linear_1",
    "time_embedding.2": "condition_embedder.time_embedder.linear_2",
    "time_projection.1": "condition_embedder.time_proj",
    "head.head": "proj_out",
    "img_emb.proj.1": "condition_embedder.image_embedder.ff.net.0.proj",
    "img_emb.proj.3": "condition_embedder.image_embedder.ff.net.2",
}

WAN_LORA_KEYS = LoraKeyMap(
    family="wan2.2", display="Wan",
    block_lists=(("blocks", "blocks", _BLOCK),),
    top=_TOP,
    swaps={},
    # kohya-style notes: musubi-tuner's Wan network module and architecture name
    header={"ss_network_module": "networks.lora_wan", "ss_base_model_version": "wan2.2"},
    header_hints=("wan",),
    # the released widths: Wan 2.1 1.3B, Wan 2.2 TI2V-5B, the 14B experts
    widths=(1536, 3072, 5120),
)
