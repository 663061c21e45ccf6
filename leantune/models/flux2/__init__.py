"""FLUX.2 (dev: 32B, 8 double + 48 single blocks, Mistral Small 3.x text encoder; klein 4B and 9B:
Qwen3 text encoders): latents, the transformer call, sampling and the three families'
registration (`flux2-dev`, `flux2-klein-4b`, `flux2-klein-9b`). The spec is in flux2/spec.py,
loading in flux2/loading.py, text encoding in flux2/text.py; this module imports them, none imports it.

Everything follows Flux2Pipeline / Flux2KleinPipeline (diffusers) exactly:

- Latents: AutoencoderKLFlux2 gives 32 channels at 1/8 of the pixels. The pipelines patchify them
  2x2 into 128 channels at 1/16 and normalise those with the VAE's batch-norm running statistics
  ((z - mean) / sqrt(var + eps)); the transformer sees one token per 128-channel cell. `Flux2VAE`
  wraps the VAE so the shared code sees that normalised (B, 128, H/16, W/16) tensor as "the
  latents" (its config says scaling 1, shift 0): the family's latent_channels are 128 and its
  vae_scale_factor 16, and the sampler's noise, (1, 128, H/16, W/16) per seed, is the pipelines'.
  Packing is a plain reshape to (B, h*w, 128).
- Positions: 4-axis ids (t, h, w, l): image tokens (0, i, j, 0), text tokens (0, 0, 0, k); the
  k-th reference image's tokens (10 + 10k, i, j, 0).
- The transformer's timestep is sigma (it multiplies by 1000 itself), rounded as the pipelines round
  it; dev's guidance input is the float32 scale (`guidance_embeds`); klein has none.
- Sampling: the published linspace sigmas with BFL's empirical shift mu(image tokens, steps)
  (`compute_empirical_mu`). Dev: distilled guidance, 50 steps at 4.0. Klein: classifier-free
  guidance with the empty negative prompt, 50 steps at 4.0; a step-distilled klein (its
  model_index.json `is_distilled`) samples without guidance, as its pipeline does.
- Training noise levels: `flux_shift`, the logit-normal shifted by the resolution-dependent mu of
  FLUX.2's scheduler config (0.5 at 256 tokens to 1.15 at 4096: Flux.1's line).
- References (multi-reference editing, as Flux2Pipeline's `image=`): each reference's normalised
  latents, packed, follow the target's tokens with their own time coordinate; the output is cut
  back to the target's tokens. The text encoder does not see them.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import torch
from torch import nn

from . import loading as flux2_loading, text as flux2_text
from .keys import variant_by_layout, variant_of
from .spec import SPECS
from ..schedule import FlowSchedule, model_timestep

VAE_SCALE_FACTOR = 16           # pixels per latent cell after the 2x2 patchify
LATENT_CHANNELS = 128           # 32 VAE channels x 2 x 2
REFERENCE_AREA = 1024 * 1024    # the pipelines cap a reference at this many pixels
REFERENCE_TIME_SCALE = 10       # reference k's time coordinate: 10 + 10 k (the pipelines' _prepare_image_ids)
# How many references one target may have: the pipelines set no bound; BFL's FLUX.2 documentation
# gives 10 for dev.
MAX_REFERENCES = 10


# -- latents -------------------------------------------------------------------------------------------

def patchify(latents: torch.Tensor) -> torch.Tensor:
    """(B, C, H, W) -> (B, 4C, H/2, W/2), as Flux2Pipeline._patchify_latents."""
    b, c, h, w = latents.shape
    x = latents.view(b, c, h // 2, 2, w // 2, 2).permute(0, 1, 3, 5, 2, 4)
    return x.reshape(b, c * 4, h // 2, w // 2)


def unpatchify(latents: torch.Tensor) -> torch.Tensor:
    """(B, 4C, h, w) -> (B, C, 2h, 2w), as Flux2Pipeline._unpatchify_latents."""
    b, c, h, w = latents.shape
    x = latents.reshape(b, c // 4, 2, 2, h, w).permute(0, 1, 4, 2, 5, 3)
    return x.reshape(b, c // 4, h * 2, w * 2)


class Flux2VAE(nn.Module):
    """AutoencoderKLFlux2 seen as an image VAE whose latents are the pipelines' patchified,
    batch-norm-normalised (B, 128, H/16, W/16) tensors (module docstring)."""

    def __init__(self, vae: nn.Module):
        super().__init__()
        self.vae = vae
        self.config = SimpleNamespace(scaling_factor=1.0, shift_factor=0.0,
                                      latent_channels=vae.config.latent_channels * 4,
                                      # the decoder's widths, for the decode planner's activation estimate
                                      block_out_channels=list(vae.config.block_out_channels))

    @property
    def device(self) -> torch.device:
        return next(self.vae.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.vae.parameters()).dtype

    # infer/decode.py sets the tile size on the VAE it decodes with: the inner one tiles
    @property
    def tile_latent_min_size(self):
        return self.vae.tile_latent_min_size

    @tile_latent_min_size.setter
    def tile_latent_min_size(self, value):
        self.vae.tile_latent_min_size = value

    @property
    def tile_sample_min_size(self):
        return self.vae.tile_sample_min_size

    @tile_sample_min_size.setter
    def tile_sample_min_size(self, value):
        self.vae.tile_sample_min_size = value

    def _bn(self, like: torch.Tensor):
        bn = self.vae.bn
        mean = bn.running_mean.view(1, -1, 1, 1).to(like.device, like.dtype)
        std = torch.sqrt(bn.running_var.view(1, -1, 1, 1) + self.vae.config.batch_norm_eps).to(like.device, like.dtype)
        return mean, std

    def encode(self, x: torch.Tensor):
        """(B, 3, H, W) in [-1, 1] -> .latent_dist.mean: (B, 128, H/16, W/16), as the pipelines
        encode a reference (the distribution's mode, patchified, normalised)."""
        z = patchify(self.vae.encode(x).latent_dist.mode())
        mean, std = self._bn(z)
        return SimpleNamespace(latent_dist=SimpleNamespace(mean=(z - mean) / std))

    def raw_latents(self, z: torch.Tensor) -> torch.Tensor:
        """Normalised (B, 128, h, w) -> the VAE's own (B, 32, 2h, 2w), as the pipelines before decoding."""
        mean, std = self._bn(z)
        return unpatchify(z * std + mean)

    def decode(self, z: torch.Tensor, return_dict: bool = False):
        return (self.vae.decode(self.raw_latents(z), return_dict=False)[0],)

    def tiled_decode(self, z: torch.Tensor, return_dict: bool = False):
        return (self.vae.tiled_decode(self.raw_latents(z), return_dict=False)[0],)


def load_vae(sources, dtype: torch.dtype = torch.bfloat16, device="cpu") -> Flux2VAE:
    return Flux2VAE(flux2_loading.load_raw_vae(sources, dtype, device))


def pack_latents(latents: torch.Tensor) -> torch.Tensor:
    """(B, C, h, w) -> (B, h*w, C), as Flux2Pipeline._pack_latents."""
    b, c, h, w = latents.shape
    return latents.reshape(b, c, h * w).permute(0, 2, 1)


def unpack_latents(packed: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """(B, h*w, C) -> (B, C, h, w) (the pipelines scatter by position ids: the same grid)."""
    b, _, c = packed.shape
    return packed.permute(0, 2, 1).reshape(b, c, h, w)


def image_tokens(h: int, w: int) -> int:
    return h * w


def image_ids(h: int, w: int, t: int = 0, device=None) -> torch.Tensor:
    """(h*w, 4) position ids (t, i, j, 0) of a latent grid (the pipelines' _prepare_latent_ids)."""
    return torch.cartesian_prod(torch.tensor([t]), torch.arange(h), torch.arange(w), torch.arange(1)).to(device)


def text_ids(length: int, device=None) -> torch.Tensor:
    """(L, 4) position ids (0, 0, 0, k) of the text tokens (the pipelines' _prepare_text_ids)."""
    return torch.cartesian_prod(torch.arange(1), torch.arange(1), torch.arange(1), torch.arange(length)).to(device)


# -- the forward call ---------------------------------------------------------------------------------------

def _guidance_input(transformer, guidance, batch: int, device):
    if guidance is None or not transformer.config.guidance_embeds:
        return None
    return torch.full((batch,), float(guidance), dtype=torch.float32, device=device)


def predict(transformer, noisy_packed: torch.Tensor, sigma: torch.Tensor, embeds, latent_hw: tuple[int, int],
            guidance=None, references=None) -> torch.Tensor:
    """One transformer call: packed noisy latents (B, N, 128) at sigma (B,) -> the packed velocity
    (B, N, 128). `guidance`: dev's distilled scale (ignored by a model without the embedder).
    `references`: a list of (1 or B, 128, h_r, w_r) normalised latents whose tokens follow the target's."""
    dtype, device = noisy_packed.dtype, noisy_packed.device
    b, n = noisy_packed.shape[:2]
    h, w = latent_hw
    seq = embeds.t5.to(device=device, dtype=dtype)
    hidden, ids = noisy_packed, image_ids(h, w, device=device)
    if references:
        refs = [pack_latents(r.to(device=device, dtype=dtype)).expand(b, -1, -1) for r in references]
        ref_ids = [image_ids(r.shape[-2], r.shape[-1], t=REFERENCE_TIME_SCALE * (k + 1), device=device)
                   for k, r in enumerate(references)]
        hidden, ids = torch.cat([noisy_packed, *refs], dim=1), torch.cat([ids, *ref_ids])
    out = transformer(
        hidden_states=hidden,
        encoder_hidden_states=seq,
        timestep=sigma.to(device=device, dtype=dtype),
        img_ids=ids,
        txt_ids=text_ids(seq.shape[1], device=device),
        guidance=_guidance_input(transformer, guidance, b, device),
        return_dict=False,
    )[0]
    return out[:, :n]


def probe_inputs(config, batch: int, latent_hw: tuple[int, int], text_length: int, dtype: torch.dtype) -> dict:
    """Forward kwargs on the meta device for the planner's activation probe (as predict feeds them)."""
    def meta(*shape, dtype=dtype):
        return torch.empty(*shape, device="meta", dtype=dtype)

    n = image_tokens(*latent_hw)
    inputs = {"hidden_states": meta(batch, n, config.in_channels),
              "encoder_hidden_states": meta(batch, text_length, config.joint_attention_dim),
              "timestep": meta(batch), "img_ids": meta(n, 4, dtype=torch.long),
              "txt_ids": meta(text_length, 4, dtype=torch.long), "return_dict": False}
    if config.guidance_embeds:
        inputs["guidance"] = meta(batch, dtype=torch.float32)
    return inputs


# -- sampling ----------------------------------------------------------------------------------------------

def published_schedule(variant: str) -> FlowSchedule:
    """Dev and klein: 50 steps at guidance 4.0 (the pipelines' defaults); a step-distilled klein
    ("klein-distilled"): 4 steps without guidance."""
    if variant == "klein-distilled":
        return FlowSchedule(empirical_mu=True, default_steps=4, default_guidance=1.0)
    return FlowSchedule(empirical_mu=True, default_steps=50, default_guidance=4.0)


def _is_distilled(folder) -> bool:
    """model_index.json's `is_distilled` (Flux2KleinPipeline's config) of a diffusers folder."""
    if folder is None:
        return False
    path = Path(folder) / "model_index.json"
    try:
        return bool(json.loads(path.read_text(encoding="utf-8")).get("is_distilled", False))
    except (OSError, ValueError, AttributeError):
        return False


def _schedule(variant: str, folder=None) -> FlowSchedule:
    if variant == "klein" and _is_distilled(folder):
        variant = "klein-distilled"
    return FlowSchedule.from_model_folder(folder, published_schedule(variant))


def _timestep(sigma: torch.Tensor, batch: int, dtype: torch.dtype, device) -> torch.Tensor:
    return model_timestep(sigma, batch, dtype, device)


def _variant(transformer) -> str:
    """The sampling variant: "dev" (distilled guidance) or "klein" (classifier-free guidance)."""
    return "dev" if variant_of(transformer.config) == "flux2-dev" else "klein"


# -- references --------------------------------------------------------------------------------------------

def reference_size(ref_width: int, ref_height: int, bucket=None) -> tuple[int, int]:
    """(width, height) a reference is VAE-encoded at: its own size, scaled down to at most 1024^2
    pixels of area (aspect kept), sides floored to multiples of 16, as the pipelines prepare `image=`
    (the bucket does not change it)."""
    w, h = ref_width, ref_height
    if w * h > REFERENCE_AREA:
        scale = math.sqrt(REFERENCE_AREA / (w * h))
        w, h = int(w * scale), int(h * scale)
    return max(16, w // 16 * 16), max(16, h // 16 * 16)


def _image_processor():
    from diffusers.pipelines.flux2.image_processor import Flux2ImageProcessor

    return Flux2ImageProcessor(vae_scale_factor=VAE_SCALE_FACTOR)


@torch.no_grad()
def encode_reference_latents(vae: Flux2VAE, images) -> list[torch.Tensor]:
    """Each reference's normalised latents (1, 128, h, w), prepared and encoded as the pipelines
    prepare `image=` (capped at 1024^2 pixels, cropped to multiples of 16)."""
    proc = _image_processor()
    out = []
    for img in images:
        proc.check_image_input(img)
        if img.size[0] * img.size[1] > REFERENCE_AREA:
            img = proc._resize_to_target_area(img, REFERENCE_AREA)
        w, h = img.size[0] // VAE_SCALE_FACTOR * VAE_SCALE_FACTOR, img.size[1] // VAE_SCALE_FACTOR * VAE_SCALE_FACTOR
        pixels = proc.preprocess(img, height=h, width=w, resize_mode="crop").to(device=vae.device, dtype=vae.dtype)
        out.append(vae.encode(pixels).latent_dist.mean)
    return out


# -- the family objects ------------------------------------------------------------------------------------

def _loader(name: str):
    """flux2_loading's `name`, looked up on each call (so a test may replace it)."""
    def call(*args, **kwargs):
        return getattr(flux2_loading, name)(*args, **kwargs)
    call.__name__ = name
    return call


def _transformer_loader(family: str):
    """flux2_loading.load_transformer for `family`: weights of another FLUX.2 are refused naming the
    file and the family to set (flux2_single_file.check_variant)."""
    def call(*args, **kwargs):
        kwargs.setdefault("expected", family)
        return flux2_loading.load_transformer(*args, **kwargs)
    call.__name__ = "load_transformer"
    return call


def _text_loader(kind: str):
    def call(sources, dtype=torch.bfloat16, device="cpu"):
        return flux2_loading.load_text_encoders(sources, kind, dtype, device)
    return call


def _double_indices(keys) -> set[int]:
    out = set()
    for k in keys:
        parts = k.split(".")
        for i, p in enumerate(parts[:-1]):
            if p in ("transformer_blocks", "double_blocks") and parts[i + 1].isdigit():
                out.add(int(parts[i + 1]))
    return out


def _is_flux2(keys) -> bool:
    from .keys import recognizes_keys

    return recognizes_keys(keys)


def _has_guidance(keys) -> bool:
    return any("guidance_embedder" in k or "guidance_in" in k for k in keys)


def _recognizer(name: str):
    """Tensor names of a single FLUX.2 file (diffusers' or BFL's, any prefix) -> this variant, by
    flux2_keys.variant_by_layout (the names show the guidance embedder and the depth)."""
    def recognizes(keys) -> bool:
        keys = list(keys)
        return _is_flux2(keys) and variant_by_layout(_has_guidance(keys), len(_double_indices(keys))) == name
    return recognizes


# model_index.json's text encoder class -> whether the pipeline is dev (Mistral) or klein (Qwen3)
_DEV_TEXT_ENCODERS = flux2_loading.TEXT_ENCODERS["mistral3"][0]
_KLEIN_TEXT_ENCODERS = flux2_loading.TEXT_ENCODERS["qwen3"][0]


def _folder_variant(config: dict | None, index: dict | None) -> str | None:
    """The family of a diffusers folder: its transformer config says (variant_of); without one,
    model_index.json's pipeline and text encoder classes tell dev from klein, not klein's size."""
    if config and "num_layers" in config:
        return variant_of(config)
    index = index or {}
    encoder = index.get("text_encoder")
    encoder = encoder[1] if isinstance(encoder, list) and len(encoder) == 2 else None
    if index.get("_class_name") == "Flux2Pipeline" or encoder in _DEV_TEXT_ENCODERS:
        return "flux2-dev"
    if index.get("_class_name") == "Flux2KleinPipeline" or encoder in _KLEIN_TEXT_ENCODERS:
        return "flux2-klein"        # 4B or 9B: only the transformer's config tells
    return None


def _config_recognizer(name: str):
    """ModelFamily.recognizes_config: the three families share Flux2Transformer2DModel; the config
    (or the folder's model_index.json) tells which a model is."""
    def recognizes(config, index=None) -> bool:
        return _folder_variant(dict(config) if config is not None else None, index) == name
    return recognizes


def _text_phase(name: str):
    """The family's priced text-encoding phase (flux2/text_phase.py), imported on use."""
    def phase(rows, model_cfg=None, base_dir=None):
        from .text_phase import text_encoding_phase

        return text_encoding_phase(name, rows, model_cfg=model_cfg, base_dir=base_dir)
    return phase


def _register():
    from ..family import ModelFamily, ReferenceConditioning, Sampling, register

    references = ReferenceConditioning(size=reference_size, text_sees_images=False, most=MAX_REFERENCES,
                                      sampling_latents=encode_reference_latents)
    dev = ModelFamily(
        name="flux2-dev", spec=SPECS["flux2-dev"],
        resolve_sources=_loader("resolve_sources"), load_transformer=_transformer_loader("flux2-dev"),
        load_text_encoders=_text_loader("mistral3"), load_vae=load_vae, text_sources=("text_encoder", "tokenizer"),
        encode_prompts=flux2_text.encode_prompts, padding_side=flux2_text.padding_side,
        latent_channels=LATENT_CHANNELS, vae_scale_factor=VAE_SCALE_FACTOR,
        pack_latents=pack_latents, unpack_latents=unpack_latents, image_tokens=image_tokens,
        predict=predict, probe_inputs=probe_inputs, describe=_loader("describe"),
        sampling=Sampling(guidance="distilled", variant=_variant, schedule=_schedule, timestep=_timestep),
        text_modules=flux2_text.text_modules,
        transformer_classes=(flux2_loading.TRANSFORMER_CLASS,), recognizes_keys=_recognizer("flux2-dev"),
        recognizes_config=_config_recognizer("flux2-dev"),
        text_rows=flux2_text.text_rows, timestep_sampling="flux_shift", references=references,
        text_phase=_text_phase("flux2-dev"), caption_tokens=flux2_text.mistral_caption_tokens,
    )
    klein = replace(dev, load_text_encoders=_text_loader("qwen3"), caption_tokens=flux2_text.qwen_caption_tokens,
                    sampling=Sampling(guidance="cfg", variant=_variant, schedule=_schedule, timestep=_timestep))
    # one spec object per family (the same blocks and LoRA names): code handed only a spec finds its family
    return (register(dev),
            *(register(replace(klein, name=name, spec=SPECS[name], load_transformer=_transformer_loader(name),
                               recognizes_keys=_recognizer(name), recognizes_config=_config_recognizer(name),
                               text_phase=_text_phase(name)))
              for name in ("flux2-klein-4b", "flux2-klein-9b")))


FLUX2_DEV, FLUX2_KLEIN_4B, FLUX2_KLEIN_9B = _register()
