"""SD3.5 LoRA names: diffusers' SD3Transformer2DModel <-> Stability's MMDiT (kohya, ComfyUI).

kohya sd-scripts (networks/lora_sd3.py) wraps the Linears of Stability's `SingleDiTBlock`s and names
them by their path in the MMDiT with dots as underscores: `lora_unet_joint_blocks_3_x_block_attn_qkv`,
`..._context_block_mlp_fc1`, `..._x_block_adaLN_modulation_1`, Medium's `..._x_block_attn2_qkv`;
with `emb_dims` also the embedders and final layer (`lora_unet_context_embedder`,
`lora_unet_t_embedder_mlp_0`, `lora_unet_final_layer_linear` ...). ComfyUI reads the same names.
Each stream's q, k and v are one `attn.qkv` there and three Linears in diffusers.

Two modulation Linears emit (shift, scale) natively and (scale, shift) in diffusers (as in
models/sd3/keys.py, which maps whole checkpoints): the final layer's, and the text stream's adaLN
of the last joint block, which is "context pre-only" and emits just those two chunks (out = 2 *
in; every other block's emits six, in the same order in both layouts).

x_embedder.proj (diffusers pos_embed.proj) is a Conv2d: a LoRA on it is not read (an error names
the key), as leantune trains Linears only.
"""

from __future__ import annotations

from ..lora_keymap import ALWAYS, WHEN_TWO_CHUNKS, LoraKeyMap

_QKV = (1, 1, 1)
_JOINT = {
    "x_block.attn.qkv": (("attn.to_q", "attn.to_k", "attn.to_v"), _QKV),
    "x_block.attn.proj": (("attn.to_out.0",), (1,)),
    "x_block.attn2.qkv": (("attn2.to_q", "attn2.to_k", "attn2.to_v"), _QKV),     # MMDiT-X (Medium)
    "x_block.attn2.proj": (("attn2.to_out.0",), (1,)),
    "x_block.mlp.fc1": (("ff.net.0.proj",), (1,)),
    "x_block.mlp.fc2": (("ff.net.2",), (1,)),
    "x_block.adaLN_modulation.1": (("norm1.linear",), (1,)),
    "context_block.attn.qkv": (("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"), _QKV),
    "context_block.attn.proj": (("attn.to_add_out",), (1,)),
    "context_block.mlp.fc1": (("ff_context.net.0.proj",), (1,)),
    "context_block.mlp.fc2": (("ff_context.net.2",), (1,)),
    "context_block.adaLN_modulation.1": (("norm1_context.linear",), (1,)),
}
_TOP = {
    "context_embedder": "context_embedder",
    "t_embedder.mlp.0": "time_text_embed.timestep_embedder.linear_1",
    "t_embedder.mlp.2": "time_text_embed.timestep_embedder.linear_2",
    "y_embedder.mlp.0": "time_text_embed.text_embedder.linear_1",
    "y_embedder.mlp.2": "time_text_embed.text_embedder.linear_2",
    "final_layer.linear": "proj_out",
    "final_layer.adaLN_modulation.1": "norm_out.linear",
}

SD3_LORA_KEYS = LoraKeyMap(
    family="sd3", display="SD3.5",
    block_lists=(("transformer_blocks", "joint_blocks", _JOINT),),
    top=_TOP,
    swaps={"final_layer.adaLN_modulation.1": ALWAYS, "context_block.adaLN_modulation.1": WHEN_TWO_CHUNKS},
    header={"ss_network_module": "networks.lora_sd3", "ss_base_model_version": "sd3"},
    header_hints=("sd3", "stable-diffusion-3", "stable-diffusion-v3"),
    widths=(2432, 1536),     # SD3.5 Large (38 heads of 64); SD3 / SD3.5 Medium (24 heads)
)
