"""Flux LoRA names: diffusers' FluxTransformer2DModel <-> BFL's reference model (kohya, ComfyUI).

A double block has one `img_attn.qkv` and one `txt_attn.qkv` where diffusers has three Linears
each; a single block's `linear1` computes q, k, v and the MLP input (4x the attention width) at
once. The final layer's adaLN emits (shift, scale) in BFL and (scale, shift) in diffusers.
"""

from __future__ import annotations

from ..lora_keymap import ALWAYS, LoraKeyMap

_DOUBLE = {
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
_SINGLE = {
    "linear1": (("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp"), (1, 1, 1, 4)),
    "linear2": (("proj_out",), (1,)),
    "modulation.lin": (("norm.linear",), (1,)),
}
# Top-level Linears (embedders and final layer): never targeted by our presets, but other tools
# train them, so files that carry them must be read.
_TOP = {
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

FLUX_LORA_KEYS = LoraKeyMap(
    family="flux", display="Flux",
    block_lists=(("transformer_blocks", "double_blocks", _DOUBLE),
                 ("single_transformer_blocks", "single_blocks", _SINGLE)),
    top=_TOP,
    swaps={"final_layer.adaLN_modulation.1": ALWAYS},
    header={"ss_network_module": "networks.lora_flux", "ss_base_model_version": "flux1"},
    header_hints=("flux",),
    widths=(3072,),          # Flux.1 dev / schnell
    # (outputs, inputs) where FLUX.2 has other proportions under the same names (flux2/lora_keys.py)
    ratios={"linear1": (7, 1), "linear2": (1, 5), "img_mlp.0": (4, 1), "img_mlp.2": (1, 4),
            "txt_mlp.0": (4, 1), "txt_mlp.2": (1, 4)},
)
