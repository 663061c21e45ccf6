"""The Qwen-Image-2.1 VAE seen as the image VAE the shared code (cache, decode) expects.

AutoencoderKLQwenImage21 is a video VAE over RGBA: (B, 4, 1, H, W) in, 64 channels at 1/16 out,
normalised per channel by its latents_mean / latents_std (latents.py). The wrapper's `encode`
takes what the cache hands every family, (B, 3, H, W) RGB in [-1, 1], and adds an opaque alpha
(1.0: alpha 255 normalised), which is what QwenImage21Pipeline does to an RGB image
(`img.convert("RGBA")`) before its VAE; a (B, 4, H, W) RGBA input keeps its own alpha. `decode`
gives the four channels back, as the pipeline's output does (its images are RGBA). The config says
scaling 1, shift 0, so the shared code's own latent scaling is the identity.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn

from . import latents as lat


class QwenImage21VAE(nn.Module):
    def __init__(self, vae: nn.Module):
        super().__init__()
        self.vae = vae
        c = vae.config
        self.config = SimpleNamespace(scaling_factor=1.0, shift_factor=0.0, z_dim=c.z_dim,
                                      latents_mean=list(c.latents_mean), latents_std=list(c.latents_std),
                                      # the decoder's widths per stage, for the decode planner's estimate
                                      block_out_channels=[c.decoder_base_dim * m for m in c.dim_mult])

    @property
    def device(self) -> torch.device:
        return next(self.vae.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.vae.parameters()).dtype

    def encode(self, x: torch.Tensor):
        """(B, 3 or 4, H, W) in [-1, 1] -> .latent_dist.mean: normalised latents (B, 64, H/16, W/16)."""
        if x.shape[1] == 3:
            x = torch.cat([x, x.new_ones(x.shape[0], 1, *x.shape[2:])], dim=1)
        return SimpleNamespace(latent_dist=SimpleNamespace(mean=lat.encode(self.vae, x)))

    def decode(self, z: torch.Tensor, return_dict: bool = False):
        """Normalised latents (B, 64, h, w) -> ((B, 4, 16h, 16w) RGBA in about [-1, 1],)."""
        return (lat.decode(self.vae, z),)

    def tiled_decode(self, z: torch.Tensor, return_dict: bool = False):
        self.vae.enable_tiling()
        try:
            return self.decode(z)
        finally:
            self.vae.disable_tiling()
