"""Qwen-Image-2.1's reference images at sampling, prepared as QwenImage21Pipeline prepares them.

The pipeline (diffusers 0.42.1, `__call__` step 1) turns every reference to RGBA, resizes it to
`output_resolution`² pixels at its own aspect, both sides multiples of 32 (`calculate_dimensions`),
and feeds that one resized image to both the text encoder (which composites the alpha over white,
text.flatten_alpha) and the VAE (all four channels, normalized latents). The target's size, unless
given, is the same rule applied to the last reference's aspect.
"""

from __future__ import annotations

import math

import torch

from . import latents as lat

DEFAULT_RESOLUTION = 1024
# Text rows a reference's tags take beside its slots: `<imageN><|vision_start|>` ... `<|vision_end|>`
# and the space after (the planner prices them, text_phase.py and probe_inputs)
TAG_ROWS = 8


def dimensions(area: int, ratio: float) -> tuple[int, int]:
    """(width, height) of about `area` pixels at aspect `ratio` (width / height), multiples of 32."""
    width = math.sqrt(area * ratio)
    height = width / ratio
    return int(round(width / 32) * 32), int(round(height / 32) * 32)


def _vae_image_processor():
    from diffusers.image_processor import VaeImageProcessor

    return VaeImageProcessor(vae_scale_factor=lat.VAE_SCALE_FACTOR, vae_latent_channels=lat.LATENT_CHANNELS)


def prepare(images, resolution: int = DEFAULT_RESOLUTION):
    """(resized RGBA PIL images for the text encoder, their pixels (1, 4, H, W) in [-1, 1])."""
    from PIL import Image

    proc = _vae_image_processor()
    resized, pixels = [], []
    for img in images:
        if not isinstance(img, Image.Image):
            img = Image.fromarray(img)
        if img.mode != "RGBA":
            img = img.convert("RGBA")
        w, h = dimensions(resolution * resolution, img.size[0] / img.size[1])
        resized.append(proc.resize(img, width=w, height=h))
        pixels.append(proc.preprocess(img, width=w, height=h))
    return resized, pixels


@torch.no_grad()
def sampling_latents(vae, images, resolution: int = DEFAULT_RESOLUTION) -> list[torch.Tensor]:
    """Each reference's normalized latents (1, 64, h, w), as the pipeline encodes it."""
    _, pixels = prepare(images, resolution)
    p = next(vae.parameters())
    return [lat.encode(vae, x.to(device=p.device, dtype=p.dtype)) for x in pixels]


def target_size(images, resolution: int = DEFAULT_RESOLUTION) -> tuple[int, int]:
    """(width, height) the pipeline samples at when none is given: the last reference's aspect, or
    the square `resolution` without references."""
    if not images:
        return resolution, resolution
    w, h = images[-1].size
    return dimensions(resolution * resolution, w / h)
