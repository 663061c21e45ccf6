"""`leantune sample`: one request -> PNG files (or, with `frames` for a video family, videos), through the three stages with one model loaded at a time.

The order is what keeps both VRAM and host RAM low: the text encoders are loaded, used and dropped
before the transformer is read from disk; the transformer is dropped before the VAE decodes. The
transformer's placement comes from the same memory engine and planner as training: with a VRAM
budget the planner chooses streamed blocks / fp8 for an inference workload, without one the
explicit [memory] choices apply (default: fully resident). On CUDA each stage's peak reserved
memory is measured and reported, so "the peak is the largest stage" is checked on every run.

What differs between families comes from the family (`ModelFamily.sampling`): with classifier-free
guidance (SD3.5) the negative prompt is encoded in stage 1 beside the prompts, and each transformer
forward carries twice the images (negatives and prompts together), which the planner is told; when
no plan fits the doubled batch, the two halves run one after the other instead.

Videos (`frames` > 1, a video family such as Wan): the planner prices the latent frames (tokens =
frames x patches, one video per forward unless batch_size says more), the family's causal video VAE
decodes a latent frame at a time (infer/video.py, as the training samples are), and each prompt and
seed gets NNNNN-SEED.mp4, its animated .webp preview and a .json sidecar of the request's
parameters. Why a sidecar and not the mp4's own tags: one file describes both the mp4 and its
preview, any tool reads it without ffprobe, and it survives what re-muxing or uploading strips
from container metadata; it holds the keys a PNG's text chunks hold, plus frames and fps.
"""

from __future__ import annotations

import gc
import logging
import re
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..config import ConfigError, parse_size
from ..models.family import get_family, loader_options
from ..models.weights import parking
from .decode import decode_latents, plan_decode, to_pil, vae_weight_bytes
from .encode import encode_prompts_stage, text_encoder_bytes
from .images import format_loras, save_png
from .references import check_first_frame, frame_embeddings, load_reference_images, reference_latents, text_images
from .request import SampleRequest
from .sampler import denoise, free_device_bytes

log = logging.getLogger(__name__)

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# Kept free under a budget for the CUDA context's allocator slack, cuBLAS/cuDNN workspaces.
_MARGIN = 512 * 2**20


@dataclass
class SamplingResult:
    files: list[Path]
    stage_peaks: dict[str, int] = field(default_factory=dict)   # stage -> peak reserved bytes (CUDA only)
    timings: dict[str, float] = field(default_factory=dict)     # stage -> seconds
    plan: object = None                                          # the transformer's memory Plan
    stream_t5: bool = False
    decode_tile: int | None = None                               # latent tile size, None when untiled
    stream_report: dict = field(default_factory=dict)            # the engine's counters for stage 2
    cfg_batched: bool | None = None                              # CFG halves in one forward (None: no CFG)


def pick_device(choice: str) -> torch.device:
    if choice == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device = \"cuda\" but no CUDA device is available")
    if choice == "auto":
        choice = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(choice)


def vram_budget(request: SampleRequest, device: torch.device) -> int | None:
    """The request's VRAM budget in bytes; None when unlimited.

    An explicit size applies on any device: on the CPU the same plan runs with host "slots", which
    is how the budgeted path is tested without a GPU. "auto" means the free VRAM, so none on a CPU.
    """
    text = request.memory.vram_budget
    if text is None:
        return None
    if text == "auto":
        return free_device_bytes(device)
    try:
        return parse_size(text)
    except ValueError as e:
        raise ConfigError(f"memory.vram_budget: {e}") from None


class _Stage:
    """Times a stage and measures its peak reserved device memory."""

    def __init__(self, name: str, device: torch.device, result: SamplingResult):
        self.name, self.device, self.result = name, device, result

    def __enter__(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.result.stage_peaks[self.name] = torch.cuda.max_memory_reserved(self.device)
        self.result.timings[self.name] = time.perf_counter() - self.t0
        return False


def _release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def inference_workload(request: SampleRequest, batch: int, text_len: int, adapter_bytes: int = 0,
                       dora: bool = False, adapter_tensors: tuple = (), references: int = 0,
                       prefix_cache_bytes: int = 0, frames: int = 1):
    """The planner's workload for the denoising stage: `batch` images per transformer forward
    (with classifier-free guidance batched, negatives included), in the weights' dtype without
    autocast; fp8 storage is the planner's call, except under a DoRA adapter (`dora`: it reads the
    base weights themselves, so they stay in the model's dtype). `adapter_bytes`: the frozen
    adapters attached (base adapters and LoRAs), resident on the device beside the plan's weights,
    except the base adapters' weights in `adapter_tensors` ((name, bytes): a streamed block carries
    its own, memory/streaming_units.streams_with_unit). `references`: the reference images every
    forward is conditioned on (priced by a family whose probe takes them); `prefix_cache_bytes`:
    what the family's prefix caches hold while it denoises (Sampling.prefix_cache_bytes); `frames`:
    latent frames per sample (a video: each is a bucket's tokens again)."""
    from ..planner.from_config import fp8_modulation_choice
    from ..planner.workload import Workload

    return Workload(mode="inference", batch_size=batch, buckets=((request.height, request.width),),
                    text_length=text_len, autocast=False, dtype=_DTYPES[request.model.dtype],
                    fp8_modulation=False if dora else fp8_modulation_choice(request.memory),
                    allow_fp8=not dora, frozen_adapter_bytes=adapter_bytes, frozen_adapter_tensors=adapter_tensors,
                    references=references, prefix_cache_bytes=prefix_cache_bytes, frames=frames)


def transformer_plan(request: SampleRequest, transformer, device: torch.device, budget: int | None, n_images: int,
                     text_len: int, cfg: bool = False, adapter_bytes: int = 0, dora: bool = False,
                     adapter_tensors: tuple = (), references: list | None = None, frames: int = 1):
    """The memory Plan for the denoising stage, and whether CFG's two halves share a forward.

    Under a budget it is the planner's, for an inference workload of the images per forward
    (twice as many with classifier-free guidance: negatives and prompts in one batch; when no plan
    fits that, the halves run one after the other and the planner is asked for the single batch).
    Without a budget the explicit [memory] choices apply and CFG runs batched, as the pipelines do.
    `references`: the reference latents (1, C, h, w) every image is conditioned on; they and a
    family's prefix cache (Sampling.prefix_cache_bytes: one cache per half, batched or not) are
    priced beside the activations. `frames`: latent frames per sample (1: images).
    """
    from ..models.family import prices_references

    family = get_family(request.model.family)
    spec = family.spec
    references = list(references or [])
    if budget is not None:
        from ..planner.from_config import plan_memory
        from ..planner.workload import Budget, InfeasibleBudget

        images = request.batch_size or n_images
        ram = None
        try:
            ram = parse_size(request.memory.ram_budget) if request.memory.ram_budget else None
        except ValueError as e:
            raise ConfigError(f"memory.ram_budget: {e}") from None
        error = None
        cache_bytes = 0
        if family.sampling.prefix_cache_bytes is not None:        # 0 for a model that keeps none
            cache_bytes = family.sampling.prefix_cache_bytes(
                dict(transformer.config), (2 if cfg else 1) * images, text_len,
                [tuple(r.shape[-2:]) for r in references], _DTYPES[request.model.dtype])
        priced_refs = len(references) if prices_references(family) else 0
        for factor in ((2, 1) if cfg else (1,)):
            workload = inference_workload(request, factor * images, text_len, adapter_bytes, dora, adapter_tensors,
                                          references=priced_refs, prefix_cache_bytes=cache_bytes, frames=frames)
            try:
                return plan_memory(spec, transformer, workload, Budget(vram=budget, ram=ram)), factor == 2
            except InfeasibleBudget as e:
                error = e
                if factor == 2:
                    log.info("sample: classifier-free guidance's doubled batch fits no plan under %s (%s); "
                             "the negative and positive halves run one after the other",
                             request.memory.vram_budget, e)
            except ValueError as e:
                raise ConfigError(f"memory.vram_budget = {request.memory.vram_budget!r}: {e}") from None
        if device.type != "cpu":
            raise ConfigError(f"memory.vram_budget = {request.memory.vram_budget!r}: {error}") from None
        # On the CPU there is no VRAM to run out of: a budget only shapes how blocks stream
        # through host memory, and one that no plan fits is set aside rather than refused.
        log.warning("memory.vram_budget = %r: no plan fits it, and on the CPU a VRAM budget does not apply; "
                    "ignored (the model runs from host memory as [memory] says)", request.memory.vram_budget)
    from ..memory.engine import resolve_plan

    return resolve_plan(request.memory, spec, transformer), True


class FolderComponents:
    """The models of a request's [model] section, loaded from disk one at a time by its family."""

    def __init__(self, request: SampleRequest):
        self._fl = fl = get_family(request.model.family)
        self._options = loader_options(request.memory)     # a file's e4m3 modulation stays e4m3 unless asked
        if request.memory.base_format in ("nf4", "int8"):   # the block Linears quantized as the file is read
            self._options = self._options | {"quantize_fp8": request.memory.base_format}
        model_cfg = request.model
        folder = request.resolve(request.model.path)
        if request.base is not None:          # another checkpoint of the family (models/other_base.py)
            from ..models.other_base import check_other_base, other_base_config

            folder = request.resolve(request.base)       # its scheduler config, where it is a folder
            check_other_base(request.model, folder, "base")
            model_cfg = other_base_config(request.model, folder)
        self.sources = fl.resolve_sources(model_cfg, Path(request.base_dir))
        self.schedule_folder = folder if folder.is_dir() else None   # scheduler/scheduler_config.json

    def text_encoders(self, dtype: torch.dtype):
        return self._fl.load_text_encoders(self.sources, dtype, "cpu")

    def transformer(self, dtype: torch.dtype):
        return self._fl.load_transformer(self.sources, dtype, "cpu", **self._options)

    def meta_transformer(self, dtype: torch.dtype):
        """The transformer built on meta (shapes and dtypes, no weight read): which blocks the disk
        tier takes is decided on it before the load (_disk_tier)."""
        return self._fl.load_transformer(self.sources, dtype, "meta", **self._options)

    def vae(self, dtype: torch.dtype, device):
        return self._fl.load_vae(self.sources, dtype, device)

    def video_vae(self, dtype: torch.dtype, device):
        """The family's causal video VAE (ModelFamily.video), which decodes a video's latent frames."""
        return self._fl.video.load_vae(self.sources, dtype, device)


def _disk_tier(request: SampleRequest, components, spec, dtype: torch.dtype, budget: int | None) -> tuple:
    """apply_memory's disk tier options for [memory] disk_dir and the loading file the disk-tier
    blocks are loaded straight into (memory/disk_load.py): ({}, None) without a disk_dir. The
    explicit [memory] choices only: the streamed blocks beyond ram_budget less the process
    baseline go to disk, decided on the meta-built transformer before the load with the engine's
    own rule. Under a vram_budget the sampler's planner prices no disk (yet): disk_dir is unused."""
    if request.memory.disk_dir is None:
        return {}, None
    from ..config import check_disk_dir

    folder = request.resolve(request.memory.disk_dir)
    try:                                              # missing, not a folder, unwritable
        check_disk_dir(folder, f"memory.disk_dir = {request.memory.disk_dir!r}")
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if budget is not None:
        log.warning("memory.disk_dir: unused under a vram_budget (the sampler's planner prices no disk tier "
                    "yet); without one the streamed blocks beyond ram_budget are read from it")
        return {}, None
    from ..memory.disk_load import BlockSpill, blocks_for_room
    from ..memory.engine import resolve_plan
    from ..planner.from_config import explicit_disk_room

    room = explicit_disk_room(request.memory)
    options = {"disk_dir": folder, "disk_room": room}
    meta = getattr(components, "meta_transformer", None)
    if meta is None:                                  # models made in memory (a benchmark's): steps only
        return options, None
    model = meta(dtype)
    blocks = blocks_for_room(model, spec, resolve_plan(request.memory, spec, model), room)
    if not blocks:
        return options, None
    spill = BlockSpill(folder, blocks)
    return options | {"parked": spill}, spill


def run_sampling(request: SampleRequest, progress: Callable[[int, int], None] | None = None,
                 components=None) -> SamplingResult:
    """Generate every image of `request` and write them as PNGs with their parameters (with
    `frames` > 1: videos, each an .mp4, its .webp preview and a .json of its parameters).

    `components` supplies the models (default: `FolderComponents(request)`, from disk); anything with
    the same four members works (a video request also asks for `video_vae`), e.g. the benchmark's random full-size weights. Each model is asked
    for only when its stage starts, and dropped when it ends.
    """
    from ..memory.engine import apply_memory
    from .loras import apply_loras

    device = pick_device(request.device)
    dtype = _DTYPES[request.model.dtype]
    family = get_family(request.model.family)
    cfg_family = family.sampling.guidance == "cfg"
    if request.negative_prompt and not cfg_family:
        raise ConfigError(f"negative_prompt: {request.model.family} samples with distilled guidance (no "
                          f"classifier-free guidance), so a negative prompt would have no effect; remove it")
    video = request.frames > 1                 # the schema checked the length against the family
    latent_frames = family.video.latent_frames(request.frames) if video else 1
    budget = vram_budget(request, device)
    prompts, seeds = request.expanded_prompts(), request.seeds()
    loras = [(request.resolve(ref.path), ref.strength) for ref in request.lora]
    for path, _ in loras:
        if not path.is_file():
            head, sep, tail = str(path).rpartition(":")
            if sep and Path(head).is_file():     # 'file:abc': the file exists, the strength is no number
                raise ConfigError(f"lora: {path}: strength {tail!r} is not a number (FILE:STRENGTH, e.g. {head}:0.8)")
            raise ConfigError(f"lora: {path}: no such LoRA file")
    base_adapters = []
    if request.model.base_adapters:           # read and checked before any model is read
        from ..train.base_adapters import read_adapters

        base_adapters = read_adapters(request.model.base_adapters, request.resolve, family.spec.lora_keys,
                                      "[model] base_adapters")
    ref_paths = [request.resolve(p) for p in request.references]
    ref_images = load_reference_images(ref_paths, family)      # checked before any model is read
    components = components or FolderComponents(request)
    check_first_frame(family, getattr(components, "sources", None), ref_images)   # an image-to-video model's
    result = SamplingResult(files=[])

    # Stage 1: encode every prompt (and the negative prompt under CFG); T5 runs block by block when
    # the text encoders together exceed the budget.
    with _Stage("encode", device, result):
        encoders = components.text_encoders(dtype)
        needed = text_encoder_bytes(encoders, family) + _MARGIN
        result.stream_t5 = budget is not None and needed > budget
        encoded = encode_prompts_stage(encoders, prompts, max_length=request.max_text_length, device=device,
                                       stream_t5=result.stream_t5, family=family,
                                       # one copy per image, batched as the prompts: the pipeline's
                                       # rounding (a lone row can round its pooled output differently)
                                       negative_prompts=[request.negative_prompt] * len(prompts) if cfg_family
                                       else None, images=text_images(ref_images, family))
        embeds, negative = encoded if cfg_family else (encoded, None)
        del encoders, encoded
        _release(device)

    # Stage 1b (an edit family): the reference images' latents, the VAE loaded for them alone.
    references = []
    if ref_images:
        with _Stage("references", device, result):
            vae = components.vae(dtype, device)
            references = reference_latents(vae, ref_images, family, width=request.width, height=request.height,
                                           frames=request.frames)
            del vae
            _release(device)
            # a model that reads the first frame's image embedding too (Wan 2.1 I2V's CLIP): after the condition
            references += frame_embeddings(family, getattr(components, "sources", None), ref_images, dtype, device)
            _release(device)

    # Stage 2: denoise; LoRAs first, then the engine places the model (adapters must exist before it).
    with _Stage("denoise", device, result):
        t0 = time.perf_counter()
        disk, spill = _disk_tier(request, components, family.spec, dtype, budget)
        try:
            with parking(spill) if spill is not None else nullcontext():
                transformer = components.transformer(dtype).eval().requires_grad_(False)
        except BaseException:
            if spill is not None:
                spill.close()
            raise
        if spill is not None:
            log.info("sample: %d blocks (%.2f GB) loaded straight to the disk tier (%s)", spill.parked_blocks,
                     spill.parked_bytes / 2**30, request.memory.disk_dir)
        variant = request.model.variant if request.model.variant != "auto" else family.sampling.variant(transformer)
        schedule = family.sampling.schedule(variant, components.schedule_folder)
        steps = request.steps or schedule.default_steps
        guidance = schedule.default_guidance if request.guidance is None else request.guidance
        cfg = cfg_family and family.sampling.guides(guidance)   # as the pipeline (most: a scale of 1 or less is none)
        if base_adapters:                      # frozen, under the LoRAs (train/base_adapters.py)
            from ..train.base_adapters import BaseAdapterStack

            BaseAdapterStack(transformer, base_adapters)
        if loras:
            apply_loras(transformer, loras)
        adapters = sum(p.numel() * p.element_size() for n, p in transformer.named_parameters()
                       if re.search(r"\.(lora_|lokr_|hada_)", n))
        dora = any(".lora_magnitude_vector." in n for n, _ in transformer.named_parameters())
        from ..memory.streaming_units import streams_with_unit       # the base adapters travel with their block

        travel = tuple((n, p.numel() * p.element_size()) for n, p in transformer.named_parameters()
                       if streams_with_unit(n, p))
        # a video's forward holds one video unless batch_size says more (as denoise runs them)
        result.plan, batched = transformer_plan(request, transformer, device, budget, 1 if video else len(prompts),
                                                embeds[0].t5.shape[1], cfg=cfg, adapter_bytes=adapters, dora=dora,
                                                adapter_tensors=travel, references=references,
                                                frames=latent_frames)
        result.cfg_batched = batched if cfg else None
        log.info("sample: %s%s", result.plan.describe(),
                 "" if not cfg else f"; CFG {guidance:g}, halves {'batched' if batched else 'one after the other'}")
        t1 = time.perf_counter()
        try:
            handle = apply_memory(transformer, family.spec, result.plan, device, **disk)
        finally:
            if spill is not None:
                spill.close()
        if handle.streaming is not None and handle.streaming.disk_blocks:
            log.info("sample: %d streamed blocks read from disk (%s)", len(handle.streaming.disk_blocks),
                     request.memory.disk_dir)
        handle.forward_only(True)
        t2 = time.perf_counter()
        try:
            latents = denoise(transformer, embeds, seeds, width=request.width, height=request.height, steps=steps,
                              guidance=guidance, schedule=schedule, device=device, dtype=dtype,
                              batch_size=request.batch_size, progress=progress, family=family,
                              negative=negative, cfg_batched=batched, references=references or None,
                              frames=request.frames)
            result.stream_report = handle.step_report(wait=True)
        finally:
            # release(), not remove(): restoring would copy every streamed weight onto the device
            # (out of memory under a budget) and dequantize fp8 weights, all for a model dropped
            # right here. release() waits for the copies still in flight (the ring prefetches the
            # next step), then frees host buffers, pins and slots.
            handle.release()
        result.timings.update({"denoise.load": t1 - t0, "denoise.place": t2 - t1,
                               "denoise.steps": time.perf_counter() - t2})
        del transformer, handle
        _release(device)

    # Stage 3: decode, tiled when the budget left after the VAE's weights is too small (a video:
    # the causal VAE's own loop, a latent frame at a time, untiled).
    with _Stage("decode", device, result):
        if video:
            from .video import decode_videos

            vae = components.video_vae(dtype, device)
            images = decode_videos(vae, latents, device)           # one uint8 (T, H, W, 3) per video
        else:
            vae = components.vae(dtype, device)
            available = None if budget is None else max(0, budget - vae_weight_bytes(vae) - _MARGIN)
            plan = plan_decode(vae, request.height, request.width, request.vae_tiling, available)
            result.decode_tile = plan.tile_latent
            images = to_pil(decode_latents(vae, latents, device, plan))
        del vae
        _release(device)

    out_dir = request.resolve(request.out)
    base = _next_index(out_dir)
    lora_text = format_loras([(str(p), s) for p, s in loras])
    for i, (img, prompt, seed) in enumerate(zip(images, prompts, seeds)):
        meta = {"prompt": prompt, "seed": str(seed), "steps": str(steps), "guidance": f"{guidance:g}",
                "width": str(request.width), "height": str(request.height), "loras": lora_text,
                "model": request.model.path, "variant": variant}
        if request.base is not None:
            meta["base"] = str(request.resolve(request.base))
        if base_adapters:
            meta["base_adapters"] = format_loras([(str(a.path), a.strength) for a in base_adapters])
        if cfg_family:
            meta["negative_prompt"] = request.negative_prompt
        if ref_paths:
            meta["references"] = ", ".join(str(p) for p in ref_paths)
        stem = out_dir / f"{base + i:05d}-{seed}"
        if video:
            result.files.append(_save_video(img, stem, meta, family.video.fps))
        else:
            result.files.append(save_png(img, stem.with_suffix(".png"), meta))
    return result


def _save_video(frames, stem: Path, meta: dict, fps: float) -> Path:
    """STEM.mp4, its STEM.webp preview and STEM.json (the parameters, the PNG's keys plus frames
    and fps; written last, so a sidecar always describes a finished video). Returns the mp4."""
    from ..io import atomic_write_json
    from . import video as video_out

    mp4, preview = video_out.save_video(frames, stem.with_suffix(".mp4"), fps)
    atomic_write_json(stem.with_suffix(".json"), {**meta, "frames": str(len(frames)), "fps": f"{fps:g}",
                                                  "video": mp4.name, "preview": preview.name})
    return mp4


def _next_index(out_dir: Path) -> int:
    """The first file number not used by an earlier run in `out_dir` (files are never overwritten)."""
    used = [int(p.name.split("-", 1)[0]) for p in out_dir.glob("*")
            if p.suffix in (".png", ".mp4") and p.name.split("-", 1)[0].isdigit()]
    return max(used) + 1 if used else 0


__all__ = ["FolderComponents", "SamplingResult", "inference_workload", "pick_device", "run_sampling",
           "transformer_plan", "vram_budget"]
