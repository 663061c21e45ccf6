"""Latent and text-embedding caches on disk, and the batches the trainer reads from them.

Why cache. A LoRA step needs only the VAE latents of its images and the text encoders' outputs
for its captions; the VAE (~170 MB) and T5-XXL (~9.5 GB in bf16) would otherwise sit in VRAM for
the whole run. `prepare_caches` computes each missing entry once, writes it, and frees the
encoders before training starts; a run whose entries are all present never loads them at all.

Keys. An entry's file name is a hash of everything that determines its content, so stale
entries cannot be served:
  latent: image bytes (sha256) + bucket + VAE identity + compute dtype + cache format version
  text:   caption + identities of both encoders and tokenizers + max T5 length + dtype + version
  clip:   clip bytes (sha256) + source fps + (width, height, frames) bucket + target fps + start
          + VAE identity + dtype + version (clip_latent_key; entries (C, T', h, w), streamed in
          through Wan's causal VAE by data/video_vae.py)
Identities come from `leantune.models.flux.loading.fingerprint` (a content-derived hash of the
component's files), so a replaced VAE or encoder invalidates its entries without comparing
weights. An edited caption or image simply hashes to a new key and is encoded on the next run.
Old entries are left in place (another config may share the folder).

Layout. One safetensors file per entry, `<cache_dir>/latents/<key>.safetensors` and
`<cache_dir>/text/<key>.safetensors`, written atomically: a crash mid-pass loses at most the
entry being written, and entries are read lazily per batch, so host RAM does not grow with the
dataset. Tensors are stored in bf16 (half of fp32; the encoders' outputs carry no more precision
than that anyway). T5 outputs are stored trimmed to the prompt's token count (end token
included); a batch pads them with zeros to its longest prompt. Each entry's header repeats its
key (and the caption, for text), so a renamed or mixed-up file is detected.

Every present entry is read and checked before training (readable, expected keys, shapes,
dtype, finite values, matching header); a bad one is reported in one warning naming its file and
recomputed.
"""

from __future__ import annotations

import gc
import hashlib
import json
import logging
import math
import warnings
from collections import Counter
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Callable, Iterator, Sequence

import torch

from leantune.config import resolve_path
from leantune.data.buckets import SIDE_MULTIPLE, Bucket, BatchOrder, bucket_sizes, fit_to_bucket, nearest_bucket
from leantune.data.dataset import DataWarning, ImageItem, VideoItem, listing, scan_datasets, to_tensor
from leantune.data.reading import load_image
from leantune.io import load_safetensors, save_safetensors
from leantune.models.family import ModelFamily, PromptEmbeds, get_family
from leantune.models.component_loading import dtype_from_name, fingerprint
from leantune.memory.lockstep import run_pass, state_budget
from leantune.models.streamed_encoder import text_encoder_ram_budget

log = logging.getLogger(__name__)

# Bump when what an entry holds for a given key changes (resize filter, scaling, trimming rule).
FORMAT_VERSION = "1"
STORE_DTYPE = torch.bfloat16
TEXT_BATCH = 8   # captions per text-encoder call: enough to amortise launches, small for 8 GB cards
# Captions per lock-step pass (memory/lockstep.py): a streamed encoder's batches of TEXT_BATCH run
# layer-major, each layer moved (or read from its files) once per pass instead of once per batch.
# Between layers every batch of the pass keeps its hidden states on the device; lockstep admits
# batches within half the free device memory (every layer's output counted as kept), the rest go
# in further rounds. The cap bounds what the waiting batches hold: their embedded captions.
TEXT_PASS = 128


class CacheError(ValueError):
    """A cache entry could not be read while training, naming the file."""


class CacheWarning(UserWarning):
    """Corrupt cache entries were found and recomputed."""


@dataclass
class CacheStats:
    hits: int = 0          # present and valid: reused
    misses: int = 0        # absent: computed
    recomputed: int = 0    # present but corrupt: computed again

    def __str__(self) -> str:
        return f"{self.hits} hits, {self.misses} misses, {self.recomputed} recomputed"


@dataclass(frozen=True)
class Sample:
    """One unit of an epoch: an image at one training resolution (repeats appear as copies)."""

    item: ImageItem
    resolution: int
    bucket: Bucket
    latent_key: str
    # reference images (an edit dataset): their latent entries, one per reference slot, and their
    # content hashes when the family's text encoder sees them (the text entry's identity)
    reference_keys: tuple[str, ...] = ()
    text_refs: tuple[str, ...] = ()
    reference_sizes: tuple[Bucket, ...] = ()   # (width, height) each reference is encoded at
    mask_key: str | None = None   # its loss mask's entry (a masked dataset's; data/masks.py)
    mask_floor: float = 0.0       # the loss weight where that mask is black
    prior: bool = False           # of a [[data.datasets]] role = "prior" (train/priors.py)


@dataclass
class Batch:
    """What one training step consumes. All tensors on CPU; the trainer moves them."""

    latents: torch.Tensor       # (B, 16, h, w), h = bucket height / 8; a batch of clips (B, 16, T', h, w)
    embeds: PromptEmbeds        # t5 (B, L, D_t5) zero-padded to the batch's longest prompt; pooled (B, D_clip)
    bucket: Bucket              # (width, height) in pixels; a clip batch's (width, height, frames)
    captions: list[str]         # as trained: "" where caption dropout fired
    t5_lengths: torch.Tensor | None = None   # (B,) real T5 tokens per sample, end token included
    references: list[torch.Tensor] | None = None   # per reference slot (B, C, h_r, w_r); None: no references
    # (B, 1, h, w) float32 loss weight per latent cell (data/masks.py); None: no sample of the batch is masked
    loss_weights: torch.Tensor | None = None
    prior: bool = False          # a batch of prior images: trained with [data] prior_loss (train/priors.py)


# -- identities and keys -------------------------------------------------------------------------

def component_identity(path: str | Path | None) -> str:
    """The identity of one model component for cache keys ("none" when it has no source)."""
    return "none" if path is None else fingerprint(path)


def _digest(*parts) -> str:
    return hashlib.sha256(json.dumps([FORMAT_VERSION, *parts], ensure_ascii=False).encode()).hexdigest()[:40]


def latent_key(image_sha256: str, bucket: Bucket, vae_id: str, dtype: torch.dtype) -> str:
    return _digest("latent", image_sha256, list(bucket), vae_id, str(dtype))


def text_key(caption: str, encoders_id: str, max_length: int, dtype: torch.dtype) -> str:
    return _digest("text", caption, encoders_id, max_length, str(dtype))


def mask_key(mask_sha256: str, bucket: Bucket, vae_scale_factor: int) -> str:
    return _digest("mask", mask_sha256, list(bucket), vae_scale_factor)


ClipBucket = tuple[int, int, int]   # (width, height, frames): a batch of clips shares all three


def _rate(fps) -> str:
    """A frame rate as an exact fraction ("16", "30000/1001"), so 16 and 16.0 key alike."""
    return str(Fraction(fps).limit_denominator(1_000_000))


def clip_latent_key(clip_sha256: str, source_fps, bucket: ClipBucket, target_fps, start_s: float, vae_id: str,
                    dtype: torch.dtype) -> str:
    """A clip's latent entry: its bytes, its source rate (an image sequence's is a setting, not in its
    bytes), the frames picked (target_fps, start, the frame bucket) and the size, VAE and dtype.

    [data] max_frames enters through the frame bucket: a change that leaves a clip's window as it
    was (a clip shorter than both caps) reuses its entry, since the latents are the same.
    """
    return _digest("clip-latent", clip_sha256, _rate(source_fps), list(bucket), _rate(target_fps), float(start_s),
                   vae_id, str(dtype))


def clip_bucket(item: VideoItem, resolution: int, multiple: int = SIDE_MULTIPLE) -> ClipBucket:
    """The bucket a clip trains in at `resolution`: its aspect bucket (as an image's, sides multiples
    of `multiple`) and its frame bucket (`item.num_frames`, video.frame_bucket at [data] target_fps
    and max_frames)."""
    w, h = nearest_bucket(item.width, item.height, bucket_sizes(resolution, multiple=multiple))
    return (w, h, item.num_frames)


def clip_latent_shape(bucket: ClipBucket, channels: int, spatial: int, temporal: int = 4) -> tuple[int, int, int, int]:
    """(C, T', h, w) of a clip's latents: 4k+1 frames -> k+1 latent frames (first frame alone)."""
    w, h, frames = bucket
    return (channels, 1 + (frames - 1) // temporal, h // spatial, w // spatial)


# -- model sources and loaders -------------------------------------------------------------------

def model_dtype(model_cfg) -> torch.dtype:
    """The compute dtype [model] dtype names; part of every cache key, so `train` and `cache` must agree."""
    return dtype_from_name(model_cfg.dtype)


def _release(device) -> None:
    """Return freed encoder memory now, before the transformer is loaded."""
    gc.collect()
    if torch.device(device).type == "cuda" and torch.cuda.is_available():
        torch.cuda.empty_cache()


# -- encoding ------------------------------------------------------------------------------------

@torch.no_grad()
def encode_latent(vae, pixels: torch.Tensor) -> torch.Tensor:
    """(3, H, W) in [-1, 1] -> Flux latents (16, H/8, W/8): the posterior mean, shifted and scaled.

    The mean rather than a sample: caching a sample would freeze one draw of noise for the whole
    run, and the VAE's posterior variance is tiny next to the flow-matching noise anyway.
    """
    x = pixels[None].to(device=vae.device, dtype=vae.dtype)          # (1, 3, H, W)
    mean = vae.encode(x).latent_dist.mean                             # (1, 16, H/8, W/8)
    shift = vae.config.shift_factor or 0.0
    return ((mean - shift) * vae.config.scaling_factor)[0]


def image_pixels(item: ImageItem, bucket: Bucket, rgba: bool = False) -> torch.Tensor:
    """The image as trained in `bucket`: (3, bucket height, bucket width) in [-1, 1]; (4, ...) with
    its alpha for a family that trains on it (ModelFamily.rgba)."""
    return to_tensor(fit_to_bucket(load_image(item.path, rgba), bucket))


def _trim(t5: torch.Tensor, length: int, padding_side: str) -> torch.Tensor:
    """(L_max, D) -> (length, D): keep the real tokens (end token included), drop padding."""
    return t5[-length:] if padding_side == "left" else t5[:length]


# -- entry checks --------------------------------------------------------------------------------

def _read(path: Path) -> tuple[dict, dict]:
    try:
        return load_safetensors(path)
    except ValueError as e:
        raise CacheError(str(e)) from None


def _check_tensor(name: str, t: torch.Tensor | None, ndim: int) -> str | None:
    if t is None:
        return f"missing tensor '{name}'"
    if t.dtype != STORE_DTYPE:
        return f"tensor '{name}' is {t.dtype}, expected {STORE_DTYPE}"
    if t.dim() != ndim:
        return f"tensor '{name}' has shape {tuple(t.shape)}, expected {ndim} dimensions"
    if not torch.isfinite(t).all():
        return f"tensor '{name}' holds NaN or infinite values"
    return None


def _read_keyed(path: Path, key: str) -> tuple[dict, str | None]:
    """An entry's tensors, or what is wrong with the file (unreadable, another key in its header)."""
    try:
        tensors, meta = _read(path)
    except CacheError as e:
        return {}, str(e)
    if meta.get("key") != key:
        return {}, f"header key {meta.get('key')!r} does not match the file name"
    return tensors, None


def check_latent_entry(path: Path, key: str, bucket: Bucket, family: ModelFamily) -> str | None:
    """None if the latent entry at `path` is sound for `key` and `bucket`, else what is wrong."""
    tensors, problem = _read_keyed(path, key)
    if problem:
        return problem
    lat = tensors.get("latent")
    problem = _check_tensor("latent", lat, 3)
    if problem:
        return problem
    f = family.vae_scale_factor
    expected = (family.latent_channels, bucket[1] // f, bucket[0] // f)
    if tuple(lat.shape) != expected:
        return f"tensor 'latent' has shape {tuple(lat.shape)}, expected {expected} for bucket {bucket[0]}x{bucket[1]}"
    return None


def check_clip_latent_entry(path: Path, key: str, shape: tuple[int, int, int, int]) -> str | None:
    """None if the clip latent entry at `path` is sound for `key` and of `shape` (clip_latent_shape)."""
    tensors, problem = _read_keyed(path, key)
    if problem:
        return problem
    lat = tensors.get("latent")
    problem = _check_tensor("latent", lat, len(shape))
    if problem:
        return problem
    if tuple(lat.shape) != tuple(shape):
        return f"tensor 'latent' has shape {tuple(lat.shape)}, expected {tuple(shape)}"
    return None


def check_mask_entry(path: Path, key: str, bucket: Bucket, vae_scale_factor: int) -> str | None:
    """None if the mask entry at `path` is sound for `key` and `bucket`, else what is wrong."""
    tensors, problem = _read_keyed(path, key)
    if problem:
        return problem
    grid = tensors.get("mask")
    expected = (1, bucket[1] // vae_scale_factor, bucket[0] // vae_scale_factor)
    if grid is None:
        return "missing tensor 'mask'"
    if grid.dtype != torch.float32 or tuple(grid.shape) != expected:
        return f"tensor 'mask' is {grid.dtype} {tuple(grid.shape)}, expected float32 {expected}"
    if not torch.isfinite(grid).all() or grid.min() < 0 or grid.max() > 1:
        return "tensor 'mask' holds values outside [0, 1]"
    return None


def check_text_entry(path: Path, key: str, caption: str, max_length: int | None) -> tuple[str | None, tuple[int, int] | None]:
    """(problem or None, (D_t5, D_clip)) for the text entry at `path`; `max_length`: the most rows
    its sequence may have (the family's `text_rows` of [data] max_text_length; None for a family that
    cuts no caption, ModelFamily.cuts_text: any length its header states)."""
    try:
        tensors, meta = _read(path)
    except CacheError as e:
        return str(e), None
    if meta.get("key") != key:
        return f"header key {meta.get('key')!r} does not match the file name", None
    if _caption_header(caption) != {k: meta.get(k) for k in _caption_header(caption)}:
        return "header caption does not match the caption it is keyed by", None
    t5, pooled = tensors.get("t5"), tensors.get("pooled")
    problem = _check_tensor("t5", t5, 2) or _check_tensor("pooled", pooled, 1)
    if problem:
        return problem, None
    try:
        length = int(meta.get("length", "-1"))
    except ValueError:
        length = -1
    if not 1 <= length <= (max_length if max_length is not None else length) or t5.shape[0] != length:
        return (f"tensor 't5' has {t5.shape[0]} tokens but the header says {meta.get('length')!r}"
                + (f" (at most {max_length})" if max_length is not None else "")), None
    return None, (t5.shape[1], pooled.shape[0])


HEADER_CAPTION_CHARS = 256     # longer captions are identified in a cache header by their sha256


def _caption_header(caption: str) -> dict[str, str]:
    """What a text entry's header says of its caption: the caption itself when short, else its
    start and sha256, so headers stay small (they are read whole to check every entry)."""
    if len(caption) <= HEADER_CAPTION_CHARS:
        return {"caption": caption}
    return {"caption_start": caption[:HEADER_CAPTION_CHARS],
            "caption_sha256": hashlib.sha256(caption.encode()).hexdigest()}


def _warn_corrupt(kind: str, bad: list[tuple[Path, str]]) -> None:
    if bad:
        # A problem from load_safetensors already starts with the path: do not print it twice.
        lines = "\n  ".join(f"{p}: {why.removeprefix(f'{p}: ')}" for p, why in bad)
        warnings.warn(f"recomputing {len(bad)} corrupt {kind} cache entr{'y' if len(bad) == 1 else 'ies'}:\n  {lines}",
                      CacheWarning, stacklevel=3)


# -- the cache pass ------------------------------------------------------------------------------

def _fill_latents(jobs: dict[str, tuple[ImageItem, Bucket]], folder: Path, sources, dtype, device,
                  load_vae: Callable, family: ModelFamily) -> CacheStats:
    stats, todo, bad = CacheStats(), [], []
    for key, (item, bucket) in jobs.items():
        path = folder / f"{key}.safetensors"
        if not path.exists():
            stats.misses += 1
            todo.append(key)
            continue
        problem = check_latent_entry(path, key, bucket, family)
        if problem:
            bad.append((path, problem))
            stats.recomputed += 1
            todo.append(key)
        else:
            stats.hits += 1
    _warn_corrupt("latent", bad)
    if not todo:
        return stats
    log.info("cache: encoding %d image(s) with the VAE", len(todo))
    vae = load_vae(sources, dtype, device)
    try:
        for key in todo:
            item, bucket = jobs[key]
            latent = encode_latent(vae, image_pixels(item, bucket, family.rgba))     # (16, h, w)
            save_safetensors({"latent": latent.to(STORE_DTYPE)}, folder / f"{key}.safetensors",
                             {"format": FORMAT_VERSION, "kind": "latent", "key": key,
                              "bucket": f"{bucket[0]}x{bucket[1]}", "source": str(item.path)})
    finally:
        del vae
        _release(device)
    return stats


@dataclass(frozen=True)
class ClipSample:
    """One unit of an epoch for a clip: a clip at one training resolution (repeats appear as copies)."""

    item: VideoItem
    resolution: int
    bucket: ClipBucket
    latent_key: str
    prior: bool = False
    # what a batch reads of an image's Sample, none of which a clip has
    reference_keys: tuple[str, ...] = ()
    text_refs: tuple[str, ...] = ()
    reference_sizes: tuple = ()
    mask_key: str | None = None
    mask_floor: float = 0.0


def clip_samples(clips: list[VideoItem], data_cfg, vae_id: str, dtype: torch.dtype, start_s: float = 0.0,
                 multiple: int = SIDE_MULTIPLE) -> tuple[list[ClipSample], dict[str, tuple[VideoItem, ClipBucket]]]:
    """The clips' samples over [data] resolutions (skipping those min_size rules out), and their
    latent jobs (key -> (clip, bucket)); clips of one aspect and frame bucket share a batch."""
    samples: list[ClipSample] = []
    jobs: dict[str, tuple[VideoItem, ClipBucket]] = {}
    for item in clips:
        prior = item.dataset < len(data_cfg.datasets) and data_cfg.datasets[item.dataset].role == "prior"
        for res in data_cfg.resolutions:
            if res in item.too_small_for:
                continue
            bucket = clip_bucket(item, res, multiple)
            key = clip_latent_key(item.sha256, item.fps, bucket, data_cfg.target_fps, start_s, vae_id, dtype)
            jobs[key] = (item, bucket)
            samples.extend([ClipSample(item, res, bucket, key, prior)] * item.repeats)
    return samples, jobs


def _clip_shape(family: ModelFamily, bucket: ClipBucket) -> tuple[int, int, int, int]:
    """(C, T', h, w) of a clip entry of `family` (a video family) in `bucket`."""
    return clip_latent_shape(bucket, family.latent_channels, family.vae_scale_factor, family.video.temporal_factor)


def _encode_clip_entry(vae, item: VideoItem, bucket: ClipBucket, target_fps, start_s: float) -> torch.Tensor:
    """A clip's normalised Wan latents (C, T', h, w), streamed from its file (data/video_vae.py)."""
    from leantune.data.video_vae import encode_clip

    return encode_clip(vae, item.path, target_fps=target_fps, num_frames=bucket[2], start_s=start_s,
                       size=bucket[:2], sequence_fps=item.fps)


def fill_clip_latents(jobs: dict[str, tuple[VideoItem, ClipBucket]], folder: Path, sources, dtype, device,
                      load_vae: Callable, target_fps, shape: Callable[[ClipBucket], tuple], start_s: float = 0.0,
                      encode: Callable = _encode_clip_entry, kind: str = "clip-latent") -> tuple[CacheStats, set[str]]:
    """Encode every missing or corrupt clip entry; (stats, keys of clips that failed to decode).

    The VAE is loaded only when an entry is missing. A clip that probed fine but fails while its
    frames are decoded (a damaged stream, fewer frames than its packets said) is skipped with one
    warning naming it, and its key returned so its samples are dropped; the pass goes on.
    `shape(bucket)`: the latent shape an entry must have (clip_latent_shape with the family's factors).
    """
    from leantune.data.video import ClipError

    stats, todo, bad = CacheStats(), [], []
    for key, (item, bucket) in jobs.items():
        path = folder / f"{key}.safetensors"
        if not path.exists():
            stats.misses += 1
            todo.append(key)
            continue
        problem = check_clip_latent_entry(path, key, shape(bucket))
        if problem:
            bad.append((path, problem))
            stats.recomputed += 1
            todo.append(key)
        else:
            stats.hits += 1
    _warn_corrupt("clip latent", bad)
    failed: dict[str, str] = {}
    if not todo:
        return stats, set()
    log.info("cache: encoding %d clip(s) with the VAE", len(todo))
    vae = load_vae(sources, dtype, device)
    try:
        for key in todo:
            item, bucket = jobs[key]
            try:
                latent = encode(vae, item, bucket, target_fps, start_s)
            except ClipError as e:
                failed[key] = str(e)
                continue
            save_safetensors({"latent": latent.to(STORE_DTYPE)}, folder / f"{key}.safetensors",
                             {"format": FORMAT_VERSION, "kind": kind, "key": key,
                              "bucket": "x".join(str(v) for v in bucket), "target_fps": _rate(target_fps),
                              "source": str(item.path)})
    finally:
        del vae
        _release(device)
    if failed:
        warnings.warn(f"skipped {len(failed)} clip(s) that failed while their frames were decoded: "
                      f"{listing(sorted(set(failed.values())))}", DataWarning, stacklevel=2)
    return stats, set(failed)


def _fill_masks(jobs: dict[str, tuple], folder: Path, vae_scale_factor: int) -> CacheStats:
    """The masks' latent-grid entries (no model: a resize of each mask)."""
    from leantune.data.masks import mask_grid

    stats, bad = CacheStats(), []
    for key, (mask, bucket) in jobs.items():
        path = folder / f"{key}.safetensors"
        if path.exists():
            problem = check_mask_entry(path, key, bucket, vae_scale_factor)
            if problem is None:
                stats.hits += 1
                continue
            bad.append((path, problem))
            stats.recomputed += 1
        else:
            stats.misses += 1
        save_safetensors({"mask": mask_grid(mask, bucket, vae_scale_factor)}, path,
                         {"format": FORMAT_VERSION, "kind": "mask", "key": key,
                          "bucket": f"{bucket[0]}x{bucket[1]}", "source": str(mask.path)})
    _warn_corrupt("mask", bad)
    return stats


def _caption(job) -> str:
    """A text job's caption: the job itself, or (caption, reference image paths)."""
    return job[0] if isinstance(job, tuple) else job


def _fill_text(jobs: dict[str, str], folder: Path, sources, dtype, device, max_length: int,
               load_text_encoders: Callable, family: ModelFamily, ram_budget: int | None = None) -> CacheStats:
    stats, todo, bad = CacheStats(), [], []
    dims: dict[str, tuple[int, int]] = {}
    for key, caption in jobs.items():
        path = folder / f"{key}.safetensors"
        if not path.exists():
            stats.misses += 1
            todo.append(key)
            continue
        rows = family.text_rows(max_length) if family.cuts_text else None     # a family that cuts none: any length
        problem, d = check_text_entry(path, key, _caption(caption), rows)
        if problem:
            bad.append((path, problem))
            stats.recomputed += 1
            todo.append(key)
        else:
            dims[key] = d
    # Entries under one encoder identity share their widths: a minority width means a damaged file.
    if dims:
        common, _ = Counter(dims.values()).most_common(1)[0]
        for key, d in dims.items():
            if d != common:
                bad.append((folder / f"{key}.safetensors",
                            f"widths (t5, pooled) {d} differ from the other entries' {common}"))
                stats.recomputed += 1
                todo.append(key)
        stats.hits = sum(1 for d in dims.values() if d == common)
    _warn_corrupt("text", bad)
    if not todo:
        return stats
    log.info("cache: encoding %d caption(s) with the text encoders", len(todo))
    with text_encoder_ram_budget(ram_budget):      # a larger encoder stays in its files (streamed_encoder.py)
        enc = load_text_encoders(sources, dtype, device)
    try:
        side = family.padding_side(enc)

        longer: list[int] = []          # rows of captions past what [data] max_text_length prices (no cut)

        def encode(keys: list[str]) -> None:
            captions = [_caption(jobs[k]) for k in keys]
            images = {"images": [[load_image(p, family.rgba) for p in jobs[k][1]] if isinstance(jobs[k], tuple) else None
                                 for k in keys]} if any(isinstance(jobs[k], tuple) for k in keys) else {}
            embeds, lengths = family.encode_prompts(captions, enc, max_length=max_length, device=device, **images)
            for i, key in enumerate(keys):
                n = int(lengths[i])
                if not family.cuts_text and n > family.text_rows(max_length):
                    longer.append(n)
                save_safetensors({"t5": _trim(embeds.t5[i], n, side).to(STORE_DTYPE),        # (n, D_t5)
                                  "pooled": embeds.pooled[i].to(STORE_DTYPE)},                # (D_clip,)
                                 folder / f"{key}.safetensors",
                                 {"format": FORMAT_VERSION, "kind": "text", "key": key, **_caption_header(captions[i]),
                                  "length": str(n)})

        chunks = [todo[start:start + TEXT_BATCH] for start in range(0, len(todo), TEXT_BATCH)]
        per_pass = max(1, TEXT_PASS // TEXT_BATCH)
        for first in range(0, len(chunks), per_pass):
            group = chunks[first:first + per_pass]
            moves: list = []
            run_pass([lambda keys=keys: encode(keys) for keys in group], state_budget=state_budget(device),
                     report=moves.extend)
            if moves:
                log.info("cache: %d caption(s) encoded layer-major: %d block load(s) over %d streamed block(s)",
                         sum(map(len, group)), len(moves), len({(id(s), i) for s, i in moves}))
        if longer:
            over = max(longer) - family.text_rows(max_length)
            log.warning("cache: %d caption(s) encode to more rows than [data] max_text_length = %d prices (the "
                        "longest %d rows, %d over): %s cuts no caption (as its pipeline), so the plan prices those "
                        "steps short; raise [data] max_text_length to %d", len(longer), max_length, max(longer),
                        over, family.name, max_length + over)
    finally:
        del enc
        _release(device)
    return stats


def sample_prompts(sample_cfg) -> list[str]:
    """The prompts a run samples with ([sample] negative_prompt and prompts), encoded with the
    captions so that sampling during training never reloads the text encoders."""
    return [sample_cfg.negative_prompt, *sample_cfg.prompts]


def _scan_with_references(data_cfg, base_dir, family: ModelFamily) -> tuple[list[ImageItem], list[VideoItem]]:
    """The datasets' (images, clips): clips only for a video family (dataset.scan_media; an image
    family's run reads images alone), images with their reference images (data/references.py) when
    a dataset names a reference_path. The reference keys are checked before any image is decoded (a family that
    takes none, the dataset's own folder as references), the references' encoded sizes before the
    model's files are looked at: each a `DataError` naming the file or key."""
    from leantune.data.dataset import scan_media
    from leantune.data.references import attach_references, check_reference_keys, encoded_size

    from leantune.data.masks import attach_masks

    check_reference_keys(data_cfg.datasets, base_dir, family)
    found, clips = scan_media(data_cfg, base_dir) if family.video is not None else (scan_datasets(data_cfg, base_dir), [])
    items = attach_masks(found, data_cfg.datasets, base_dir)
    if not any(getattr(d, "reference_path", None) for d in data_cfg.datasets):
        return items, clips
    items = attach_references(items, data_cfg.datasets, base_dir, family.references.most)
    bucket_sets = {r: bucket_sizes(r, multiple=family.side_multiple) for r in data_cfg.resolutions}
    for it in items:                   # a size the family cannot encode is told before its sources are read
        for r in set(data_cfg.resolutions) - it.too_small_for:
            for ref in it.references:
                encoded_size(ref, it.path, nearest_bucket(it.width, it.height, bucket_sets[r]), family, it.dataset)
    return items, clips


def sample_references(sample_cfg) -> list[str] | None:
    """What `prepare_caches` is given as `sample_references` for a run's [sample] section: its
    references (an empty list: the dataset's first), or None when it has no prompts to sample."""
    return list(sample_cfg.references) if sample_cfg.prompts else None


def sample_reference_images(paths: Sequence[str] | None, items: list[ImageItem], base_dir,
                            family: ModelFamily) -> tuple:
    """The reference images the run's samples are conditioned on (data/references.py ReferenceImage):
    [sample] references when given, else the first target's references (so an edit LoRA's samples
    show the edit it learns); () for a family without references or a run that does not sample
    (`paths` None). Errors name [sample] references and the file."""
    from .dataset import DataError, inspect_image
    from .references import ReferenceImage, check_aspect

    if paths is None:
        return ()
    if family.references is None:
        if paths:
            raise DataError(f"[sample] references: family = \"{family.name}\" takes no reference images (an edit "
                            f"family does, e.g. qwen-image-edit); remove the key")
        return ()
    if family.references.sampling_latents is None:      # the family samples without references as yet
        if paths:
            raise DataError(f"[sample] references: family = \"{family.name}\" cannot sample with reference images "
                            f"yet (its ReferenceConditioning has no sampling_latents); remove the key")
        return ()
    if not paths:
        return next((it.references for it in items if it.references), ())
    if len(paths) > family.references.most:
        raise DataError(f"[sample] references: {len(paths)} images, but {family.name} takes at most "
                        f"{family.references.most}")
    out = []
    for value in paths:
        path = resolve_path(base_dir, value)
        if not path.is_file():
            raise DataError(f"[sample] references: {path}: no such image file")
        try:
            digest, w, h = inspect_image(path)
        except Exception as e:
            raise DataError(f"[sample] references: {path} cannot be read: {type(e).__name__}: {e}") from None
        out.append(ReferenceImage(path, digest, w, h))
        check_aspect(out[-1], f"[sample] references: {path}")
    return tuple(out)


def _sampling_reference_key(ref, vae_id: str, dtype: torch.dtype, shape: tuple | None = None) -> str:
    """A sample reference's latent entry: encoded as the family's pipeline samples, not at a bucket
    (a first frame's condition at the samples' (width, height, frames), `shape`)."""
    if shape is not None:
        return _digest("sampling-first-frame", ref.sha256, list(shape), vae_id, str(dtype))
    return _digest("sampling-reference", ref.sha256, vae_id, str(dtype))


def _fill_sampling_references(refs: tuple, keys: list[str], folder: Path, sources, dtype, device,
                              load_vae: Callable, family: ModelFamily, shape: tuple | None = None) -> None:
    """Encode the sample references the family's way (ReferenceConditioning.sampling_latents) once;
    later runs read them from the cache."""
    todo = [(r, k) for r, k in zip(refs, keys) if not (folder / f"{k}.safetensors").exists()]
    if not todo:
        return
    log.info("cache: encoding %d sample reference image(s) with the VAE", len(todo))
    vae = load_vae(sources, dtype, device)
    try:
        for ref, key in todo:
            sized = {} if shape is None else dict(zip(("width", "height", "frames"), shape))   # a first frame's
            image = load_image(ref.path, family.rgba)
            (latent,) = family.references.sampling_latents(vae, [image], **sized)       # (1, C, h, w)
            save_safetensors({"latent": latent[0].to(STORE_DTYPE)}, folder / f"{key}.safetensors",
                             {"format": FORMAT_VERSION, "kind": "latent", "key": key, "source": str(ref.path)})
    finally:
        del vae
        _release(device)


def _text_refs(item: ImageItem, family: ModelFamily) -> tuple[str, ...]:
    """The content hashes of the references the family's text encoder reads with this caption."""
    if not item.references or family.references is None or not family.references.text_sees_images:
        return ()
    return tuple(r.sha256 for r in item.references)


def _warn_split_batches(data: "CachedData") -> None:
    """Targets of one bucket whose references are encoded at different sizes train in separate
    batches (like targets of different buckets): say so when that leaves batches short of
    [data] batch_size, since the user asked for that many per step."""
    order = data._order(data.batch_size, 0)
    if data.batch_size == 1 or not getattr(order, "splits_buckets", False):     # a MixedOrder: not checked
        return
    plain = BatchOrder([s.bucket for s in data.samples], data.batch_size, 0, data.shuffle).batches_per_epoch
    if order.batches_per_epoch == plain:
        return
    first = {}
    for s in data.samples:
        first.setdefault((s.bucket, s.reference_sizes), s.item.references[0].path)
    shown = [f"{p} ({'+'.join(f'{w}x{h}' for w, h in refs)})" for (_, refs), p in first.items()]
    warnings.warn(f"targets of one bucket whose references are encoded at different sizes train in separate batches "
                  f"(a batch stacks references of one size): {order.batches_per_epoch} batches per epoch instead of "
                  f"{plain} at [data] batch_size {data.batch_size}, some of them short; references such as "
                  f"{listing(shown, 3)}; give each bucket's references one size for full batches",
                  DataWarning, stacklevel=3)


def sample_shape(sample_cfg, data_cfg) -> tuple[int, int, int]:
    """(width, height, frames) of a run's samples, what `prepare_caches` is given as `sample_shape`:
    [sample] frames, unset: [data] max_frames (the length a video family trains at)."""
    frames = getattr(sample_cfg, "frames", None)
    frames = getattr(data_cfg, "max_frames", None) if frames is None else frames
    return (sample_cfg.width, sample_cfg.height, frames or 1)


def first_frame_key(latent_key_: str) -> str:
    """A clip's first-frame condition entry (an image-to-video model's), beside its latent entry
    `latent_key_` (which holds everything that determines the clip's frames): a kind of its own, so
    neither a clip's latents nor a text-to-video run's entry is ever read as a condition."""
    return _digest("clip-first-frame", latent_key_)


def first_frame_jobs(samples: list, clip_list: list, clip_jobs: dict, data_cfg, vae_id: str, dtype: torch.dtype):
    """An image-to-video run's (image samples, clip samples, condition jobs): every clip sample gets its
    first-frame condition as its one reference entry (key -> (clip, bucket), as clip_jobs); still
    images are dropped with a warning naming them (a one-frame video whose condition is the frame
    itself teaches the model nothing but to copy it)."""
    from dataclasses import replace

    from .dataset import DataError

    stills = sorted({str(s.item.path) for s in samples})
    if not clip_list:
        only = f" (only still images: {listing(stills)})" if stills else ""
        raise DataError(f"[[data.datasets]]: an image-to-video model trains on clips (each conditioned on its own "
                        f"first frame), and the datasets hold none{only}; add clips, or train a text-to-video model")
    if stills:
        warnings.warn(f"an image-to-video model trains on clips, each conditioned on its own first frame: "
                      f"{len(stills)} still image(s) skipped: {listing(stills)}", DataWarning, stacklevel=3)
    jobs = {first_frame_key(k): job for k, job in clip_jobs.items()}
    clips = [replace(s, reference_keys=(first_frame_key(s.latent_key),)) for s in clip_list]
    return [], clips, jobs


def frame_embedding_key(latent_key_: str, encoder_id: str) -> str:
    """A clip's first-frame image embedding entry (ReferenceConditioning.frame_embedding: Wan 2.1 I2V's
    CLIP one), beside its latent entry `latent_key_` (which holds everything that determines the
    clip's frames) and keyed by the image encoder: a changed clip or encoder re-encodes."""
    return _digest("clip-first-frame-embedding", latent_key_, encoder_id)


def _sampling_embedding_key(ref, encoder_id: str) -> str:
    """A sample first frame's image embedding entry (the image itself is embedded, at no bucket)."""
    return _digest("sampling-first-frame-embedding", ref.sha256, encoder_id)


def _frame_embedding_encoder(embedding) -> Callable:
    """fill_clip_latents' `encode` for embedding entries: the clip's first frame, decoded as its latent
    entry decodes it, embedded by the family's image encoder ((L, D))."""
    def encode(encoder, item: VideoItem, bucket: ClipBucket, target_fps, start_s: float) -> torch.Tensor:
        from leantune.data.video_vae import iter_clip_frames

        first = next(iter_clip_frames(item.path, target_fps=target_fps, num_frames=1, start_s=start_s,
                                      size=bucket[:2], sequence_fps=item.fps))
        return embedding.embed(encoder, first)[0]

    return encode


def _fill_sampling_embeddings(refs: tuple, keys: list[str], folder: Path, embedding, dtype, device, family) -> None:
    """Embed the sample first frames with the family's image encoder once; later runs read them."""
    todo = [(r, k) for r, k in zip(refs, keys) if not (folder / f"{k}.safetensors").exists()]
    if not todo:
        return
    log.info("cache: embedding %d sample first frame(s) with the image encoder", len(todo))
    encoder = embedding.load(dtype, device)
    try:
        for ref, key in todo:
            vector = embedding.embed(encoder, load_image(ref.path, family.rgba))          # (1, L, D)
            save_safetensors({"latent": vector[0].to(STORE_DTYPE)}, folder / f"{key}.safetensors",
                             {"format": FORMAT_VERSION, "kind": "latent", "key": key, "source": str(ref.path)})
    finally:
        del encoder
        _release(device)


def _condition_shape(family: ModelFamily, bucket: ClipBucket) -> tuple[int, int, int, int]:
    """(C', T', h, w) of a clip's first-frame condition entry: the mask's channels and the latents'."""
    c, t, h, w = _clip_shape(family, bucket)
    return (family.video.temporal_factor + c, t, h, w)


def _first_frame_encoder(family: ModelFamily) -> Callable:
    """fill_clip_latents' `encode` for condition entries: the clip's first frame, decoded as its
    latent entry decodes it (data/video_vae.iter_clip_frames: the same pick, resize and scale), then
    the family's condition of a video of the clip's length (ReferenceConditioning.clip_condition)."""
    def encode(vae, item: VideoItem, bucket: ClipBucket, target_fps, start_s: float) -> torch.Tensor:
        from leantune.data.video_vae import iter_clip_frames

        first = next(iter_clip_frames(item.path, target_fps=target_fps, num_frames=1, start_s=start_s,
                                      size=bucket[:2], sequence_fps=item.fps))
        return family.references.clip_condition(vae, first, bucket[2])

    return encode


def check_sample_first_frame(paths, refs: tuple, first_frame: bool, sources, either: bool = False) -> None:
    """An image-to-video run that samples needs [sample] references' one first-frame image; a
    text-to-video one takes none. `paths`: [sample] references (None: the run does not sample);
    `either`: the model trains both ways ([model] image_to_video says which), so the errors name it."""
    from .dataset import DataError

    if paths is None:
        return
    if first_frame and not refs:
        what = "[model] image_to_video = true trains" if either else f"{sources.transformer} is"
        raise DataError(f"[sample] references: {what} an image-to-video model: its samples start "
                        f"from a first-frame image; set [sample] references = [\"first.png\"]")
    if refs and not first_frame:
        if either:
            raise DataError(f"[sample] references: this run trains {sources.transformer} text-to-video, whose samples "
                            f"take no first-frame image; set [model] image_to_video = true to train and sample it "
                            f"image-to-video, or remove the key")
        raise DataError(f"[sample] references: {sources.transformer} is a text-to-video model; it takes no "
                        f"first-frame image; remove the key")


def family_clip_rate(data_cfg, family):
    """[data] with target_fps at the video family's own rate (ModelFamily.video.fps: Wan 2.2 TI2V-5B's
    24, A14B's 16) where the config leaves it unset, so clips train at the rate the model was trained
    and samples at; a value the config sets is kept. A copy: the validated config stays as it is."""
    if family.video is None or "target_fps" in getattr(data_cfg, "model_fields_set", {"target_fps"}):
        return data_cfg
    return data_cfg.model_copy(update={"target_fps": family.video.fps})


def prepare_caches(data_cfg, model_cfg, base_dir: str | Path, device, dtype: torch.dtype,
                   load_vae: Callable | None = None, load_text_encoders: Callable | None = None,
                   extra_prompts: Sequence[str] | None = None,
                   sample_references: Sequence[str] | None = None, ram_budget: int | None = None,
                   validation=None, sample_shape: tuple[int, int, int] | None = None) -> "CachedData":
    """Scan the datasets, fill the caches, free the encoders; return what the trainer reads.

    `data_cfg` and `model_cfg` are the run's [data] and [model] sections, `base_dir` the folder their
    relative paths start from. The loaders are called as `load_vae(sources, dtype, device)` and
    `load_text_encoders(sources, dtype, device)` (the [model] family's by default) and only when an
    entry of their kind is missing or corrupt. Besides the captions, the empty caption (caption
    dropout, unconditional use) and `extra_prompts` (the callers pass [sample] prompts and its
    negative prompt) are encoded in the same pass, so sampling during training never reloads the
    text encoders. For an edit family, `sample_references` ([sample] references; an empty list: the
    first target's references; None: the run does not sample) are VAE-encoded as the pipeline
    samples, and `extra_prompts` are encoded with them when the text encoder reads images
    (`CachedData.sample_references`, `prompt_embeds(..., references=True)`).
    `ram_budget` (bytes; the run's [memory] ram_budget, None: the RAM available) decides whether a
    text encoder too large for it is read from its files layer by layer instead of loaded.
    `validation` (the run's [validation]): its held-out images are cached in the same pass and kept
    out of the training samples (`CachedData.validation_samples`, data/held_out.py).
    An image-to-video model (ReferenceConditioning.first_frame) trains on clips, each conditioned on
    its own first frame (an entry of its own, `first_frame_jobs`); its samples' first frame is
    [sample] references' one image, encoded at `sample_shape` ((width, height, frames), sample_shape()).
    """
    from leantune.data.references import encoded_size

    family = get_family(model_cfg.family)
    data_cfg = family_clip_rate(data_cfg, family)
    items, clips = _scan_with_references(data_cfg, base_dir, family)
    sources = family.resolve_sources(model_cfg, Path(base_dir))
    # A family that keeps the alpha channel (ModelFamily.rgba) reads transparent images otherwise
    # than one that composites them over white: its entries have keys of their own.
    alpha = "+rgba" if family.rgba else ""
    vae_id = component_identity(sources.vae) + alpha
    encoders_id = "+".join(component_identity(getattr(sources, n)) for n in family.text_sources) + alpha
    max_length = data_cfg.max_text_length
    cache_dir = resolve_path(base_dir, data_cfg.cache_dir)

    bucket_sets = {r: bucket_sizes(r, multiple=family.side_multiple) for r in data_cfg.resolutions}
    samples: list[Sample] = []
    latent_jobs: dict[str, tuple[ImageItem, Bucket]] = {}
    mask_jobs: dict[str, tuple] = {}
    held_out: list[ImageItem] = []
    if validation is not None and validation.enabled:
        from leantune.data.held_out import split_held_out

        items, held_out = split_held_out(items, validation, data_cfg, base_dir, family)
    held_ids = {id(it) for it in held_out}
    validation_samples: list[Sample] = []
    for item in items + held_out:
        for res in data_cfg.resolutions:
            if res in item.too_small_for:       # would be upscaled past [[data.datasets]] min_size
                continue
            bucket = nearest_bucket(item.width, item.height, bucket_sets[res])
            key = latent_key(item.sha256, bucket, vae_id, dtype)
            latent_jobs[key] = (item, bucket)
            ref_keys, ref_sizes = [], []
            for ref in item.references:           # cached like targets, at the family's size for this bucket
                ref_sizes.append(encoded_size(ref, item.path, bucket, family, item.dataset))
                ref_keys.append(latent_key(ref.sha256, ref_sizes[-1], vae_id, dtype))
                latent_jobs[ref_keys[-1]] = (ref, ref_sizes[-1])
            seen_refs = _text_refs(item, family)
            m_key = None
            if item.mask is not None:
                m_key = mask_key(item.mask.sha256, bucket, family.vae_scale_factor)
                mask_jobs[m_key] = (item.mask, bucket)
            prior = item.dataset < len(data_cfg.datasets) and data_cfg.datasets[item.dataset].role == "prior"
            sample = Sample(item, res, bucket, key, tuple(ref_keys), seen_refs, tuple(ref_sizes),
                            m_key, item.mask.floor if item.mask is not None else 0.0, prior)
            if id(item) in held_ids:
                validation_samples.append(sample)       # once, never trained on
            else:
                samples.extend([sample] * item.repeats)

    clip_list, clip_jobs = clip_samples(clips, data_cfg, vae_id, dtype, multiple=family.side_multiple) \
        if clips else ([], {})
    first_frame = family.references is not None and family.references.takes_first_frame(sources)
    condition_jobs: dict = {}
    embedding_jobs: dict = {}
    embedding = None
    if first_frame:                  # each clip conditioned on its own first frame; stills dropped
        samples, clip_list, condition_jobs = first_frame_jobs(samples, clip_list, clip_jobs, data_cfg, vae_id, dtype)
        latent_jobs, mask_jobs, validation_samples = {}, {}, []
        if family.references.frame_embedding is not None:
            embedding = family.references.frame_embedding(sources)
    if embedding is not None:        # and by that frame's image embedding (Wan 2.1 I2V's CLIP), a second entry
        from dataclasses import replace

        embedding_id = "+".join(component_identity(p) for p in embedding.paths) + alpha
        embedding_jobs = {frame_embedding_key(k, embedding_id): job for k, job in clip_jobs.items()}
        clip_list = [replace(s, reference_keys=s.reference_keys + (frame_embedding_key(s.latent_key, embedding_id),))
                     for s in clip_list]
    samples.extend(clip_list)        # a clip bucket (w, h, frames) never shares a batch with an image's (w, h)

    prompts = [it.caption for it in items + held_out + clips] + [""] + list(extra_prompts or ())
    text_keys = {p: text_key(p, encoders_id, max_length, dtype) for p in prompts}
    text_jobs = {k: p for p, k in text_keys.items()}
    # A text encoder that reads the references (an edit model's VLM): one entry per caption and
    # references, the empty caption (dropout) included, keyed by their content too.
    for it in items + held_out:
        refs = _text_refs(it, family)
        if refs:
            paths = tuple(r.path for r in it.references)
            for caption in (it.caption, ""):
                k = text_key(caption, encoders_id + "|references:" + ",".join(refs), max_length, dtype)
                text_keys[(caption, refs)] = k
                text_jobs[k] = (caption, paths)

    sample_refs = sample_reference_images(sample_references, items, base_dir, family)
    # Wan 2.2 TI2V-5B trains either way ([model] image_to_video): its clips' condition is their own
    # first latent frame (no entry of its own), its samples' first frame [sample] references' image
    samples_first = first_frame or getattr(model_cfg, "image_to_video", False)
    if family.references is not None and family.references.first_frame is not None:
        check_sample_first_frame(sample_references, sample_refs, samples_first, sources,
                                 either=family.references.first_frame_optional)
    ref_shape = tuple(sample_shape) if samples_first and sample_shape is not None else None
    sample_ref_keys = [_sampling_reference_key(r, vae_id, dtype, ref_shape) for r in sample_refs]
    sample_text_refs = ()
    if sample_refs and family.references.text_sees_images:
        sample_text_refs = tuple(r.sha256 for r in sample_refs)
        paths = tuple(r.path for r in sample_refs)
        for prompt in extra_prompts or ():
            k = text_key(prompt, encoders_id + "|references:" + ",".join(sample_text_refs), max_length, dtype)
            text_keys[(prompt, sample_text_refs)] = k
            text_jobs[k] = (prompt, paths)

    from leantune.disk import disk_full_guard

    def latent_bytes() -> int:     # what the latents need (bf16); the text entries come on top
        f = family.vae_scale_factor
        return (sum(family.latent_channels * (b[0] // f) * (b[1] // f) * 2 for _, b in latent_jobs.values())
                + sum(math.prod(_clip_shape(family, b)) * 2 for _, b in clip_jobs.values()))

    with disk_full_guard(cache_dir, latent_bytes, "every entry already written is intact and reused next time"):
        stats = {
            "latents": _fill_latents(latent_jobs, cache_dir / "latents", sources, dtype, device,
                                     load_vae or family.load_vae, family),
            "text": _fill_text(text_jobs, cache_dir / "text", sources, dtype, device, max_length,
                               load_text_encoders or family.load_text_encoders, family, ram_budget),
        }
        if mask_jobs:
            stats["masks"] = _fill_masks(mask_jobs, cache_dir / "masks", family.vae_scale_factor)
        if clip_jobs:
            stats["clips"], failed = fill_clip_latents(clip_jobs, cache_dir / "latents", sources, dtype, device,
                                                       family.video.load_vae, data_cfg.target_fps,
                                                       lambda b: _clip_shape(family, b))
            samples = [s for s in samples if s.latent_key not in failed]      # named in fill_clip_latents' warning
        if condition_jobs:
            stats["first_frames"], failed = fill_clip_latents(
                condition_jobs, cache_dir / "latents", sources, dtype, device, family.video.load_vae,
                data_cfg.target_fps, lambda b: _condition_shape(family, b), encode=_first_frame_encoder(family),
                kind="clip-first-frame")
            samples = [s for s in samples if not set(s.reference_keys) & failed]
        if embedding_jobs:
            stats["first_frame_embeddings"], failed = fill_clip_latents(
                embedding_jobs, cache_dir / "latents", sources, dtype, device,
                lambda _sources, d, dev: embedding.load(d, dev), data_cfg.target_fps, lambda b: embedding.shape,
                encode=_frame_embedding_encoder(embedding), kind="clip-first-frame-embedding")
            samples = [s for s in samples if not set(s.reference_keys) & failed]
        if samples_first and sample_shape is None:
            sample_refs, sample_ref_keys = (), []   # a caller that does not sample (leantune cache)
        _fill_sampling_references(sample_refs, sample_ref_keys, cache_dir / "latents", sources, dtype, device,
                                  load_vae or family.load_vae, family, ref_shape)
        if embedding is not None and sample_refs:     # each sample first frame's embedding after its condition
            embedding_keys = [_sampling_embedding_key(r, embedding_id) for r in sample_refs]
            _fill_sampling_embeddings(sample_refs, embedding_keys, cache_dir / "latents", embedding, dtype, device,
                                      family)
            sample_ref_keys = list(sample_ref_keys) + embedding_keys
    if len(samples) < data_cfg.batch_size:
        warnings.warn(f"[data] batch_size {data_cfg.batch_size} is larger than the dataset ({len(samples)} samples "
                      f"with repeats, over all resolutions): every batch holds at most {len(samples)}; lower "
                      f"batch_size or add images", DataWarning, stacklevel=2)
    data = CachedData(cache_dir, samples, text_keys, data_cfg.batch_size, data_cfg.shuffle, stats,
                      prior_ratio=data_cfg.prior_ratio)
    _warn_split_batches(data)
    data.sample_references = sample_refs
    data.sample_reference_keys = sample_ref_keys
    data.sample_text_refs = sample_text_refs
    data.validation_samples = validation_samples
    if validation_samples:
        log.info("validation: %d held-out image(s), %d sample(s) over the resolutions", len(held_out),
                 len(validation_samples))
    log.info("cache: %s", data.summary())
    return data


# -- reading batches -----------------------------------------------------------------------------

def _pad_t5(rows: list[torch.Tensor], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """[(L_i, D)] -> (B, max L_i, D) zero-padded after each sequence, and lengths (B,)."""
    longest = max(r.shape[0] for r in rows)
    out = torch.zeros(len(rows), longest, rows[0].shape[1], dtype=dtype)
    for i, r in enumerate(rows):
        out[i, : r.shape[0]] = r.to(dtype)
    return out, torch.tensor([r.shape[0] for r in rows])


class CachedData:
    """The cached dataset: sample list, entry locations, batch iterators and prompt embeddings."""

    def __init__(self, cache_dir: Path, samples: list[Sample], text_keys: dict[str, str], batch_size: int,
                 shuffle: bool, stats: dict[str, CacheStats], prior_ratio: float = 0.25):
        self.cache_dir = Path(cache_dir)
        self.samples = samples
        self.text_keys = text_keys            # prompt -> entry key
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.stats = stats
        self.prior_ratio = prior_ratio        # the share of batches of prior images, when there are any
        self.num_items = len(samples)         # per epoch: images x resolutions x repeats
        self.batches_per_epoch = self._order(batch_size, 0).batches_per_epoch
        # What the run's samples are conditioned on (an edit family; prepare_caches fills them)
        self.sample_references: tuple = ()          # ReferenceImage, one per reference
        self.sample_reference_keys: list[str] = []   # their latent entries, encoded as the pipeline samples
        self.sample_text_refs: tuple[str, ...] = ()  # their hashes, when the text encoder reads them
        self.validation_samples: list[Sample] = []   # the held-out images ([validation]), one sample each

    @property
    def buckets(self) -> dict[Bucket, int]:
        """Samples per bucket in one epoch."""
        return dict(Counter(s.bucket for s in self.samples))

    def summary(self) -> str:
        masks = f"; masks: {self.stats['masks']}" if "masks" in self.stats else ""
        masks += f"; clips: {self.stats['clips']}" if "clips" in self.stats else ""
        masks += f"; first frames: {self.stats['first_frames']}" if "first_frames" in self.stats else ""
        return (f"{self.num_items} samples in {len(self.buckets)} bucket(s), {self.batches_per_epoch} batches per "
                f"epoch; latents: {self.stats['latents']}; text: {self.stats['text']}{masks}")

    def batches(self, seed: int, state: dict | None = None, dtype: torch.dtype = torch.float32,
                batch_size: int | None = None) -> "BatchIterator":
        """An endless iterator of batches in the seeded order; `state` resumes a saved position.
        `batch_size` overrides [data] batch_size (several processes draw one global batch)."""
        order = self._order(batch_size or self.batch_size, seed)
        it = BatchIterator(self, order, dtype)
        if state is not None:
            it.load_state_dict(state)
        return it

    def _order(self, batch_size: int, seed: int) -> BatchOrder:
        """The batch order; a batch holds samples of one bucket whose references are encoded at
        the same sizes (a batch stacks one tensor per reference slot)."""
        if any(s.prior for s in self.samples):
            from leantune.data.buckets import MixedOrder

            train = [i for i, s in enumerate(self.samples) if not s.prior]
            prior = [i for i, s in enumerate(self.samples) if s.prior]
            return MixedOrder(self._order_of([self.samples[i] for i in train], batch_size, seed), train,
                              self._order_of([self.samples[i] for i in prior], batch_size, seed + 1), prior,
                              self.prior_ratio)
        return self._order_of(self.samples, batch_size, seed)

    def _order_of(self, samples: list[Sample], batch_size: int, seed: int) -> BatchOrder:
        groups = [s.reference_sizes for s in samples] if any(s.reference_sizes for s in samples) else None
        return BatchOrder([s.bucket for s in samples], batch_size, seed, self.shuffle,
                          dropout=[s.item.caption_dropout for s in samples], groups=groups)

    def latent(self, sample: Sample) -> torch.Tensor:
        """(16, h, w) bf16 latents of one sample."""
        return self.latent_entry(sample.latent_key)

    def latent_entry(self, key: str) -> torch.Tensor:
        """(C, h, w) bf16 latents of one latent entry (a target's or a reference's)."""
        return _read(self.cache_dir / "latents" / f"{key}.safetensors")[0]["latent"]

    def text_entry(self, prompt: str, references: tuple[str, ...] = ()) -> tuple[torch.Tensor, torch.Tensor]:
        """(t5 (L, D_t5), pooled (D_clip,)) of a prompt encoded by `prepare_caches` (with the
        reference images of these content hashes, for a text encoder that reads them)."""
        key = self.text_keys.get((prompt, references) if references else prompt)
        if key is None:
            raise KeyError(f"prompt {prompt!r} was not encoded by prepare_caches; pass it in [sample] prompts "
                           f"or extra_prompts")
        tensors, _ = _read(self.cache_dir / "text" / f"{key}.safetensors")
        return tensors["t5"], tensors["pooled"]

    def prompt_embeds(self, prompts: Sequence[str], dtype: torch.dtype = torch.float32,
                      references: bool = False) -> PromptEmbeds:
        """Embeddings of cached prompts (e.g. the sample prompts): t5 (B, L, D) zero-padded, pooled (B, D).
        `references`: as encoded with the sample references (an edit family whose text encoder reads them)."""
        refs = self.sample_text_refs if references else ()
        rows = [self.text_entry(p, refs) for p in prompts]
        t5, _ = _pad_t5([r[0] for r in rows], dtype)
        return PromptEmbeds(t5=t5, pooled=torch.stack([r[1] for r in rows]).to(dtype))


    def validation_batches(self, dtype: torch.dtype = torch.float32) -> list[Batch]:
        """The held-out samples as batches of [data] batch_size within each bucket, in a fixed
        order (bucket, then file), with their own captions: the same batches at every evaluation
        and in every run over the same images."""
        by_bucket: dict = {}
        for s in sorted(self.validation_samples, key=lambda s: (s.bucket, s.reference_sizes, str(s.item.path))):
            by_bucket.setdefault((s.bucket, s.reference_sizes), []).append(s)
        reader = BatchIterator(self, None, dtype)
        out = []
        for group in by_bucket.values():
            for i in range(0, len(group), self.batch_size):
                chunk = group[i:i + self.batch_size]
                out.append(reader.assemble(chunk, [s.item.caption for s in chunk], chunk[0].bucket))
        return out

    def sample_reference_latents(self) -> list[torch.Tensor]:
        """The sample references' latents, one (1, C, h, w) bf16 tensor each ([] for none)."""
        return [self.latent_entry(k)[None] for k in self.sample_reference_keys]


class BatchIterator:
    """Assembles `Batch`es from the cache in `BatchOrder`'s sequence; its position is resumable."""

    def __init__(self, data: CachedData, order: BatchOrder, dtype: torch.dtype):
        self.data, self.order, self.dtype = data, order, dtype

    @property
    def epoch(self) -> int:
        return self.order.epoch

    def __iter__(self) -> Iterator[Batch]:
        return self

    def __next__(self) -> Batch:
        slot = next(self.order)
        samples = [self.data.samples[i] for i in slot.samples]
        captions = ["" if drop else s.item.caption for s, drop in zip(samples, slot.dropped)]
        batch = self.assemble(samples, captions, slot.bucket)
        batch.prior = slot.prior
        return batch

    def assemble(self, samples: list[Sample], captions: list[str], bucket: Bucket) -> Batch:
        """The Batch of these samples (of one bucket) with these captions, read from the cache."""
        latents = torch.stack([self.data.latent(s) for s in samples]).to(self.dtype)   # (B, 16, h, w)
        rows = [self.data.text_entry(c, s.text_refs) for c, s in zip(captions, samples)]
        t5, lengths = _pad_t5([r[0] for r in rows], self.dtype)                        # (B, L, D_t5)
        pooled = torch.stack([r[1] for r in rows]).to(self.dtype)                       # (B, D_clip)
        return Batch(latents=latents, embeds=PromptEmbeds(t5=t5, pooled=pooled), bucket=bucket,
                     captions=captions, t5_lengths=lengths, references=self._references(samples),
                     loss_weights=self._loss_weights(samples, latents.shape[-2:]))

    def _loss_weights(self, samples, grid) -> torch.Tensor | None:
        """(B, 1, h, w) float32 loss weights for a batch with a masked sample (weight 1 for the
        unmasked ones), or None: the plain loss, unchanged, for batches without masks."""
        if all(s.mask_key is None for s in samples):
            return None
        from leantune.data.masks import loss_weights

        rows = []
        for s in samples:
            if s.mask_key is None:
                rows.append(torch.ones(1, *grid))
                continue
            path = self.data.cache_dir / "masks" / f"{s.mask_key}.safetensors"
            m = _read(path)[0]["mask"]
            if tuple(m.shape[-2:]) != tuple(grid):
                raise CacheError(f"{path}: mask grid {tuple(m.shape[-2:])} does not match its latents' {tuple(grid)}")
            rows.append(loss_weights(m, s.mask_floor))
        return torch.stack(rows)

    def _references(self, samples) -> list[torch.Tensor] | None:
        """One (B, C, h_r, w_r) tensor per reference slot, or None for a batch without references
        (the batch order puts only references of one size per slot in a batch)."""
        if not samples[0].reference_keys:
            return None
        return [torch.stack([self.data.latent_entry(s.reference_keys[j]) for s in samples]).to(self.dtype)
                for j in range(len(samples[0].reference_keys))]

    def state_dict(self) -> dict:
        return self.order.state_dict()

    def load_state_dict(self, state: dict, strict: bool = True) -> None:
        self.order.load_state_dict(state, strict=strict)
