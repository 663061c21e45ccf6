"""Flux.1 family: latent packing, text encoding, the transformer call, and its registration.

We use diffusers' `FluxTransformer2DModel`, `AutoencoderKL`, transformers' CLIP-L and T5-XXL as
they are; this module only knows how Flux wires them together (the spec lives in flux/spec.py,
loading in flux/loading.py; this module imports both, neither imports it).
Shapes: latents (B, 16, h, w) with h = H/8; packed latents (B, h/2 * w/2, 64); T5 sequence
(B, L, 4096); CLIP pooled (B, 768); img_ids (h/2 * w/2, 3); txt_ids (L, 3).
"""

from __future__ import annotations

import torch

from . import loading as flux_loading
from ..family import PromptEmbeds
from .spec import FLUX_SPEC
from ..schedule import FlowSchedule, model_timestep

VAE_SCALE_FACTOR = 8      # pixels per latent
LATENT_CHANNELS = 16
CLIP_MAX_LENGTH = 77


def pack_latents(latents: torch.Tensor) -> torch.Tensor:
    """(B, C, h, w) -> (B, h/2 * w/2, C*4): 2x2 patches as tokens, as FluxPipeline._pack_latents."""
    b, c, h, w = latents.shape
    x = latents.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(b, (h // 2) * (w // 2), c * 4)


def unpack_latents(packed: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """(B, h/2 * w/2, C*4) -> (B, C, h, w) for latent height h and width w."""
    b, _, d = packed.shape
    x = packed.view(b, h // 2, w // 2, d // 4, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return x.reshape(b, d // 4, h, w)


def image_ids(h: int, w: int, device=None, dtype=torch.float32) -> torch.Tensor:
    """Positional ids (h/2 * w/2, 3) of the packed latent tokens: (0, row, col).

    Built on `device` itself: a host tensor copied to a GPU makes the host wait for every queued
    kernel, at each transformer call."""
    ids = torch.zeros(h // 2, w // 2, 3, device=device)
    ids[..., 1] = torch.arange(h // 2, device=device)[:, None]
    ids[..., 2] = torch.arange(w // 2, device=device)[None, :]
    return ids.reshape(-1, 3).to(dtype=dtype)


def text_ids(length: int, device=None, dtype=torch.float32) -> torch.Tensor:
    return torch.zeros(length, 3, device=device, dtype=dtype)


@torch.no_grad()
def encode_prompts(prompts: list[str], tokenizer, text_encoder, tokenizer_2, text_encoder_2,
                   max_length: int = 512, device=None) -> tuple[PromptEmbeds, torch.Tensor]:
    """Encode prompts as FluxPipeline does: CLIP pooled output + T5 last hidden state.

    Returns the embeddings and the T5 token counts (B,) including the end token, so callers can
    trim padding: the cache stores the length, and batches pad with zeros to the longest prompt of
    the batch. (Flux attends to padded T5 positions too, so this differs slightly from the full
    512-token conditioning FluxPipeline uses at inference.)
    """
    device = device or text_encoder.device
    clip_in = tokenizer(prompts, padding="max_length", max_length=min(CLIP_MAX_LENGTH, tokenizer.model_max_length),
                        truncation=True, return_tensors="pt")
    pooled = text_encoder(clip_in.input_ids.to(device), output_hidden_states=False).pooler_output
    t5_in = tokenizer_2(prompts, padding="max_length", max_length=max_length, truncation=True,
                        return_tensors="pt")
    t5 = text_encoder_2(t5_in.input_ids.to(device), output_hidden_states=False)[0]
    lengths = t5_in.attention_mask.sum(dim=1)
    return PromptEmbeds(t5=t5, pooled=pooled), lengths


def predict(transformer, noisy_packed: torch.Tensor, sigma: torch.Tensor, embeds: PromptEmbeds,
            latent_hw: tuple[int, int], guidance: float | torch.Tensor | None) -> torch.Tensor:
    """One transformer call: packed noisy latents (B, N, 64) at sigma (B,) -> packed prediction.

    `guidance` is the distilled guidance scale for dev checkpoints; ignored (must be None) when the
    transformer has no guidance embedder (schnell).
    """
    h, w = latent_hw
    b = noisy_packed.shape[0]
    dtype = noisy_packed.dtype
    device = noisy_packed.device
    g = None
    if getattr(transformer.config, "guidance_embeds", False):
        scale = 1.0 if guidance is None else guidance
        if isinstance(scale, torch.Tensor):
            g = scale.to(device=device, dtype=torch.float32).expand(b).clone()
        else:                                     # a fill from a host number: no host->device copy
            g = torch.full((b,), float(scale), device=device, dtype=torch.float32)
    out = transformer(
        hidden_states=noisy_packed,
        timestep=sigma.to(device=device, dtype=dtype),
        guidance=g,
        pooled_projections=embeds.pooled.to(device=device, dtype=dtype),
        encoder_hidden_states=embeds.t5.to(device=device, dtype=dtype),
        txt_ids=text_ids(embeds.t5.shape[1], device=device, dtype=dtype),
        img_ids=image_ids(h, w, device=device, dtype=dtype),
        return_dict=False,
    )[0]
    return out


# -- the family object: what trainer, cache, planner and sampler call (see family.py) -----------------

def _encode(prompts: list[str], encoders, max_length: int = 512, device=None) -> tuple[PromptEmbeds, torch.Tensor]:
    return encode_prompts(prompts, encoders.tokenizer, encoders.text_encoder, encoders.tokenizer_2,
                          encoders.text_encoder_2, max_length=max_length, device=device)


def _padding_side(encoders) -> str:
    return getattr(encoders.tokenizer_2, "padding_side", "right")


def _image_tokens(h: int, w: int) -> int:
    return (h // 2) * (w // 2)


def probe_inputs(config, batch: int, latent_hw: tuple[int, int], text_length: int, dtype: torch.dtype) -> dict:
    """Forward kwargs on the meta device for the planner's activation probe (same shapes as predict)."""
    image_tokens = _image_tokens(*latent_hw)

    def meta(*shape, dtype=dtype):
        return torch.empty(*shape, device="meta", dtype=dtype)

    inputs = {"hidden_states": meta(batch, image_tokens, config.in_channels),                # (B, N_img, C_in)
              "encoder_hidden_states": meta(batch, text_length, config.joint_attention_dim),  # (B, N_txt, D_text)
              "pooled_projections": meta(batch, config.pooled_projection_dim), "timestep": meta(batch),
              "img_ids": meta(image_tokens, 3), "txt_ids": meta(text_length, 3), "return_dict": False}
    if getattr(config, "guidance_embeds", False):
        inputs["guidance"] = meta(batch, dtype=torch.float32)
    return inputs


def _loader(name: str):
    """flux_loading's `name`, looked up on each call (so a test may replace it)."""
    def call(*args, **kwargs):
        return getattr(flux_loading, name)(*args, **kwargs)
    call.__name__ = name
    return call


def _describe(transformer) -> str:
    return f"Flux.1-{flux_loading.detect_variant(transformer)}"


def _variant(transformer) -> str:
    """'dev' when the transformer has the distilled-guidance embedder, else 'schnell'."""
    return "dev" if getattr(transformer.config, "guidance_embeds", False) else "schnell"


def _schedule(variant: str, folder=None):
    return FlowSchedule.from_model_folder(folder, variant)


def _timestep(sigma: torch.Tensor, batch: int, dtype: torch.dtype, device) -> torch.Tensor:
    return model_timestep(sigma, batch, dtype, device)


def _text_modules(encoders):
    """CLIP-L moves whole; T5-XXL may run block by block."""
    return [encoders.text_encoder], encoders.text_encoder_2


def _recognizes_keys(keys) -> bool:
    """A BFL / ComfyUI or diffusers Flux transformer file (any prefix); FLUX.2's files share the
    block names but have its shared modulation (bfl_layout.is_flux2_file), and are not Flux.1's."""
    from ..bfl_layout import is_flux2_file as is_flux2

    keys = list(keys)
    return (any(".double_blocks." in f".{k}" or ".single_transformer_blocks." in f".{k}" for k in keys)
            and not is_flux2(keys))


def _register():
    from ..family import ModelFamily, Sampling, register

    return register(ModelFamily(
        name="flux", spec=FLUX_SPEC,
        resolve_sources=_loader("resolve_sources"), load_transformer=_loader("load_transformer"),
        load_text_encoders=_loader("load_text_encoders"), load_vae=_loader("load_vae"),
        text_sources=("text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2"),
        encode_prompts=_encode, padding_side=_padding_side,
        latent_channels=LATENT_CHANNELS, vae_scale_factor=VAE_SCALE_FACTOR,
        pack_latents=pack_latents, unpack_latents=unpack_latents, image_tokens=_image_tokens,
        predict=predict, probe_inputs=probe_inputs, describe=_describe,
        sampling=Sampling(guidance="distilled", variant=_variant, schedule=_schedule, timestep=_timestep),
        text_modules=_text_modules,
        transformer_classes=("FluxTransformer2DModel",), recognizes_keys=_recognizes_keys,
        split_blocks=_split_blocks,
    ))


def _split_blocks(transformer) -> None:
    """ModelFamily.split_blocks: the blocks become block.py's split classes (imported on use: diffusers)."""
    from .block import split_blocks

    split_blocks(transformer)


FLUX = _register()
