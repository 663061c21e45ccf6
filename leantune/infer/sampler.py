"""Staged low-VRAM sampling (Flux, SD3.5): encode -> denoise -> decode, one stage on the GPU at a time.

A Flux-dev image needs three models that together are ~33 GB in bf16 (T5-XXL 9.5, transformer
23.8, VAE 0.2). Nothing needs two of them at once, so they run as stages and the device's peak is
the largest stage, never the sum:

1. encode (infer/encode.py): CLIP-L + T5 encode every prompt of the request, then leave the GPU;
   T5 may run block by block.
2. denoise (this module): the transformer walks the flow-matching Euler schedule (models/schedule.py).
   The transformer is placed by the caller: fully resident, or through the memory engine whose
   forward-only mode keeps its resident set across the denoising steps, so only the streamed blocks
   travel per step.
3. decode (infer/decode.py): the VAE turns latents into pixels, one image at a time, tiled when the
   budget left does not hold a whole image's activations.

Guidance is the family's (`ModelFamily.sampling`): Flux dev feeds the scale to the transformer
(distilled guidance, one forward per step); SD3.5 uses classifier-free guidance, one forward of the
negative prompt and one of the prompt per step, mixed as v_neg + scale * (v_pos - v_neg). Both
halves run as one batch (negatives first, as StableDiffusion3Pipeline) or, when the memory plan
says the doubled batch does not fit, one after the other: the same numbers up to float
reassociation of a different batch size.

The sampler reproduces diffusers' FluxPipeline and StableDiffusion3Pipeline bit for bit for the
same weights, seeds and settings (fp32, and bf16 for Flux, with the pipeline's VAE decoding image
by image as stage 3 does). The noise of image i is `torch.randn` of (1, 16, h, w) from a CPU
generator seeded with seeds[i] (the pipelines with one generator per image), so a seed means the
same starting noise on any device, and
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
from ..models.schedule import FlowSchedule, euler_step, model_timestep

log = logging.getLogger(__name__)

Progress = Callable[[int, int], None]   # (steps done, steps total)


def check_size(width: int, height: int) -> None:
    """Both families patch 2x2 latents of an 8x VAE: sides must be multiples of 16."""
    for name, v in (("width", width), ("height", height)):
        if v < 16 or v % 16:
            raise ValueError(f"{name} = {v} must be a positive multiple of 16")


def variant_of(transformer: nn.Module) -> str:
    """The checkpoint kind of a transformer, as its family names it ('dev', 'schnell', 'large')."""
    return family_for_model(transformer).sampling.variant(transformer)


def default_schedule(transformer: nn.Module, family: ModelFamily | None = None) -> FlowSchedule:
    """The published schedule of the transformer's family and variant."""
    family = family or family_for_model(transformer)
    return family.sampling.schedule(family.sampling.variant(transformer), None)


_FP8 = {getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n)}


def compute_dtype(transformer: nn.Module, family: ModelFamily | None = None) -> torch.dtype:
    """The dtype activations run in: that of the first non-block module's floating weights (the
    embedders: never fp8-stored; Flux's time embedder, SD3's patch embedding)."""
    family = family or family_for_model(transformer)
    for name in family.spec.non_block_modules:
        module = getattr(transformer, name, None)
        for p in module.parameters() if module is not None else ():
            if p.is_floating_point() and p.dtype not in _FP8:
                return p.dtype
    raise TypeError(f"{type(transformer).__name__}: no floating-point weights outside the blocks to tell the "
                    f"compute dtype; pass dtype=")


def initial_noise(seeds: Sequence[int], latent_h: int, latent_w: int, dtype: torch.dtype,
                  channels: int = 16, frames: int | None = None) -> torch.Tensor:
    """Noise (B, C, h, w) on the host, image i from its own CPU generator seeded with seeds[i];
    with `frames` (latent frames) a video's (B, C, T', h, w), drawn as WanPipeline.prepare_latents
    draws it with one generator per video (one frame: the image's numbers)."""
    shape = (1, channels, latent_h, latent_w) if frames is None else (1, channels, frames, latent_h, latent_w)
    out = []
    for s in seeds:
        g = torch.Generator(device="cpu").manual_seed(int(s))
        out.append(torch.randn(shape, generator=g, dtype=torch.float32))
    return torch.cat(out).to(dtype)


def as_embed_list(embeds: PromptEmbeds | Sequence[PromptEmbeds]) -> list[PromptEmbeds]:
    """One (1, L, D) PromptEmbeds per image, from a batched PromptEmbeds or a list of them."""
    if isinstance(embeds, PromptEmbeds):
        return [PromptEmbeds(embeds.t5[i:i + 1], embeds.pooled[i:i + 1]) for i in range(embeds.t5.shape[0])]
    out: list[PromptEmbeds] = []
    for e in embeds:
        out.extend(as_embed_list(e))
    return out


def _cat(items: list[PromptEmbeds]) -> PromptEmbeds:
    return PromptEmbeds(t5=torch.cat([e.t5 for e in items]), pooled=torch.cat([e.pooled for e in items]))


def _negatives(negative: PromptEmbeds | Sequence[PromptEmbeds] | None, n: int) -> list[PromptEmbeds]:
    """One (1, L, D) negative embedding per image: a single one is shared by all."""
    if negative is None:
        raise ValueError("classifier-free guidance needs the negative prompt's embedding (negative=); "
                         "encode the negative prompt (default: the empty prompt) with the prompts")
    items = as_embed_list(negative)
    if len(items) == 1:
        return items * n
    if len(items) != n:
        raise ValueError(f"{len(items)} negative prompt embeddings for {n} images: give one, or one per image")
    return items


def _pad_rows(seq: torch.Tensor, rows: int) -> torch.Tensor:
    """(b, L, D) -> (b, rows, D), zero rows appended (Sampling.pads_text)."""
    return seq if seq.shape[1] == rows else torch.cat([seq, seq.new_zeros(seq.shape[0], rows - seq.shape[1], seq.shape[2])], 1)


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
            progress: Progress | None = None, family: ModelFamily | None = None,
            negative: PromptEmbeds | Sequence[PromptEmbeds] | None = None, cfg_batched: bool = True,
            references: Sequence[torch.Tensor] | None = None, frames: int = 1) -> torch.Tensor:
    """Stage 2: Euler-sample latents for each (prompt embedding, seed) pair.

    The transformer must already be placed for `device` (resident, or under the memory engine).
    Returns unpacked latents (B, 16, height/8, width/8) on the host in the compute dtype.
    `batch_size` images share a forward (default: all that have the same text length).
    `family` defaults to the transformer's (from its class). `guidance` is the family's kind
    (Sampling.guidance): the distilled input, or the classifier-free scale, which uses `negative`
    (one embedding shared by all images, or one per image) and runs both halves in one batch
    (`cfg_batched`, as the pipelines do) or one after the other (half the activations).
    `references`: reference-image latents (1, C, h_r, w_r) every image is conditioned on, for a
    family with reference conditioning (ModelFamily.references; docs/reference-images.md).
    `frames` > 1: videos of that many frames for a video family (ModelFamily.video; a valid
    length, 4k+1 for Wan): latents (B, 16, T', h, w), one video per forward by default.
    """
    check_size(width, height)
    family = family or family_for_model(transformer)
    latent_frames = None
    if frames != 1:
        if family.video is None:
            raise ValueError(f"frames = {frames}: {family.name} samples images (one frame)")
        latent_frames = family.video.latent_frames(frames)
        # one video per call unless asked: a video's activations grow with its frames, and each
        # video is then the family pipeline's for its prompt and seed, bit for bit
        batch_size = 1 if batch_size is None else batch_size
    ref = {} if not references else {"references": [r.to(device) for r in references]}
    items = as_embed_list(embeds)
    if len(items) != len(seeds):
        raise ValueError(f"{len(items)} prompt embeddings but {len(seeds)} seeds: give one seed per image")
    cfg = family.sampling.guides(guidance)
    negatives = _negatives(negative, len(items)) if cfg else None
    distilled = guidance if family.sampling.guidance == "distilled" else None
    dtype = dtype or compute_dtype(transformer, family)
    h, w = height // family.vae_scale_factor, width // family.vae_scale_factor
    sigmas = schedule.sigmas(steps, family.image_tokens(h, w))             # (steps + 1,) float32
    out = torch.empty(len(items), family.latent_channels, *([latent_frames] if latent_frames else []), h, w,
                      dtype=dtype)
    groups = _batches(items, batch_size)
    done, total = 0, steps * len(groups)
    for idx in groups:
        b = len(idx)
        cond = _cat([items[i] for i in idx]).to(device=device, dtype=dtype)         # (b, L, D_t5), (b, D_pool)
        if cfg:
            uncond = _cat([negatives[i] for i in idx]).to(device=device, dtype=dtype)
            together = (cfg_batched and family.sampling.cfg_batched
                        and (uncond.t5.shape[1] == cond.t5.shape[1] or family.sampling.pads_text))
            if together:      # negatives first, as StableDiffusion3Pipeline concatenates them
                rows = max(uncond.t5.shape[1], cond.t5.shape[1])
                both = PromptEmbeds(torch.cat([_pad_rows(uncond.t5, rows), _pad_rows(cond.t5, rows)]),
                                    torch.cat([uncond.pooled, cond.pooled]))
        noise = initial_noise([seeds[i] for i in idx], h, w, dtype, family.latent_channels, latent_frames)
        x = family.pack_latents(noise).to(device)                           # Flux: (b, N, 64); SD3: (b, 16, h, w)
        caches = _PrefixCaches(family, transformer)                          # one per forward kind of this batch
        for k in range(steps):
            if not cfg:
                t = family.sampling.timestep(sigmas[k], b, dtype, device)    # (b,)
                v = family.predict(transformer, x, t, cond, (h, w), distilled, **ref, **caches("cond", k))
            elif together:
                t = family.sampling.timestep(sigmas[k], 2 * b, dtype, device)
                v_neg, v_pos = family.predict(transformer, torch.cat([x, x]), t, both, (h, w), None, **ref,
                                              **caches("both", k)).chunk(2)
                v = family.sampling.mix(v_neg, v_pos, guidance)
            else:
                t = family.sampling.timestep(sigmas[k], b, dtype, device)
                v_neg = family.predict(transformer, x, t, uncond, (h, w), None, **ref, **caches("uncond", k))
                v_pos = family.predict(transformer, x, t, cond, (h, w), None, **ref, **caches("cond", k))
                v = family.sampling.mix(v_neg, v_pos, guidance)
            x = euler_step(x, v, sigmas[k], sigmas[k + 1])
            done += 1
            if progress is not None:
                progress(done, total)
        if ref and family.sampling.finish is not None:      # what the pipeline decodes (Sampling.finish)
            x = family.sampling.finish(x, ref["references"])
        out[idx] = family.unpack_latents(x, h, w).to("cpu", dtype)
    return out


class _PrefixCaches:
    """The prefix caches of one batch's denoising (Sampling.prefix_cache): one per kind of forward
    (the prompts, the negatives, both halves batched), made and filled at the first step, read
    after; nothing for a family without one."""

    def __init__(self, family: ModelFamily, transformer: nn.Module):
        self._make = family.sampling.prefix_cache
        self._transformer = transformer
        self._caches: dict[str, object] = {}

    def __call__(self, kind: str, step: int) -> dict:
        if self._make is None:
            return {}
        if step == 0:
            self._caches[kind] = self._make(self._transformer)
        cache = self._caches.get(kind)
        return {} if cache is None else {"prefix_cache": (cache, step == 0)}


@torch.no_grad()
def sample_images(transformer: nn.Module, vae: nn.Module, embeds: PromptEmbeds | Sequence[PromptEmbeds],
                  seeds: Sequence[int], *, width: int, height: int, steps: int | None = None,
                  guidance: float | None = None, schedule: FlowSchedule | None = None, device="cpu",
                  dtype: torch.dtype | None = None, batch_size: int | None = None, tiling: Tiling = "auto",
                  decode_bytes: int | None = None, progress: Progress | None = None,
                  negative: PromptEmbeds | Sequence[PromptEmbeds] | None = None, cfg_batched: bool = True) -> list:
    """Denoise and decode: PIL images, one per (embedding, seed).

    Both models must already be placed for `device`. `schedule` defaults to the published one of
    the transformer's family and variant, and so do `steps` (Flux dev 28, schnell 4, SD3.5 28) and
    `guidance` (Flux dev 3.5; SD3.5 CFG 7.0, which needs `negative`: the negative prompt's embedding).
    `decode_bytes` is the memory the VAE may use for activations (None: unlimited), which decides
    tiling under "auto".
    """
    schedule = schedule or default_schedule(transformer)
    steps = steps or schedule.default_steps
    guidance = schedule.default_guidance if guidance is None else guidance
    latents = denoise(transformer, embeds, seeds, width=width, height=height, steps=steps, guidance=guidance,
                      schedule=schedule, device=device, dtype=dtype, batch_size=batch_size, progress=progress,
                      negative=negative, cfg_batched=cfg_batched)
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
                           cols: int | None = None, negative: PromptEmbeds | None = None,
                           references: Sequence[torch.Tensor] | None = None, family: ModelFamily | None = None,
                           frames: int = 1):
    """A grid of samples from the model being trained, without reloading or re-placing anything.

    `embeds` are the cache's pre-encoded prompts (text encoders stay unloaded); `sample_cfg` is the
    run's [sample] section (seed, steps, guidance, width, height; image i uses seed + i). For a
    family with classifier-free guidance `negative` is the cached embedding of [sample]
    negative_prompt, run batched with the prompts as `leantune sample` does. The memory
    engine is switched to forward-only for the duration (resident set kept across denoising steps)
    and back afterwards; the transformer runs in eval mode (no LoRA dropout) and returns to its
    previous mode. `vae` may be a loader called only now, whose VAE is dropped after decoding.
    `references`: reference latents (1, C, h_r, w_r) every sample is conditioned on (an edit family);
    `family`: the run's (default: the transformer's class's, which cannot tell an edit family).
    The VAE decodes in whatever VRAM the training state leaves, tiled if that is too little.
    `frames` > 1 (a video family): videos of that many frames, decoded by `vae`, the family's causal
    video VAE (ModelFamily.video.load_vae), a latent frame at a time; the grid is then a (T, H, W, 3)
    uint8 array of the videos tiled frame by frame (infer/video.py).
    """
    items = as_embed_list(embeds)
    seeds = [sample_cfg.seed + i for i in range(len(items))]
    was_training = transformer.training
    if memory_handle is not None:
        memory_handle.forward_only(True)
    transformer.eval()
    try:
        schedule = schedule or default_schedule(transformer, family)
        latents = denoise(transformer, items, seeds, width=sample_cfg.width, height=sample_cfg.height,
                          steps=sample_cfg.steps, guidance=sample_cfg.guidance, schedule=schedule,
                          device=device, dtype=dtype, negative=negative, references=references, family=family,
                          frames=frames)
    finally:
        transformer.train(was_training)
        if memory_handle is not None:
            memory_handle.forward_only(False)

    owned = not isinstance(vae, nn.Module)
    model = vae() if owned else vae
    home = next(model.parameters()).device
    video = latents.dim() == 5                # videos: the causal decoder walks time, one latent frame at once
    if not video:
        free = free_device_bytes(device)
        if free is not None and home != torch.device(device):
            free -= vae_weight_bytes(model)
        plan = plan_decode(model, sample_cfg.height, sample_cfg.width, "auto",
                           None if free is None else max(0, free - _DECODE_MARGIN))
    model.to(device)
    try:
        if video:
            from .video import decode_videos, video_grid

            return video_grid(decode_videos(model, latents, device), cols)
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
    "default_schedule",
    "denoise",
    "initial_noise",
    "make_grid",
    "sample_during_training",
    "sample_images",
    "variant_of",
]
