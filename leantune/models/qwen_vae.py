"""The Qwen-Image VAE (AutoencoderKLQwenImage) seen as an image VAE with normalised 4-D latents.

Qwen-Image and Krea 2 both use it. AutoencoderKLQwenImage is a video VAE (B, C, T, H, W) with a
per-channel latent mean and std. Both pipelines decode `z / (1 / std) + mean` and drop the frame
axis; training latents are the encoder's mode normalised the inverse way, ((mode - mean) / std), so a
trained model's outputs decode as the pipelines decode them. The wrapper's config says scaling 1,
shift 0, so the shared code's own latent scaling is the identity. A shared part of models/: family
folders do not import each other.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn


class QwenVAE(nn.Module):
    def __init__(self, vae: nn.Module):
        super().__init__()
        self.vae = vae
        self.config = SimpleNamespace(scaling_factor=1.0, shift_factor=0.0, z_dim=vae.config.z_dim,
                                      latents_mean=list(vae.config.latents_mean),
                                      latents_std=list(vae.config.latents_std),
                                      # the decoder's widths per stage, for the decode planner's
                                      # activation estimate (infer/decode.py), as AutoencoderKL names them
                                      block_out_channels=[vae.config.base_dim * m for m in vae.config.dim_mult])

    @property
    def device(self) -> torch.device:
        return next(self.vae.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.vae.parameters()).dtype

    def _stats(self, like: torch.Tensor):
        shape = (1, self.config.z_dim, 1, 1, 1)
        mean = torch.tensor(self.config.latents_mean).view(shape).to(like.device, like.dtype)
        std = torch.tensor(self.config.latents_std).view(shape).to(like.device, like.dtype)
        return mean, std

    def encode(self, x: torch.Tensor):
        """(B, 3, H, W) in [-1, 1] -> .latent_dist.mean: normalised latents (B, 16, H/8, W/8)."""
        mode = self.vae.encode(x.unsqueeze(2)).latent_dist.mode()             # (B, 16, 1, h, w)
        m, s = self._stats(mode)
        return SimpleNamespace(latent_dist=SimpleNamespace(mean=((mode - m) / s)[:, :, 0]))

    def decode(self, z: torch.Tensor, return_dict: bool = False):
        """Normalised latents (B, 16, h, w) -> ((B, 3, H, W) in [-1, 1],), as the pipelines decode them."""
        z = z.unsqueeze(2)                                                     # (B, 16, 1, h, w)
        m, s = self._stats(z)
        return (self.vae.decode(z / (1.0 / s) + m, return_dict=False)[0][:, :, 0],)

    def tiled_decode(self, z: torch.Tensor, return_dict: bool = False):
        self.vae.enable_tiling()
        try:
            return self.decode(z)
        finally:
            self.vae.disable_tiling()
