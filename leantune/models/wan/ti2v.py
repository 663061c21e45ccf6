"""Wan 2.2 TI2V-5B (family `wan2.2-ti2v`): one 5B WanTransformer3DModel over the Wan 2.2 VAE.

The transformer class, the umT5 text encoder, the single-file names and the LoRA names are the Wan
family's (wan/__init__.py, wan/loading.py, wan/keys.py); what differs is registered as a family of
its own because the seam's latent facts are per family:

- Latents: the Wan 2.2 AutoencoderKLWan (`is_residual`, a 2 x 2 patchify of the pixels before its
  encoder): 48 channels per 4 frames (the first frame alone) at 1/16 of the pixels, normalised per
  channel as WanPipeline does. The transformer patchifies (1, 2, 2) itself, so a 704 x 1280 frame is
  22 x 40 tokens. Clips are cached through the same chunked causal loop (data/video_vae.py
  patchifies each chunk as the VAE's `_encode` does) as (48, T', h/16, w/16), at 24 fps unless
  [data] target_fps says otherwise (data/cache.family_clip_rate), in buckets whose sides are
  multiples of 32 (`side_multiple`: latent sides the 2 x 2 patches divide).
- Time: WanPipeline(expand_timesteps=True), TI2V-5B's model_index.json setting, passes the
  timestep per token: (B, F * h/2 * w/2), each token's the step's t (its text-to-video path; for
  image-to-video the first latent frame's tokens take 0). The transformer then modulates
  every token by its own timestep projection (the blocks take its rows once per latent frame, or
  once for all tokens, the same values: wan/block.py). `predict` feeds it so, for training and sampling
  alike, so a LoRA trains on the inputs the pipeline samples with.
- Sampling: the released schedule (Wan-AI's wan_ti2v_5B.py: flow shift 5.0, 50 steps, guidance
  5.0), a folder's scheduler config first; classifier-free guidance, the halves one after the
  other, as for A14B. Videos are written at 24 fps (TI2V-5B's sample_fps).
- One transformer: no experts ([model] expert is refused for this family by the config).

- Image-to-video (`leantune sample --reference FIRST.png`): WanImageToVideoPipeline(expand_timesteps=
  True)'s path: the first frame alone through the VAE is the condition (1, 48, 1, h, w); at every
  step the first latent frame is replaced by it and its tokens take timestep 0, the rest are noised
  and denoised, and after the last step the first frame is the condition again (Sampling.finish).
- Image-to-video training ([model] image_to_video = true; clips train text-to-video without it):
  what DiffSynth-Studio's Wan training does for this model (its FlowMatchSFTLoss with
  `first_frame_latents`, the fused VAE embedding of TI2V-5B), which is the pipeline's i2v path
  above: each clip is noised, then its first latent frame is put back as its clean latent (the
  clip's own: the causal VAE encodes the first frame alone, so it is that frame's latent as the
  pipeline's condition is the image's), its tokens take timestep 0, and the loss is the mean over
  the other latent frames (trainer._first_frame_kept builds the condition and the loss weights;
  `predict` takes it as `references`). The previews start from [sample] references' one image
  (`sampling_condition` at the preview's size), as `leantune sample --reference` does.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from . import loading as wan_loading, text as wan_text
from .keys import input_channels, recognizes_keys
from .spec import WAN_SPEC
from ..qwen_vae import QwenVAE
from ..schedule import FlowSchedule
from ..weights import LoadError

NAME = "wan2.2-ti2v"
VAE_SCALE_FACTOR = 16         # the Wan 2.2 VAE's 2 x 2 patchify and its 8x encoder
LATENT_CHANNELS = wan_loading.TI2V_CHANNELS
TEMPORAL_FACTOR = 4
SAMPLE_FPS = 24.0             # TI2V-5B's rate (Wan-AI's sample_fps): clips train and videos are written at it
PATCH = 2
SPEC = replace(WAN_SPEC, family=NAME)


def token_timesteps(t: torch.Tensor, latents: torch.Tensor) -> torch.Tensor:
    """The per-token timestep WanPipeline(expand_timesteps=True) passes: t (B,) float32 -> (B, L),
    L = F * h/2 * w/2 tokens of the (B, C, F, h, w) latents, every token of a video at its t."""
    frames, h, w = latents.shape[2:]
    tokens = frames * (h // PATCH) * (w // PATCH)
    return t.to(torch.float32)[:, None].expand(-1, tokens)


def first_frame_mask(latents: torch.Tensor) -> torch.Tensor:
    """WanImageToVideoPipeline(expand_timesteps=True)'s first_frame_mask for (B, C, F, h, w) latents:
    (1, 1, F, h, w) float32, 0 on the first latent frame (kept as the clean condition), 1 elsewhere."""
    mask = torch.ones(1, 1, *latents.shape[2:], dtype=torch.float32, device=latents.device)
    mask[:, :, 0] = 0
    return mask


def _condition(references, latents: torch.Tensor) -> torch.Tensor:
    if len(references) != 1:
        raise ValueError(f"Wan 2.2 TI2V-5B's image-to-video takes one first-frame condition, got {len(references)}")
    cond = references[0].to(device=latents.device, dtype=torch.float32)
    if cond.dim() != 5 or cond.shape[1:3] != (LATENT_CHANNELS, 1) or cond.shape[3:] != latents.shape[3:]:
        raise ValueError(f"the first-frame condition is {tuple(cond.shape)}, not (1, {LATENT_CHANNELS}, 1, "
                         f"{latents.shape[3]}, {latents.shape[4]}): build it at the sample's size")
    return cond


def with_first_frame(latents: torch.Tensor, references) -> torch.Tensor:
    """The latents with their first frame replaced by the condition, in float32 and cast back, as
    the pipeline mixes them ((1 - mask) * condition + mask * latents) before each call and after
    its last step (Sampling.finish)."""
    mask = first_frame_mask(latents)
    mixed = (1 - mask) * _condition(references, latents) + mask * latents.to(torch.float32)
    return mixed.to(latents.dtype)


def predict(transformer, noisy: torch.Tensor, sigma: torch.Tensor, embeds, latent_hw: tuple[int, int],
            guidance=None, references=None) -> torch.Tensor:
    """One transformer call: noisy latents (B, 48, F, h, w) at sigma (B,) -> the flow velocity in the
    same layout, the timestep sigma * 1000 per token. `guidance` is ignored (no guidance input).
    `references`: image-to-video's first-frame condition [(1, 48, 1, h, w)], normalised latents of
    the first frame: the first latent frame is replaced by it and its tokens take timestep 0."""
    from . import model_time

    h, w = noisy.shape[-2:]
    if h % PATCH or w % PATCH:
        raise ValueError(f"Wan 2.2 TI2V-5B takes frames whose sides are multiples of {VAE_SCALE_FACTOR * PATCH} "
                         f"pixels (the VAE's 16x and the transformer's 2 x 2 patches), not latents of {h} x {w}")
    text = embeds.t5.to(device=noisy.device, dtype=noisy.dtype)
    t = model_time(sigma.to(noisy.device))
    if references:
        mask = first_frame_mask(noisy)
        hidden = with_first_frame(noisy, references)
        timestep = mask[0, 0][:, ::PATCH, ::PATCH].flatten()[None, :] * t[:, None]     # (B, L), 0 on frame 0
    else:
        hidden, timestep = noisy, token_timesteps(t, noisy)
    return transformer(hidden_states=hidden, timestep=timestep, encoder_hidden_states=text, return_dict=False)[0]


def sampling_condition(vae, images: list, *, width: int, height: int, frames: int) -> list[torch.Tensor]:
    """ReferenceConditioning.sampling_latents: [(1, 48, 1, h, w)] float32 on the host, the first frame
    (PIL) resized as the pipeline's VideoProcessor does, encoded alone (its posterior's mode) and
    normalised as WanImageToVideoPipeline(expand_timesteps=True) builds its condition."""
    from diffusers.video_processor import VideoProcessor

    if len(images) != 1:
        raise ValueError(f"Wan 2.2 TI2V-5B is conditioned on one first-frame image, got {len(images)}")
    raw = getattr(vae, "vae", vae)
    image = VideoProcessor(vae_scale_factor=VAE_SCALE_FACTOR).preprocess(images[0], height=height, width=width)
    image = image.to(torch.float32).unsqueeze(2).to(device=next(raw.parameters()).device, dtype=raw.dtype)
    latents = raw.encode(image).latent_dist.mode().to(torch.float32)
    shape = (1, raw.config.z_dim, 1, 1, 1)
    mean = torch.tensor(raw.config.latents_mean).view(shape).to(latents.device, latents.dtype)
    inv_std = 1.0 / torch.tensor(raw.config.latents_std).view(shape).to(latents.device, latents.dtype)
    return [((latents - mean) * inv_std).to("cpu")]                  # the pipeline's (x - mean) * (1 / std)


def probe_inputs(config, batch: int, latent_hw: tuple[int, int], text_length: int, dtype: torch.dtype,
                 frames: int = 1) -> dict:
    """Forward kwargs on the meta device for the planner's activation probe, as predict feeds them:
    the per-token timesteps, one t expanded along the tokens as token_timesteps gives it (so the
    blocks take one modulation row for all tokens, wan/block.py, which the probe prices)."""
    h, w = latent_hw
    tokens = frames * (h // PATCH) * (w // PATCH)
    return {"hidden_states": torch.empty(batch, config.in_channels, frames, h, w, device="meta", dtype=dtype),
            "timestep": torch.empty(batch, 1, device="meta", dtype=torch.float32).expand(-1, tokens),
            "encoder_hidden_states": torch.empty(batch, text_length, config.text_dim, device="meta", dtype=dtype),
            "return_dict": False}


def published_schedule() -> FlowSchedule:
    """TI2V-5B's (Wan-AI's wan_ti2v_5B.py): static shift 5.0, 50 steps, guidance 5.0, the scheduler's
    own timestep spacing; a folder's scheduler config takes precedence for the shift."""
    return FlowSchedule(use_dynamic_shifting=False, shift=5.0, default_steps=50, default_guidance=5.0,
                        pipeline_sigmas=False)


def _schedule(variant: str, folder=None) -> FlowSchedule:
    from . import _schedule as wan_schedule

    return wan_schedule(variant, folder, published_schedule())


def load_transformer(sources, dtype: torch.dtype = torch.bfloat16, device="cpu", **options):
    """TI2V-5B's transformer (wan/loading.load_transformer, refusing the 16-channel models by name)."""
    return wan_loading.load_transformer(sources, dtype, device, ti2v=True, **options)


def load_raw_vae(sources, dtype: torch.dtype = torch.bfloat16, device="cpu"):
    """The Wan 2.2 AutoencoderKLWan (a diffusers vae/ folder, or a file in diffusers' names); the Wan
    2.1 VAE's 16 channels are refused by name (TI2V-5B's latents are 48)."""
    vae = wan_loading.load_raw_vae(sources, dtype, device)
    if vae.config.z_dim != LATENT_CHANNELS:
        raise LoadError(f"[model] vae: {sources.vae}: a Wan VAE of {vae.config.z_dim} latent channels (the Wan 2.1 "
                        f"VAE's), but TI2V-5B takes the Wan 2.2 VAE's {LATENT_CHANNELS}")
    return vae


def load_vae(sources, dtype: torch.dtype = torch.bfloat16, device="cpu") -> QwenVAE:
    """The Wan 2.2 VAE seen as an image VAE with normalised 4-D latents (one frame)."""
    return QwenVAE(load_raw_vae(sources, dtype, device))


def describe(transformer) -> str:
    cfg = transformer.config
    return f"Wan 2.2 TI2V ({cfg.num_layers} blocks, width {cfg.num_attention_heads * cfg.attention_head_dim})"


def is_ti2v(config) -> bool:
    """A transformer config (mapping or diffusers config) of TI2V-5B's 48 latent channels."""
    get = config.get if hasattr(config, "get") else lambda k, d=None: getattr(config, k, d)
    return get("in_channels") == LATENT_CHANNELS and get("out_channels") == LATENT_CHANNELS


def _register():
    from . import _loader, image_tokens, pack_latents, unpack_latents, _timestep, split_blocks
    from ..family import ModelFamily, ReferenceConditioning, Sampling, VideoLatents, register

    return register(ModelFamily(
        name=NAME, spec=SPEC,
        resolve_sources=_loader("resolve_sources"), load_transformer=load_transformer,
        load_text_encoders=_loader("load_text_encoders"), load_vae=load_vae,
        text_sources=("text_encoder", "tokenizer"),
        encode_prompts=wan_text.encode_prompts, padding_side=wan_text.padding_side,
        latent_channels=LATENT_CHANNELS, vae_scale_factor=VAE_SCALE_FACTOR,
        pack_latents=pack_latents, unpack_latents=unpack_latents, image_tokens=image_tokens,
        predict=predict, probe_inputs=probe_inputs, describe=describe,
        sampling=Sampling(guidance="cfg", variant=lambda transformer: NAME, schedule=_schedule, timestep=_timestep,
                          cfg_batched=False, finish=with_first_frame),
        text_modules=wan_text.text_modules,
        transformer_classes=(wan_loading.TRANSFORMER_CLASS,), pipeline_classes=("WanPipeline",),
        recognizes_keys=recognizes_keys, recognizes_config=lambda config, index=None: config is not None and
        is_ti2v(config), recognizes_shapes=lambda shapes: input_channels(shapes) == LATENT_CHANNELS,
        text_rows=wan_text.text_rows, timestep_sampling="shift",
        text_width=lambda config: config.text_dim,
        video=VideoLatents(temporal_factor=TEMPORAL_FACTOR, load_vae=load_raw_vae, fps=SAMPLE_FPS),
        side_multiple=VAE_SCALE_FACTOR * PATCH, split_blocks=split_blocks,
        # image-to-video when a sample is given a first frame (`leantune sample --reference`); clips train
        # text-to-video, or with [model] image_to_video on their own first latent frame (first_frame is
        # False either way: no condition entry is cached)
        references=ReferenceConditioning(size=lambda ref_width, ref_height, bucket: tuple(bucket[:2]), most=1,
                                         sampling_latents=sampling_condition, first_frame=lambda sources: False,
                                         first_frame_optional=True),
    ))


TI2V = _register()
