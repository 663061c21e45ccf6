"""Staged low-VRAM sampling for Flux: encode -> denoise -> decode, one stage on the GPU at a time.

A Flux-dev image needs three models that together are ~33 GB in bf16 (T5-XXL 9.5, transformer
23.8, VAE 0.2). Nothing needs two of them at once, so they run as stages and the device's peak is
the largest stage, never the sum:

1. encode (infer/encode.py): CLIP-L + T5 encode every prompt of the request, then leave the GPU;
   T5 may run block by block.
2. denoise (this module): the transformer walks the flow-matching Euler schedule (infer/schedule.py).
   The transformer is placed by the caller: fully resident, or through the memory engine whose
   forward-only mode keeps its resident set across the denoising steps, so only the streamed blocks
   travel per step.
3. decode (infer/decode.py): the VAE turns latents into pixels, one image at a time, tiled when the
   budget left does not hold a whole image's activations.

The sampler reproduces diffusers' FluxPipeline bit for bit for the same weights, seeds and settings
(fp32 and bf16, with FluxPipeline's VAE decoding image by image as stage 3 does). The noise of
image i is `torch.randn` of (1, 16, h, w) from a CPU generator seeded with seeds[i] (FluxPipeline
with one generator per image), so a seed means the same starting noise on any device, and
sampling never touches the global RNG (sampling during training leaves the training run's random
stream unchanged). The trainer's samples use `sample_during_training` with the model it already has
in memory and prompts pre-encoded by its cache, so nothing is reloaded.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable, Sequence

import torch
from torch import nn

from ..models.family import ModelFamily, PromptEmbeds, family_for_model
from .decode import (
    DecodePlan,
    Tiling,
    decode_latents,
    plan_decode,
    to_pil,
    vae_weight_bytes,
)
from .images import make_grid
from .schedule import FlowSchedule, euler_step, model_timestep

log = logging.getLogger(__name__)

Progress = Callable[[int, int], None]   # (steps done, steps total)


def check_size(width: int, height: int) -> None:
    """Flux packs 2x2 latent patches of an 8x VAE: sides must be multiples of 16."""
    for name, v in (("width", width), ("height", height)):
        if v < 16 or v % 16:
            raise ValueError(f"{name} = {v} must be a positive multiple of 16")


def variant_of(transformer: nn.Module) -> str:
    """'dev' when the transformer has the distilled-guidance embedder, else 'schnell'."""
    return "dev" if getattr(transformer.config, "guidance_embeds", False) else "schnell"


def compute_dtype(transformer: nn.Module) -> torch.dtype:
    """The dtype activations run in: the input embedder's (never fp8-stored, never streamed away)."""
    return transformer.x_embedder.weight.dtype


def initial_noise(seeds: Sequence[int], latent_h: int, latent_w: int, dtype: torch.dtype,
                  channels: int = 16) -> torch.Tensor:
    """Noise (B, C, h, w) on the host, image i from its own CPU generator seeded with seeds[i]."""
    out = []
    for s in seeds:
        g = torch.Generator(device="cpu").manual_seed(int(s))
        out.append(torch.randn((1, channels, latent_h, latent_w), generator=g, dtype=torch.float32))
    return torch.cat(out).to(dtype)


def as_embed_list(embeds: PromptEmbeds | Sequence[PromptEmbeds]) -> list[PromptEmbeds]:
    """One (1, L, D) PromptEmbeds per image, from a batched PromptEmbeds or a list of them."""
    if isinstance(embeds, PromptEmbeds):
        return [PromptEmbeds(embeds.t5[i:i + 1], embeds.pooled[i:i + 1]) for i in range(embeds.t5.shape[0])]
    out: list[PromptEmbeds] = []
    for e in embeds:
        out.extend(as_embed_list(e))
    return out


def _batches(embeds: list[PromptEmbeds], batch_size: int | None) -> list[list[int]]:
    """Group consecutive images into batches of equal text length (T5 sequences concatenate)."""
    groups: list[list[int]] = []
    for i, e in enumerate(embeds):
        g = groups[-1] if groups else None
        if g is not None and embeds[g[0]].t5.shape[1] == e.t5.shape[1] and (batch_size is None or len(g) < batch_size):
            g.append(i)
        else:
            groups.append([i])
    return groups


@torch.no_grad()
def denoise(transformer: nn.Module, embeds: PromptEmbeds | Sequence[PromptEmbeds], seeds: Sequence[int], *,
            width: int, height: int, steps: int, guidance: float | None, schedule: FlowSchedule,
            device, dtype: torch.dtype | None = None, batch_size: int | None = None,
            progress: Progress | None = None, family: ModelFamily | None = None) -> torch.Tensor:
    """Stage 2: Euler-sample latents for each (prompt embedding, seed) pair.

    The transformer must already be placed for `device` (resident, or under the memory engine).
    Returns unpacked latents (B, 16, height/8, width/8) on the host in the compute dtype.
    `batch_size` images share a forward (default: all that have the same text length).
    `family` defaults to the transformer's (from its class).
    """
    check_size(width, height)
    family = family or family_for_model(transformer)
    items = as_embed_list(embeds)
    if len(items) != len(seeds):
        raise ValueError(f"{len(items)} prompt embeddings but {len(seeds)} seeds: give one seed per image")
    dtype = dtype or compute_dtype(transformer)
    h, w = height // family.vae_scale_factor, width // family.vae_scale_factor
    sigmas = schedule.sigmas(steps, family.image_tokens(h, w))             # (steps + 1,) float32
    g = guidance if getattr(transformer.config, "guidance_embeds", False) else None
    out = torch.empty(len(items), family.latent_channels, h, w, dtype=dtype)
    groups = _batches(items, batch_size)
    done, total = 0, steps * len(groups)
    for idx in groups:
        cond = PromptEmbeds(t5=torch.cat([items[i].t5 for i in idx]), pooled=torch.cat([items[i].pooled for i in idx]))
        cond = cond.to(device=device, dtype=dtype)                          # (b, L, D_t5), (b, D_clip)
        noise = initial_noise([seeds[i] for i in idx], h, w, dtype, family.latent_channels)
        x = family.pack_latents(noise).to(device)                           # Flux: (b, N, 64)
        for k in range(steps):
            t = model_timestep(sigmas[k], len(idx), dtype, device)          # (b,)
            v = family.predict(transformer, x, t, cond, (h, w), g)         # velocity, packed
            x = euler_step(x, v, sigmas[k], sigmas[k + 1])
            done += 1
            if progress is not None:
                progress(done, total)
        out[idx] = family.unpack_latents(x, h, w).to("cpu", dtype)
    return out


@torch.no_grad()
def sample_images(transformer: nn.Module, vae: nn.Module, embeds: PromptEmbeds | Sequence[PromptEmbeds],
                  seeds: Sequence[int], *, width: int, height: int, steps: int | None = None,
                  guidance: float | None = None, schedule: FlowSchedule | None = None, device="cpu",
                  dtype: torch.dtype | None = None, batch_size: int | None = None, tiling: Tiling = "auto",
                  decode_bytes: int | None = None, progress: Progress | None = None) -> list:
    """Denoise and decode: PIL images, one per (embedding, seed).

    Both models must already be placed for `device`. `schedule` defaults to the published one of
    the transformer's variant, and so do `steps` (dev 28, schnell 4) and `guidance` (dev 3.5).
    `decode_bytes` is the memory the VAE may use for activations (None: unlimited), which decides
    tiling under "auto".
    """
    schedule = schedule or FlowSchedule.for_variant(variant_of(transformer))
    steps = steps or schedule.default_steps
    guidance = schedule.default_guidance if guidance is None else guidance
    latents = denoise(transformer, embeds, seeds, width=width, height=height, steps=steps, guidance=guidance,
                      schedule=schedule, device=device, dtype=dtype, batch_size=batch_size, progress=progress)
    plan = plan_decode(vae, height, width, tiling, decode_bytes)
    return to_pil(decode_latents(vae, latents, device, plan))


# -- during training --------------------------------------------------------------------------------

def free_device_bytes(device) -> int | None:
    """Bytes a new allocation on `device` can use: free memory plus the allocator's unused cache."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


_DECODE_MARGIN = 256 * 2**20   # allocator fragmentation and cuDNN workspaces


@torch.no_grad()
def sample_during_training(transformer: nn.Module, vae: nn.Module | Callable[[], nn.Module],
                           embeds: PromptEmbeds | Sequence[PromptEmbeds], sample_cfg, *, memory_handle=None,
                           device="cpu", dtype: torch.dtype | None = None, schedule: FlowSchedule | None = None,
                           cols: int | None = None):
    """A grid of samples from the model being trained, without reloading or re-placing anything.

    `embeds` are the cache's pre-encoded prompts (text encoders stay unloaded); `sample_cfg` is the
    run's [sample] section (seed, steps, guidance, width, height; image i uses seed + i). The memory
    engine is switched to forward-only for the duration (resident set kept across denoising steps)
    and back afterwards; the transformer runs in eval mode (no LoRA dropout) and returns to its
    previous mode. `vae` may be a loader called only now, whose VAE is dropped after decoding.
    The VAE decodes in whatever VRAM the training state leaves, tiled if that is too little.
    """
    items = as_embed_list(embeds)
    seeds = [sample_cfg.seed + i for i in range(len(items))]
    was_training = transformer.training
    if memory_handle is not None:
        memory_handle.forward_only(True)
    transformer.eval()
    try:
        schedule = schedule or FlowSchedule.for_variant(variant_of(transformer))
        latents = denoise(transformer, items, seeds, width=sample_cfg.width, height=sample_cfg.height,
                          steps=sample_cfg.steps, guidance=sample_cfg.guidance, schedule=schedule,
                          device=device, dtype=dtype)
    finally:
        transformer.train(was_training)
        if memory_handle is not None:
            memory_handle.forward_only(False)

    owned = not isinstance(vae, nn.Module)
    model = vae() if owned else vae
    home = next(model.parameters()).device
    free = free_device_bytes(device)
    if free is not None and home != torch.device(device):
        free -= vae_weight_bytes(model)
    plan = plan_decode(model, sample_cfg.height, sample_cfg.width, "auto",
                       None if free is None else max(0, free - _DECODE_MARGIN))
    model.to(device)
    try:
        images = to_pil(decode_latents(model, latents, device, plan))
    finally:
        model.to(home)
        if owned:
            del model
            gc.collect()
        if torch.device(device).type == "cuda":
            torch.cuda.empty_cache()
    return make_grid(images, cols)


__all__ = [
    "DecodePlan",
    "FlowSchedule",
    "check_size",
    "compute_dtype",
    "denoise",
    "initial_noise",
    "make_grid",
    "sample_during_training",
    "sample_images",
    "variant_of",
]
