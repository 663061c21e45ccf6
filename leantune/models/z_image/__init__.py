"""Z-Image (Tongyi-MAI; Turbo and base: a 6B single-stream DiT, Qwen3-4B text encoder, the Flux.1 VAE):
latents, the transformer call, sampling and the family's registration (`z-image`). The spec is in
z_image/spec.py, loading in z_image/loading.py, text encoding in z_image/text.py; this module
imports them, none imports it.

One family name serves Turbo and base: they share the architecture (nothing in the weights tells
them apart) and differ in weights and in their folder's scheduler (static shift 3.0 / 6.0), which
sampling reads; the released defaults here are the Turbo's.

Everything follows ZImagePipeline (diffusers) exactly:

- Latents: the Flux.1 AutoencoderKL's 16 channels at 1/8 of the pixels, scaled and shifted as for
  Flux ((z - 0.1159) * 0.3611). The transformer patchifies them itself (2 x 2 patches, one frame),
  taking one (C, 1, h, w) tensor per image: `pack_latents` is the identity on (B, 16, h, w) (as
  SD3.5's) and `predict` hands the transformer the list; image tokens are h/2 * w/2.
- Text: a list of per-prompt (n_i, 2560) tensors (text.py); `predict` cuts each prompt's
  zero-padded rows back to its real ones, so a batch equals the pipeline's list.
- Time and sign: the transformer's time runs the other way (t = 1 is clean): the pipeline feeds
  (1000 - timestep) / 1000 with timestep = sigma * 1000 in float32, and its velocity is the
  negative of the flow's (the pipeline negates it before the scheduler step). `predict` takes
  sigma, computes that time in float32 the pipeline's way and returns the negated output, so the
  trainer's target (noise - x0) and the sampler's Euler step are the other families'.
- Sampling: linspace(1, 1/steps) sigmas with the scheduler's static shift (Turbo 3.0, base 6.0;
  the pipeline's mu is unused without dynamic shifting). Guidance is classifier-free, mixed as
  v_pos + s * (v_pos - v_neg) and applied for any scale above 0 (the pipeline's
  `do_classifier_free_guidance` is `guidance_scale > 0`), with the empty negative prompt by
  default; the Turbo samples at 0 (no guidance), 9 steps.
- Training noise levels: "shift", the logit-normal shifted by [train] shift (3.0: the Turbo's
  scheduler shift, musubi-tuner's default for Z-Image).
"""

from __future__ import annotations

import torch

from . import loading as z_image_loading, text as z_image_text
from .keys import recognizes_keys
from .spec import Z_IMAGE_SPEC
from ..schedule import FlowSchedule

VAE_SCALE_FACTOR = 8
LATENT_CHANNELS = 16
PATCH = 2
NUM_TRAIN_TIMESTEPS = 1000


# -- latents -------------------------------------------------------------------------------------------

def pack_latents(latents: torch.Tensor) -> torch.Tensor:
    """The transformer patchifies itself: (B, 16, h, w) stays as it is."""
    return latents


def unpack_latents(packed: torch.Tensor, h: int, w: int) -> torch.Tensor:
    return packed


def image_tokens(h: int, w: int) -> int:
    return (h // PATCH) * (w // PATCH)


# -- the forward call ---------------------------------------------------------------------------------------

def model_time(sigma: torch.Tensor) -> torch.Tensor:
    """The transformer's time for noise level sigma, as ZImagePipeline computes it from the
    scheduler's float32 timestep sigma * 1000: (1000 - timestep) / 1000, in float32."""
    timestep = sigma.to(torch.float32) * NUM_TRAIN_TIMESTEPS
    return (NUM_TRAIN_TIMESTEPS - timestep) / NUM_TRAIN_TIMESTEPS


def text_rows(seq: torch.Tensor) -> list[torch.Tensor]:
    """(B, L, D) zero-padded text rows -> each prompt's real rows (n_i, D), as the pipeline's list.
    A prompt's rows are real then zero (the cache's and encode_prompts' padding); when no row holds a
    value at all (the planner's meta tensors, the simulated GPU's fake ones) every row is kept."""
    real = (seq != 0).any(dim=-1)                                              # (B, L)
    counts = real.sum(dim=1).tolist() if real.numel() and real.device.type != "meta" else []
    if not counts or max(counts) == 0:
        return list(seq.unbind(0))
    return [s[:max(int(n), 1)] for s, n in zip(seq.unbind(0), counts)]


def predict(transformer, noisy: torch.Tensor, sigma: torch.Tensor, embeds, latent_hw: tuple[int, int],
            guidance=None) -> torch.Tensor:
    """One transformer call: noisy latents (B, 16, h, w) at sigma (B,) -> the flow velocity (B, 16, h, w)
    (noise - x0 direction). `guidance` is ignored: Z-Image has no guidance input."""
    dtype, device = noisy.dtype, noisy.device
    caps = [r.to(device=device, dtype=dtype) for r in text_rows(embeds.t5)]
    out = transformer(list(noisy.unsqueeze(2).unbind(0)), model_time(sigma.to(device)), caps, return_dict=False)
    return -probe_output(out)


def probe_output(out) -> torch.Tensor:
    """The transformer's per-image outputs (C, 1, h, w) stacked as predict stacks them: (B, C, h, w)."""
    return torch.stack(out[0]).squeeze(2)


def probe_inputs(config, batch: int, latent_hw: tuple[int, int], text_length: int, dtype: torch.dtype) -> dict:
    """Forward kwargs on the meta device for the planner's activation probe (as predict feeds them)."""
    h, w = latent_hw
    return {"x": [torch.empty(config.in_channels, 1, h, w, device="meta", dtype=dtype) for _ in range(batch)],
            "t": torch.empty(batch, device="meta", dtype=torch.float32),
            "cap_feats": [torch.empty(text_length, config.cap_feat_dim, device="meta", dtype=dtype)
                          for _ in range(batch)],
            "return_dict": False}


# -- sampling ----------------------------------------------------------------------------------------------

BASE_SHIFT = 6.0         # Z-Image (base)'s scheduler_config.json; the Turbo's is 3.0


def published_schedule(variant: str = "turbo") -> FlowSchedule:
    """Z-Image-Turbo's: static shift 3.0, the pipeline's linspace sigmas, 9 steps without guidance (its
    model card's settings); the base model's ("base"): static shift 6.0 and ZImagePipeline's own
    defaults, 50 steps at CFG 5.0. A folder's scheduler_config.json takes precedence for the shift."""
    if variant == "base":
        return FlowSchedule(use_dynamic_shifting=False, shift=BASE_SHIFT, default_steps=50, default_guidance=5.0)
    return FlowSchedule(use_dynamic_shifting=False, shift=3.0, default_steps=9, default_guidance=0.0)


def _schedule(variant: str, folder=None) -> FlowSchedule:
    """[model] variant "turbo" / "base", else (auto) what a diffusers folder's scheduler shift says
    (6.0: the base model) or, for a single file, which cannot say, the Turbo's."""
    if variant not in ("turbo", "base"):
        variant = "base" if FlowSchedule.from_model_folder(folder, published_schedule()).shift >= BASE_SHIFT else "turbo"
    return FlowSchedule.from_model_folder(folder, published_schedule(variant))


def _timestep(sigma: torch.Tensor, batch: int, dtype: torch.dtype, device) -> torch.Tensor:
    """What predict gets as sigma: the float32 sigma itself (predict computes the pipeline's time)."""
    return torch.full((batch,), float(sigma), dtype=torch.float32, device=device)


def cfg_combine(v_neg: torch.Tensor, v_pos: torch.Tensor, scale: float) -> torch.Tensor:
    """ZImagePipeline's guidance: pos + s * (pos - neg) (on the negated outputs: negation is exact)."""
    return v_pos + scale * (v_pos - v_neg)


# -- the family object ----------------------------------------------------------------------------------------

def _loader(name: str):
    """z_image_loading's `name`, looked up on each call (so a test may replace it)."""
    def call(*args, **kwargs):
        return getattr(z_image_loading, name)(*args, **kwargs)
    call.__name__ = name
    return call


def _text_phase(rows, model_cfg=None, base_dir=None):
    from .text_phase import text_encoding_phase

    return text_encoding_phase(rows, model_cfg=model_cfg, base_dir=base_dir)


def _register():
    from ..family import ModelFamily, Sampling, register

    return register(ModelFamily(
        name="z-image", spec=Z_IMAGE_SPEC,
        resolve_sources=_loader("resolve_sources"), load_transformer=_loader("load_transformer"),
        load_text_encoders=_loader("load_text_encoders"), load_vae=_loader("load_vae"),
        text_sources=("text_encoder", "tokenizer"),
        encode_prompts=z_image_text.encode_prompts, padding_side=z_image_text.padding_side,
        latent_channels=LATENT_CHANNELS, vae_scale_factor=VAE_SCALE_FACTOR,
        pack_latents=pack_latents, unpack_latents=unpack_latents, image_tokens=image_tokens,
        predict=predict, probe_inputs=probe_inputs, describe=_loader("describe"),
        sampling=Sampling(guidance="cfg", variant=lambda transformer: "z-image", schedule=_schedule,
                          timestep=_timestep, combine=cfg_combine, cfg_above=0.0, pads_text=True),
        text_modules=z_image_text.text_modules,
        transformer_classes=(z_image_loading.TRANSFORMER_CLASS,), recognizes_keys=recognizes_keys,
        text_rows=z_image_text.text_rows, timestep_sampling="shift", text_phase=_text_phase,
        text_width=lambda config: config.cap_feat_dim, probe_output=probe_output,
        caption_tokens=z_image_text.caption_tokens,
    ))


Z_IMAGE = _register()
