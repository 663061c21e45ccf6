"""Qwen-Image-2.1's latents: 64 channels at 1/16 of the pixels, RGBA in and out, unpatched tokens.

As QwenImage21Pipeline (diffusers 0.42.1) does: the VAE (AutoencoderKLQwenImage21, a video VAE
read one frame at a time) encodes (B, 4, 1, H, W) in [-1, 1] to a distribution whose mode is
taken, normalized per channel by the config's `latents_mean` / `latents_std`; the transformer reads
one token per latent pixel (`patch_size` 1: packing is a plain flatten, `_pack_latents`), and one
vision-encoder slot stands for a 2x2 group of them (`slots`).
"""

from __future__ import annotations

import torch

LATENT_CHANNELS = 64
VAE_SCALE_FACTOR = 16


def pack_latents(latents: torch.Tensor) -> torch.Tensor:
    """(B, C, h, w) -> (B, h * w, C), as QwenImage21Pipeline._pack_latents."""
    b, c, h, w = latents.shape
    return latents.reshape(b, c, h * w).transpose(1, 2)


def unpack_latents(packed: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """(B, h * w, C) -> (B, C, h, w)."""
    b, _, c = packed.shape
    return packed.transpose(1, 2).reshape(b, c, h, w)


def image_tokens(h: int, w: int) -> int:
    return h * w


def slots(h: int, w: int) -> int:
    """The vision-encoder slots (2x2 token groups) of an h x w latent image."""
    return (h // 2) * (w // 2)


def _stats(vae, like: torch.Tensor):
    shape = (1, vae.config.z_dim, 1, 1)
    mean = torch.tensor(vae.config.latents_mean).view(shape).to(like.device, like.dtype)
    std = torch.tensor(vae.config.latents_std).view(shape).to(like.device, like.dtype)
    return mean, std


def encode(vae, pixels: torch.Tensor) -> torch.Tensor:
    """(B, 4, H, W) RGBA in [-1, 1] -> normalized latents (B, 64, H/16, W/16) (the mode, as the
    pipeline encodes references)."""
    if pixels.shape[1] != vae.config.in_channels:
        raise ValueError(f"the Qwen-Image-2.1 VAE reads {vae.config.in_channels} channels (RGBA), got "
                         f"{pixels.shape[1]}")
    z = vae.encode(pixels.unsqueeze(2)).latent_dist.mode()[:, :, 0]
    mean, std = _stats(vae, z)
    return (z - mean) / std


def decode(vae, latents: torch.Tensor) -> torch.Tensor:
    """Normalized latents (B, 64, h, w) -> RGBA (B, 4, 16h, 16w) in about [-1, 1]."""
    mean, std = _stats(vae, latents)
    return vae.decode((latents * std + mean).unsqueeze(2), return_dict=False)[0][:, :, 0]
