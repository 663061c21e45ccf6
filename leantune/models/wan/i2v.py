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
model_index.json naming WanImageToVideoPipeline (wan/loading.takes_first_frame). Wan 2.2 TI2V-5B's
first-frame path (expand_timesteps: the first latent frame replaced, per-token timesteps) is another
mechanism, refused with that model.

Wan 2.1 I2V reads the first frame a second time: its transformer has an image embedder (`image_dim`)
and image keys and values in every cross-attention (`add_k_proj / add_v_proj`), fed
`encoder_hidden_states_image`, which WanImageToVideoPipeline computes once per video as
`encode_image` does: the CLIPImageProcessor's pixels of the first-frame image (its own resize and
centre crop, not the video's size) through the CLIPVisionModel, whose penultimate hidden state
(`hidden_states[-2]`, 257 rows for ViT-H/14) it keeps (`image_embedding`). It is the second
reference, after the condition (ReferenceConditioning.frame_embedding): sampling embeds the
first-frame image, the caching phase each clip's own first frame, in an entry of its own. The
transformer splits its cross-attention's context as [image rows, text rows] by taking the last 512
rows as text (WanAttnProcessor), so a model with an image embedding needs the text at WanPipeline's
512 rows ([data] max_text_length): `image_states` refuses another length rather than let the
attention read text rows as image rows.
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


# -- Wan 2.1 I2V's image embedding ----------------------------------------------------------------------

TEXT_ROWS_WITH_IMAGE = 512   # WanAttnProcessor takes the last 512 context rows as text, the rest as image


@torch.no_grad()
def image_embedding(encoder, image) -> torch.Tensor:
    """(1, L, D) float32 on the host: WanImageToVideoPipeline.encode_image of one first frame, a PIL
    image or a (3, H, W) frame in [-1, 1] (a clip's, as its entry decodes it, made an 8-bit image
    again). `encoder`: wan/loading.WanImageEncoder (CLIPImageProcessor + CLIPVisionModel)."""
    if isinstance(image, torch.Tensor):
        from PIL import Image

        pixels = ((image.float() + 1.0) * 127.5).round().clamp(0, 255).to(torch.uint8)
        image = Image.fromarray(pixels.permute(1, 2, 0).numpy())
    inputs = encoder.processor(images=image, return_tensors="pt").to(encoder.device)
    states = encoder.model(**inputs, output_hidden_states=True).hidden_states[-2]
    return states.to("cpu", torch.float32)


def image_states(references, config, batch: int, text_rows: int, dtype: torch.dtype, device):
    """The transformer's `encoder_hidden_states_image`: the second reference (B or 1, L, D), broadcast
    over the batch, in the latents' dtype (as the pipeline casts it); None for a model without an
    image embedder. A model with one needs it and the text at 512 rows; one without refuses it."""
    get = config.get if isinstance(config, dict) else lambda k, d=None: getattr(config, k, d)
    wants = get("image_dim") is not None
    given = None if references is None or len(references) < 2 else references[1]
    if not wants:
        if given is not None:
            raise ValueError("an image embedding was given to a Wan transformer without an image embedder "
                             "(image_dim): only Wan 2.1 I2V reads one")
        return None
    if given is None:
        raise ValueError(f"this Wan transformer reads its first frame's CLIP image embedding (image_dim = "
                         f"{get('image_dim')}, Wan 2.1 I2V): references need [condition, image embedding]; none given")
    if text_rows != TEXT_ROWS_WITH_IMAGE:
        raise ValueError(f"a Wan transformer with an image embedding takes the text at {TEXT_ROWS_WITH_IMAGE} rows (its "
                         f"cross-attention takes the last {TEXT_ROWS_WITH_IMAGE} context rows as text), got {text_rows}: "
                         f"set [data] max_text_length = {TEXT_ROWS_WITH_IMAGE} (leantune sample: --set max_text_length=512, its default)")
    if given.dim() != 3 or given.shape[-1] != get("image_dim"):
        raise ValueError(f"the image embedding is {tuple(given.shape)}, the transformer's image embedder takes "
                         f"(B, L, {get('image_dim')})")
    given = given.to(device=device, dtype=dtype)
    return given if given.shape[0] == batch else given.expand(batch, *given.shape[1:])


__all__ = ["I2V_PIPELINE", "TEXT_ROWS_WITH_IMAGE", "clip_condition", "condition", "first_frame_mask",
           "image_embedding", "image_states", "is_image_to_video", "sampling_condition", "with_condition"]
