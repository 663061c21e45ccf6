"""Wan image-to-video: a video's first frame as the transformer's condition, exactly as
WanImageToVideoPipeline (diffusers) builds it.

An image-to-video transformer (Wan 2.2 I2V-A14B's two experts, boundary_ratio 0.9; Wan 2.1 I2V's
one) takes 2 * 16 + 4 = 36 input channels: the noisy latents (16), then a condition of 20 channels
the pipeline's `prepare_latents` builds once per video and concatenates at every denoising step
(`torch.cat([latents, condition], dim=1)`):

- a mask (4 channels): 1 on the pixel frames that are given (the first), 0 on the rest, per pixel
  frame, with the first frame repeated 4 times so that the 1 + 4k pixel frames make (k + 1) groups
  of 4, each group one latent frame's 4 channels: (B, 1, 1 + 4k, h, w) -> (B, 4, k + 1, h, w);
- the VAE latents (16 channels) of the video [first frame, zeros...] of the sample's length,
  normalised as the training latents are ((mode - mean) * (1 / std)): the causal VAE sees the
  first frame and then black frames, and its latents of those later frames are not zeros.

leantune feeds it through the reference seam (ModelFamily.references, docs/reference-images.md):
the condition is the one "reference" of a sample, and the family's `predict` concatenates it
after the noisy latents (`with_condition`), so the sampler and the trainer need nothing of their
own. Sampling builds it from the first-frame image at the sample's size and length
(`sampling_condition`: the pipeline's own image preprocessing, a resize to the sample's size);
the caching phase builds it per clip from the clip's own first frame at the clip's bucket
(`clip_condition`) and stores it as the clip's reference entry, keyed apart from a clip's latents.

Which models take it: the transformer config's in_channels (2 * out_channels + 4), or the folder's
model_index.json naming WanImageToVideoPipeline (wan/loading.takes_first_frame). Wan 2.1 I2V also feeds a
CLIP image embedding to its cross-attention (`image_dim`, the pipeline's image_encoder); that model
has the same first-frame condition but its image encoder is not loaded here, so it is refused by
name (wan/loading.check_text_to_video). Wan 2.2 TI2V-5B's first-frame path (expand_timesteps: the
first latent frame replaced, per-token timesteps) is another mechanism, refused with that model.
"""

from __future__ import annotations

from pathlib import Path

import torch

I2V_PIPELINE = "WanImageToVideoPipeline"
TEMPORAL_FACTOR = 4          # the VAE's frames per latent frame after the first: the mask's channels


def is_image_to_video(config) -> bool:
    """Whether a transformer config is an image-to-video one: the noisy latents, their condition's
    latents and the 4 mask channels in (2 * out_channels + 4 = 36 for Wan's 16)."""
    get = config.get if isinstance(config, dict) else lambda k, d=None: getattr(config, k, d)
    out = get("out_channels") or 16
    return get("in_channels") == 2 * out + TEMPORAL_FACTOR


# -- the condition --------------------------------------------------------------------------------

def first_frame_mask(frames: int, latent_h: int, latent_w: int, batch: int = 1,
                     temporal: int = TEMPORAL_FACTOR) -> torch.Tensor:
    """(batch, 4, T', h, w) float32: WanImageToVideoPipeline.prepare_latents' mask for a video of
    `frames` pixel frames (1 + 4k) whose first frame is given, with its own steps."""
    mask = torch.ones(batch, 1, frames, latent_h, latent_w)
    mask[:, :, list(range(1, frames))] = 0
    first = torch.repeat_interleave(mask[:, :, 0:1], dim=2, repeats=temporal)
    mask = torch.concat([first, mask[:, :, 1:, :]], dim=2)
    mask = mask.view(batch, -1, temporal, latent_h, latent_w)          # (B, T', 4, h, w)
    return mask.transpose(1, 2)                                         # (B, 4, T', h, w)


def _normalise(vae, latents: torch.Tensor) -> torch.Tensor:
    """Raw posterior mode -> the pipeline's (x - mean) * (1 / std), in float32 as it computes it."""
    z = vae.config.z_dim
    latents = latents.to(torch.float32)
    mean = torch.tensor(vae.config.latents_mean).view(1, z, 1, 1, 1).to(latents.device, latents.dtype)
    inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, z, 1, 1, 1).to(latents.device, latents.dtype)
    return (latents - mean) * inv_std


@torch.no_grad()
def condition(vae, first: torch.Tensor, frames: int) -> torch.Tensor:
    """(1, 20, T', h, w) float32 on the host: the condition of a `frames`-frame video whose first
    frame is `first` ((1, 3, H, W) or (3, H, W) in [-1, 1]), as WanImageToVideoPipeline builds it:
    the mask, then the normalised latents of [first, zeros * (frames - 1)] through `vae` (the raw
    AutoencoderKLWan, or leantune's one-frame view of it, whose `.vae` it is), its posterior's mode.

    The VAE walks the video in its own causal chunks (AutoencoderKLWan._encode), so its activations
    are a chunk's; the pixel tensor itself is whole (as the pipeline's), mostly zeros."""
    vae = getattr(vae, "vae", vae)
    if frames < 1 or (frames - 1) % TEMPORAL_FACTOR:
        raise ValueError(f"{frames} frames is not a length the Wan VAE encodes (1 + 4k)")
    first = first if first.dim() == 4 else first[None]
    image = first.unsqueeze(2)                                          # (1, 3, 1, H, W)
    video = torch.cat([image, image.new_zeros(image.shape[0], image.shape[1], frames - 1, *image.shape[-2:])], dim=2)
    video = video.to(device=next(vae.parameters()).device, dtype=next(vae.parameters()).dtype)
    latents = _normalise(vae, vae.encode(video).latent_dist.mode())     # (1, 16, T', h, w)
    mask = first_frame_mask(frames, latents.shape[-2], latents.shape[-1], latents.shape[0])
    return torch.concat([mask.to(latents.device), latents], dim=1).to("cpu")


def preprocess(image, width: int, height: int) -> torch.Tensor:
    """A PIL image -> (1, 3, height, width) float32 in [-1, 1], as the pipeline's VideoProcessor
    preprocesses its `image` (a resize to the video's size, Lanczos, no crop)."""
    from diffusers.video_processor import VideoProcessor

    return VideoProcessor(vae_scale_factor=8).preprocess(image, height=height, width=width).to(torch.float32)


def sampling_condition(vae, images: list, *, width: int, height: int, frames: int) -> list[torch.Tensor]:
    """ReferenceConditioning.sampling_latents of an image-to-video model: [the (1, 20, T', h, w)
    condition] of the one first-frame image (PIL) for a sample of width x height x frames."""
    if len(images) != 1:
        raise ValueError(f"an image-to-video Wan is conditioned on one first-frame image, got {len(images)}")
    return [condition(vae, preprocess(images[0], width, height), frames)]


def clip_condition(vae, first: torch.Tensor, frames: int) -> torch.Tensor:
    """A clip's condition for the caching phase: (20, T', h, w) from its first frame (3, H, W) in
    [-1, 1] as the clip's entry decodes it, at the clip's frame bucket."""
    return condition(vae, first, frames)[0]


def with_condition(noisy: torch.Tensor, references, in_channels: int | None = None) -> torch.Tensor:
    """The transformer's input at a step: the noisy latents (B, 16, T', h, w) and the condition
    (1 or B, 20, T', h, w) concatenated on the channels, as the pipeline's denoising loop does
    (`torch.cat([latents, condition], dim=1)`), in the latents' dtype."""
    if references is None or len(references) == 0:
        if in_channels is not None and in_channels != noisy.shape[1]:
            raise ValueError(f"this Wan transformer is an image-to-video model ({in_channels} input channels): it "
                             f"needs a first-frame image (references); none was given")
        return noisy
    if len(references) != 1:
        raise ValueError(f"an image-to-video Wan takes one first-frame condition, got {len(references)}")
    cond = references[0].to(device=noisy.device, dtype=noisy.dtype)
    if cond.dim() == 4:                                                  # one frame: (B, 20, h, w)
        cond = cond.unsqueeze(2)
    if cond.shape[2:] != noisy.shape[2:]:
        raise ValueError(f"the first-frame condition is {tuple(cond.shape[2:])} (frames, h, w), the latents "
                         f"{tuple(noisy.shape[2:])}: build it at the sample's size and length")
    if in_channels is not None and noisy.shape[1] + cond.shape[1] != in_channels:
        raise ValueError(f"a first-frame condition of {cond.shape[1]} channels for a Wan transformer of "
                         f"{in_channels} input channels (a text-to-video model takes none)")
    if cond.shape[0] != noisy.shape[0]:
        cond = cond.expand(noisy.shape[0], *cond.shape[1:])
    return torch.cat([noisy, cond], dim=1)


__all__ = ["I2V_PIPELINE", "clip_condition", "condition", "first_frame_mask", "is_image_to_video",
           "sampling_condition", "with_condition"]
