"""Stage 3 of sampling: latents -> pixels with the VAE, tiled when a whole image would not fit.

The Flux VAE is small (84 M parameters, 160 MB in bf16) but its decoder's activations are not: at
full resolution it holds a few tensors of 256 channels x H x W, about 2 GiB at 1024x1024 in bf16.
That is what breaks a 6 GB budget after the transformer has been sampled, so this stage

- decodes one image at a time (the batch never multiplies the activation peak), and
- when the estimated peak exceeds what the budget leaves, decodes overlapping latent tiles and
  blends the seams (diffusers' `AutoencoderKL.tiled_decode`, with the tile size chosen here from
  the budget instead of the checkpoint's fixed `sample_size`).

Tiling changes pixels slightly near tile seams (each tile sees only its own context in the
decoder's mid-block attention), so it is only used when needed or asked for.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Literal

import torch

# Pixels per latent of the VAE's own decoder (8 in every family's VAE: Flux.1's, SD3.5's, FLUX.2's, and
# Qwen-Image's spatially); a family's packing of latents into tokens comes after and is not seen here.
VAE_SCALE_FACTOR = 8

Tiling = Literal["auto", "on", "off"]

# Live activation tensors at the decoder's widest full-resolution stage, in units of
# (channels x H x W): input kept for the residual, norm output, activation output, conv output.
# Measured on the Flux VAE architecture with a storage tracker on CPU: 3.0-3.3; 4 leaves margin for
# convolution workspaces on GPU.
_ACTIVATION_FACTOR = 4.0
# Smallest tile (latent pixels) worth decoding: below this, seams dominate and time explodes.
MIN_TILE_LATENT = 16


@dataclass(frozen=True)
class DecodePlan:
    """How stage 3 runs: whole images or tiles of `tile_latent` latent pixels (`None`: untiled)."""

    tile_latent: int | None
    estimated_peak_bytes: int


def _widest_stage_elements(config, height: int, width: int) -> float:
    """Elements per channel-map at the decoder stage with the most (channels x pixels).

    Decoder stage k runs at 1/2**k of the output size with block_out_channels[k] channels, and
    receives the upsampled output of stage k+1 (block_out_channels[k+1] channels) at its own size.
    """
    ch = list(config.block_out_channels)
    best = 0.0
    for k in range(len(ch)):
        arriving = ch[k + 1] if k + 1 < len(ch) else ch[k]
        pixels = (height / 2**k) * (width / 2**k)
        best = max(best, max(ch[k], arriving) * pixels)
    return best


def estimate_decode_bytes(vae, height: int, width: int, dtype: torch.dtype | None = None,
                          tile_latent: int | None = None) -> int:
    """Predicted activation peak (bytes) of decoding one height x width image, weights excluded.

    Three terms: the widest decoder stage (of the whole image, or of one tile), the mid-block
    attention's score matrix (tokens^2; a fused GPU kernel does not materialise it, so this is
    conservative there), and the RGB output, which tiled decoding holds about three times (the
    decoded tiles, the blended rows, the result).
    """
    dtype = dtype or next(vae.parameters()).dtype
    elem = torch.finfo(dtype).bits // 8
    th, tw = height, width
    if tile_latent is not None:
        side = tile_latent * VAE_SCALE_FACTOR
        th, tw = min(height, side), min(width, side)
    stages = _ACTIVATION_FACTOR * _widest_stage_elements(vae.config, th, tw)
    tokens = (th // VAE_SCALE_FACTOR) * (tw // VAE_SCALE_FACTOR)
    output = 3 * height * width * (3 if tile_latent is not None else 1)
    return int((stages + tokens * tokens + output) * elem)


def vae_weight_bytes(vae) -> int:
    return sum(p.numel() * p.element_size() for p in vae.parameters())


def plan_decode(vae, height: int, width: int, tiling: Tiling = "auto", available_bytes: int | None = None,
                dtype: torch.dtype | None = None) -> DecodePlan:
    """Choose whole-image or tiled decoding.

    `available_bytes` is the memory the decode may use for activations (budget minus everything
    resident); `None` means unlimited. With tiling "auto" the largest tile that fits is chosen;
    "on" tiles even when the image would fit (at most half the latent side per tile).
    """
    if tiling not in ("auto", "on", "off"):
        raise ValueError(f"vae tiling must be 'auto', 'on' or 'off', got {tiling!r}")
    whole = estimate_decode_bytes(vae, height, width, dtype)
    h_lat, w_lat = height // VAE_SCALE_FACTOR, width // VAE_SCALE_FACTOR
    if tiling == "off" or (tiling == "auto" and (available_bytes is None or whole <= available_bytes)):
        return DecodePlan(None, whole)
    # A tile smaller than the image: half its longest side when forced on, else as large as fits.
    longest = max(h_lat, w_lat)
    cap = longest // 2 if tiling == "on" else longest - 8
    tile = max(MIN_TILE_LATENT, cap // 8 * 8)
    while tile > MIN_TILE_LATENT and available_bytes is not None and \
            estimate_decode_bytes(vae, height, width, dtype, tile) > available_bytes:
        tile -= 8
    if tile >= longest:         # an image no larger than the smallest tile: tiling would change nothing
        return DecodePlan(None, whole)
    return DecodePlan(tile, estimate_decode_bytes(vae, height, width, dtype, tile))


@contextmanager
def _tile_size(vae, tile_latent: int):
    """Temporarily set the VAE's tile size (diffusers reads these attributes in tiled_decode)."""
    saved = (vae.tile_latent_min_size, vae.tile_sample_min_size)
    vae.tile_latent_min_size = tile_latent
    vae.tile_sample_min_size = tile_latent * VAE_SCALE_FACTOR
    try:
        yield
    finally:
        vae.tile_latent_min_size, vae.tile_sample_min_size = saved


@torch.no_grad()
def decode_latents(vae, latents: torch.Tensor, device, plan: DecodePlan | None = None) -> torch.Tensor:
    """Unpacked latents (B, 16, h, w) -> images (B, 3, 8h, 8w) float32 in [0, 1], on the CPU.

    The VAE must already be on `device`. Images are decoded one by one and moved to the host at
    once, so the device holds a single image's activations at a time.
    """
    dtype = next(vae.parameters()).dtype
    scaling, shift = vae.config.scaling_factor, vae.config.shift_factor or 0.0
    out = []
    for z in latents.split(1):
        z = (z.to(device=device, dtype=dtype) / scaling) + shift      # (1, 16, h, w)
        if plan is not None and plan.tile_latent is not None:
            with _tile_size(vae, plan.tile_latent):
                x = vae.tiled_decode(z, return_dict=False)[0]
        else:
            x = vae.decode(z, return_dict=False)[0]                   # (1, 3, H, W) in [-1, 1]
        if not bool(torch.isfinite(x).all()):
            # Clamping would turn NaN/inf into a black or white image that looks like a result.
            raise FloatingPointError(f"image {len(out) + 1} decoded to non-finite pixels (NaN or inf): the sampled "
                                     f"latents overflowed (a LoRA strength far from 1, or fp16 weights?); "
                                     f"no image was written")
        out.append((x / 2 + 0.5).clamp(0, 1).to("cpu", torch.float32))
    return torch.cat(out)


def to_pil(images: torch.Tensor) -> list:
    """(B, 3, H, W) float in [0, 1] -> PIL RGB images, rounded as diffusers rounds them."""
    from PIL import Image

    arr = (images.permute(0, 2, 3, 1).to(torch.float32) * 255).round().to(torch.uint8).numpy()
    return [Image.fromarray(a) for a in arr]
