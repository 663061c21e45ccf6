"""Krea 2 (krea-ai, June 2026: Raw and Turbo; a 12.9B single-stream MMDiT of 28 blocks, Qwen3-VL-4B
text encoder, the Qwen-Image VAE): latents, the transformer call, sampling and the family's
registration (`krea2`). The spec is in krea2/spec.py, loading in krea2/loading.py, text encoding
in krea2/text.py; this module imports them, none imports it.

Everything follows Krea2Pipeline (diffusers 0.42.1) and krea-ai/krea-2's sampling.py:

- Latents: the Qwen-Image VAE's 16 channels at 1/8 of the pixels, normalised with its latent mean
  and std (models/qwen_vae.py), packed into 2x2 patches: (B, h/2 * w/2, 64).
- Positions: (t, h, w) rotary coordinates, text rows all zero, image token (i, j) at (0, i, j).
- Text: a stack of 12 Qwen3-VL hidden states per token, fused by the transformer itself
  (krea2/text.py says how the rows are kept and fed back with the pipeline's mask).
- The transformer's timestep is sigma in [0, 1] (it scales by 1000 itself), as the pipeline
  computes it: (sigma * 1000 in float32) / 1000, then the latent dtype.
- Sampling: linspace(1, 1/steps) sigmas, time-shifted by mu: Raw's mu is linear in the image
  tokens, 0.5 at 256 to 1.15 at 6400 (the scheduler config); Turbo (model_index.json
  `is_distilled`) pins mu = 1.15. Guidance is Krea 2's own convention: v = v_pos + s (v_pos - v_neg),
  on for every s > 0 (the usual formula's 1 + s), with the empty negative prompt by default; the
  pipeline's defaults are 28 steps at 4.5 (Raw) and 8 steps at 0 (Turbo).
- Training noise levels: `krea2_shift`, the logit-normal time-shifted by the resolution-dependent mu
  of the sampler's line (256 -> 0.5, 6400 -> 1.15), as musubi-tuner's krea2_shift.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from . import loading as krea2_loading, text as krea2_text
from .keys import recognizes_keys
from .spec import KREA2_SPEC
from ..qwen_vae import QwenVAE
from ..schedule import NUM_TRAIN_TIMESTEPS, FlowSchedule

VAE_SCALE_FACTOR = 8
LATENT_CHANNELS = 16
PATCH = 2
TURBO_MU = 1.15                # Krea2Pipeline with is_distilled; krea-ai/krea-2 README: --mu 1.15 for oss_turbo


# -- latents -------------------------------------------------------------------------------------------

def load_vae(sources, dtype: torch.dtype = torch.bfloat16, device="cpu") -> QwenVAE:
    return QwenVAE(krea2_loading.load_raw_vae(sources, dtype, device))


def pack_latents(latents: torch.Tensor) -> torch.Tensor:
    """(B, C, h, w) -> (B, h/2 * w/2, C*4), as Krea2Pipeline._pack_latents."""
    b, c, h, w = latents.shape
    x = latents.view(b, c, h // PATCH, PATCH, w // PATCH, PATCH).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(b, (h // PATCH) * (w // PATCH), c * PATCH * PATCH)


def unpack_latents(packed: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """(B, h/2 * w/2, C*4) -> (B, C, h, w), as Krea2Pipeline._unpack_latents (without its frame axis)."""
    b, _, d = packed.shape
    c = d // (PATCH * PATCH)
    x = packed.view(b, h // PATCH, w // PATCH, c, PATCH, PATCH).permute(0, 3, 1, 4, 2, 5)
    return x.reshape(b, c, h, w)


def image_tokens(h: int, w: int) -> int:
    return (h // PATCH) * (w // PATCH)


def position_ids(text_length: int, grid_h: int, grid_w: int, device=None) -> torch.Tensor:
    """(text_length + grid_h * grid_w, 3) rotary coordinates, as Krea2Pipeline.prepare_position_ids."""
    image = torch.zeros(grid_h, grid_w, 3, device=device)
    image[..., 1] = torch.arange(grid_h, device=device)[:, None]
    image[..., 2] = torch.arange(grid_w, device=device)[None, :]
    return torch.cat([torch.zeros(text_length, 3, device=device), image.reshape(grid_h * grid_w, 3)], dim=0)


# -- the forward call ---------------------------------------------------------------------------------------

def predict(transformer, noisy_packed: torch.Tensor, sigma: torch.Tensor, embeds, latent_hw: tuple[int, int],
            guidance=None) -> torch.Tensor:
    """One transformer call: packed noisy latents (B, N, 64) at sigma (B,) -> packed velocity.
    `guidance` is ignored: Krea 2 has no guidance input (classifier-free guidance in sampling)."""
    dtype, device = noisy_packed.dtype, noisy_packed.device
    text, mask = krea2_text.transformer_text(embeds.t5, transformer.config.num_text_layers)
    h, w = latent_hw
    return transformer(
        hidden_states=noisy_packed,
        encoder_hidden_states=text.to(device=device, dtype=dtype),
        timestep=sigma.to(device=device, dtype=dtype),
        position_ids=position_ids(text.shape[1], h // PATCH, w // PATCH, device),
        encoder_attention_mask=None if mask is None else mask.to(device),
        return_dict=False,
    )[0]


def probe_inputs(config, batch: int, latent_hw: tuple[int, int], text_length: int, dtype: torch.dtype) -> dict:
    """Forward kwargs on the meta device for the planner's activation probe (predict's shapes)."""
    def meta(*shape, dtype=dtype):
        return torch.empty(*shape, device="meta", dtype=dtype)

    h, w = latent_hw
    n = image_tokens(h, w)
    return {"hidden_states": meta(batch, n, config.in_channels),
            "encoder_hidden_states": meta(batch, text_length, config.num_text_layers, config.text_hidden_dim),
            "timestep": meta(batch), "position_ids": meta(text_length + n, 3, dtype=torch.float32),
            "return_dict": False}


def text_width(config) -> int:
    """One text row of PromptEmbeds.t5: the tapped layers side by side."""
    return config.num_text_layers * config.text_hidden_dim


# -- sampling ----------------------------------------------------------------------------------------------

def published_schedule(variant: str) -> FlowSchedule:
    """Raw: mu 0.5 at 256 to 1.15 at 6400 image tokens, 28 steps at 4.5 (Krea2Pipeline's defaults);
    Turbo: mu pinned at 1.15 (a line of slope 0), 8 steps without guidance."""
    if variant == "krea2-turbo":
        return FlowSchedule(use_dynamic_shifting=True, base_shift=TURBO_MU, max_shift=TURBO_MU, base_image_seq_len=256,
                            max_image_seq_len=6400, default_steps=8, default_guidance=0.0)
    return FlowSchedule(use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15, base_image_seq_len=256,
                        max_image_seq_len=6400, default_steps=28, default_guidance=4.5)


def _schedule(variant: str, folder=None) -> FlowSchedule:
    """[model] variant "turbo" / "raw", else (auto) Turbo where a diffusers folder says it is
    distilled, Raw otherwise (a single file cannot say)."""
    if variant == "turbo" or (variant != "raw" and krea2_loading.folder_distilled(folder)):
        variant = "krea2-turbo"
    schedule = FlowSchedule.from_model_folder(folder, published_schedule(variant))
    if variant == "krea2-turbo":      # the pipeline ignores the scheduler's line when distilled
        schedule = replace(schedule, base_shift=TURBO_MU, max_shift=TURBO_MU, use_dynamic_shifting=True)
    return schedule


def _timestep(sigma: torch.Tensor, batch: int, dtype: torch.dtype, device) -> torch.Tensor:
    """Krea2Pipeline: t = sigma * 1000 (the scheduler's float32 timesteps), (t / 1000) in the latent dtype."""
    t = torch.full((batch,), float(sigma * NUM_TRAIN_TIMESTEPS), dtype=torch.float32, device=device)
    return (t / NUM_TRAIN_TIMESTEPS).to(dtype)


def cfg_combine(v_neg: torch.Tensor, v_pos: torch.Tensor, scale: float) -> torch.Tensor:
    """Krea 2's guidance: cond + scale * (cond - uncond) (Krea2Pipeline.__call__, sampling.py)."""
    return v_pos + scale * (v_pos - v_neg)


# -- the family object ----------------------------------------------------------------------------------------

def _loader(name: str):
    """krea2_loading's `name`, looked up on each call (so a test may replace it)."""
    def call(*args, **kwargs):
        return getattr(krea2_loading, name)(*args, **kwargs)
    call.__name__ = name
    return call


def _text_phase(rows, model_cfg=None, base_dir=None):
    from .text_phase import text_encoding_phase

    return text_encoding_phase(rows, model_cfg=model_cfg, base_dir=base_dir)


def _register():
    from ..family import ModelFamily, Sampling, register

    return register(ModelFamily(
        name="krea2", spec=KREA2_SPEC,
        resolve_sources=_loader("resolve_sources"), load_transformer=_loader("load_transformer"),
        load_text_encoders=_loader("load_text_encoders"), load_vae=load_vae,
        text_sources=("text_encoder", "tokenizer"),
        encode_prompts=krea2_text.encode_prompts, padding_side=krea2_text.padding_side,
        latent_channels=LATENT_CHANNELS, vae_scale_factor=VAE_SCALE_FACTOR,
        pack_latents=pack_latents, unpack_latents=unpack_latents, image_tokens=image_tokens,
        predict=predict, probe_inputs=probe_inputs, describe=_loader("describe"),
        sampling=Sampling(guidance="cfg", variant=lambda transformer: "krea2", schedule=_schedule,
                          timestep=_timestep, combine=cfg_combine, cfg_above=0.0),
        text_modules=krea2_text.text_modules,
        transformer_classes=(krea2_loading.TRANSFORMER_CLASS,), pipeline_classes=("Krea2Pipeline",),
        recognizes_keys=recognizes_keys, text_rows=krea2_text.text_rows,
        timestep_sampling="krea2_shift",
        text_phase=_text_phase, text_width=text_width, caption_tokens=krea2_text.caption_tokens,
    ))


KREA2 = _register()
