"""FLUX.2 LoRA names: diffusers' Flux2Transformer2DModel <-> BFL's reference model (kohya /
musubi-tuner, ComfyUI, ai-toolkit's `diffusion_model.` files).

The native names are Flux.1's (`double_blocks.N.img_attn.qkv`, `single_blocks.N.linear1`), but the
modules behind them are not: a double block's `img_attn.qkv` / `txt_attn.qkv` is diffusers' three
q, k, v Linears (fused and split as for Flux.1); a single block's `linear1` and `linear2` are ONE
diffusers Linear each (`attn.to_qkv_mlp_proj`, `attn.to_out`: diffusers keeps them fused, so no
split); the MLPs are SwiGLU (`img_mlp.0` -> `ff.linear_in`, 2 x 3 x width rows); the adaLN
modulation is three shared top-level Linears (`double_stream_modulation_img.lin`, ...) instead of
one per block. The final layer's adaLN emits (shift, scale) in BFL and (scale, shift) in diffusers:
its LoRA's up matrix swaps halves between the layouts, as Flux.1's does.

Because the names are Flux.1's, a file's names alone often fit both families; the shapes tell them
apart (`ratios`: a FLUX.2 single block's linear1 has 9x as many outputs as inputs, Flux.1's 7x),
and so does a header naming FLUX.2. FLUX.2 klein 4B is 3072 wide like Flux.1, so the width decides
nothing there.
"""

from __future__ import annotations

from ..lora_keymap import ALWAYS, LoraKeyMap

_DOUBLE = {
    "img_attn.qkv": (("attn.to_q", "attn.to_k", "attn.to_v"), (1, 1, 1)),
    "txt_attn.qkv": (("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"), (1, 1, 1)),
    "img_attn.proj": (("attn.to_out.0",), (1,)),
    "txt_attn.proj": (("attn.to_add_out",), (1,)),
    "img_mlp.0": (("ff.linear_in",), (1,)),
    "img_mlp.2": (("ff.linear_out",), (1,)),
    "txt_mlp.0": (("ff_context.linear_in",), (1,)),
    "txt_mlp.2": (("ff_context.linear_out",), (1,)),
}
_SINGLE = {
    "linear1": (("attn.to_qkv_mlp_proj",), (1,)),
    "linear2": (("attn.to_out",), (1,)),
}
# Top-level Linears: never targeted by the presets, but other tools train them (ai-toolkit's
# modulation and embedder LoRAs), so files that carry them must be read.
_TOP = {
    "img_in": "x_embedder",
    "txt_in": "context_embedder",
    "time_in.in_layer": "time_guidance_embed.timestep_embedder.linear_1",
    "time_in.out_layer": "time_guidance_embed.timestep_embedder.linear_2",
    "guidance_in.in_layer": "time_guidance_embed.guidance_embedder.linear_1",
    "guidance_in.out_layer": "time_guidance_embed.guidance_embedder.linear_2",
    "double_stream_modulation_img.lin": "double_stream_modulation_img.linear",
    "double_stream_modulation_txt.lin": "double_stream_modulation_txt.linear",
    "single_stream_modulation.lin": "single_stream_modulation.linear",
    "final_layer.linear": "proj_out",
    "final_layer.adaLN_modulation.1": "norm_out.linear",
}

# FLUX.2's own top-level diffusers names. ComfyUI's LoRA key map gives a Flux-class model (FLUX.2's
# Flux2 is one) diffusers names only from comfy.utils.flux_to_diffusers, which has Flux.1's top level
# (time_text_embed.*) and no shared modulation: it loads these modules from BFL names only
# (lora_unet_time_in_in_layer, diffusion_model.double_stream_modulation_img.lin, ...). diffusers in
# turn reads a file in one layout only (transformer.* names, or kohya's, or ai-toolkit's
# diffusion_model.*: a mixed file fails there), so no name in a diffusers-layout file loads them in
# both. (A whole file in ai-toolkit's BFL names loads in both, but diffusers' converter reads its
# final adaLN in diffusers' half order where ComfyUI reads BFL's: no layout is right in both.)
_COMFYUI_UNNAMED = ("time_guidance_embed.timestep_embedder.linear_1", "time_guidance_embed.timestep_embedder.linear_2",
                    "time_guidance_embed.guidance_embedder.linear_1", "time_guidance_embed.guidance_embedder.linear_2",
                    "double_stream_modulation_img.linear", "double_stream_modulation_txt.linear",
                    "single_stream_modulation.linear")

FLUX2_LORA_KEYS = LoraKeyMap(
    family="flux2", display="FLUX.2",
    block_lists=(("transformer_blocks", "double_blocks", _DOUBLE),
                 ("single_transformer_blocks", "single_blocks", _SINGLE)),
    top=_TOP,
    swaps={"final_layer.adaLN_modulation.1": ALWAYS},
    # kohya-style notes; musubi-tuner's FLUX.2 network module
    header={"ss_network_module": "networks.lora_flux_2", "ss_base_model_version": "flux2"},
    header_hints=("flux2", "flux.2", "flux-2", "flux_2"),
    # dev 6144, klein 9B 4096 (klein 4B's 3072 is Flux.1's too: it tells nothing apart)
    widths=(6144, 4096),
    # (outputs, inputs) of Linears whose proportions differ from Flux.1's under the same name:
    # SwiGLU MLPs 3x wide (linear_in emits gate and value), linear1 = q, k, v + 2 x 3x MLP input
    ratios={"linear1": (9, 1), "linear2": (1, 4), "img_mlp.0": (6, 1), "img_mlp.2": (1, 3),
            "txt_mlp.0": (6, 1), "txt_mlp.2": (1, 3)},
    comfyui_unnamed=_COMFYUI_UNNAMED,
)
