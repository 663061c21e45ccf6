"""Stable Diffusion 3.5 (Large: 38 MMDiT joint blocks; Medium: MMDiT-X, dual attention in its first
blocks): the spec the engine, LoRA targeting and the planner read, and the transformer call.

We use diffusers' `SD3Transformer2DModel` as it is. What differs from Flux: one block list
(`transformer_blocks`, kohya prefix `joint_blocks`), latents enter unpacked (B, 16, h, w) (the
model patchifies them itself), the timestep is sigma * 1000 as StableDiffusion3Pipeline passes it,
there is no guidance input (SD3.5 uses real classifier-free guidance), and the text sequence is
CLIP-L + CLIP-G penultimate states (padded to the T5 width) followed by the T5 sequence, with the
two CLIP pooled outputs concatenated (B, 2048).

Not here yet: loading (diffusers folder and Stability single files), the three text encoders, the
family registration (`get_family("sd3")`), LoRA key maps, sampling with CFG.
"""

from __future__ import annotations

import torch

from .family import PromptEmbeds
from .spec import BlockList, ModelSpec

_ATTN = (r"attn\.to_q", r"attn\.to_k", r"attn\.to_v", r"attn\.to_out\.0",
         r"attn\.add_q_proj", r"attn\.add_k_proj", r"attn\.add_v_proj", r"attn\.to_add_out",
         # MMDiT-X (Medium): the second, image-only attention of the dual-attention blocks
         r"attn2\.to_q", r"attn2\.to_k", r"attn2\.to_v", r"attn2\.to_out\.0")
_MLP = (r"ff\.net\.0\.proj", r"ff\.net\.2", r"ff_context\.net\.0\.proj", r"ff_context\.net\.2")
_MODULATION = (r"norm1\.linear", r"norm1_context\.linear")

SD3_SPEC = ModelSpec(
    family="sd3",
    block_lists=(BlockList(attr="transformer_blocks", kind="joint", kohya_prefix="joint_blocks"),),
    fp8_skip=(r"(^|\.)norm1\.linear$", r"(^|\.)norm1_context\.linear$", r"(^|\.)norm"),
    non_block_modules=("pos_embed", "time_text_embed", "context_embedder", "norm_out", "proj_out"),
    lora_presets={
        "attention": _ATTN,
        "attention_mlp": _ATTN + _MLP,
        "all": _ATTN + _MLP + _MODULATION,
    },
    default_lora_preset="attention_mlp",
)

VAE_SCALE_FACTOR = 8
LATENT_CHANNELS = 16
TIMESTEP_SCALE = 1000.0     # StableDiffusion3Pipeline passes sigma * num_train_timesteps


def pack_latents(latents: torch.Tensor) -> torch.Tensor:
    """SD3 takes latents as they are (B, 16, h, w): its pos_embed patchifies them."""
    return latents


def unpack_latents(latents: torch.Tensor, h: int, w: int) -> torch.Tensor:
    return latents


def image_tokens(h: int, w: int) -> int:
    """Image tokens of an h x w latent: 2x2 patches."""
    return (h // 2) * (w // 2)


def predict(transformer, noisy: torch.Tensor, sigma: torch.Tensor, embeds: PromptEmbeds,
            latent_hw: tuple[int, int], guidance=None) -> torch.Tensor:
    """One transformer call: noisy latents (B, 16, h, w) at sigma (B,) -> velocity (B, 16, h, w).

    `guidance` is accepted for the family interface and ignored: SD3.5 has no guidance input.
    """
    dtype, device = noisy.dtype, noisy.device
    return transformer(
        hidden_states=noisy,
        encoder_hidden_states=embeds.t5.to(device=device, dtype=dtype),
        pooled_projections=embeds.pooled.to(device=device, dtype=dtype),
        timestep=sigma.to(device=device, dtype=dtype) * TIMESTEP_SCALE,
        return_dict=False,
    )[0]


def probe_inputs(config, batch: int, latent_hw: tuple[int, int], text_length: int, dtype: torch.dtype) -> dict:
    """Forward kwargs on the meta device for the planner's activation probe (same shapes as predict)."""
    def meta(*shape, dtype=dtype):
        return torch.empty(*shape, device="meta", dtype=dtype)

    return {"hidden_states": meta(batch, config.in_channels, *latent_hw),
            "encoder_hidden_states": meta(batch, text_length, config.joint_attention_dim),
            "pooled_projections": meta(batch, config.pooled_projection_dim), "timestep": meta(batch),
            "return_dict": False}
